#!/usr/bin/env bash
# nvl72-1m: Plan C, full power (GB200 NVL72 rack, vLLM).
# One engine instance (one gateway worker) of pool nvl72-1m: vLLM OpenAI server on 18 node(s) x 4 GB200,
# TP 8 x PP 3 x DP 3, EP 72, mxfp4, max context 1,048,576 tokens; the pool runs 1 of these.
# Generated from config/plans/plan-c.yaml by `kimi-gateway plan config/k3-production.yaml --emit deploy/engines`.
# Do not edit: change the plan and emit again (tests/unit/test_plans.py fails on drift).
# Environment: MODEL_PATH (weights, default the Hugging Face repo), HOST (default 0.0.0.0), NVL72_API_KEY (required); NODE_RANK (0 on the head node); HEAD_ADDRESS (node 0's host, on the other nodes).
set -euo pipefail
: "${NVL72_API_KEY:?set NVL72_API_KEY: the bearer key the gateway sends pool nvl72-1m}"
export VLLM_API_KEY="$NVL72_API_KEY"  # vLLM reads its key from here, not argv
export VLLM_RAY_DP_PACK_STRATEGY=span  # ray_pack_strategy_env: a data-parallel rank spans nodes
: "${NODE_RANK:?set NODE_RANK: the rank of this node, 0..17}"
# Node 0 starts the Ray head and serves; nodes 1..17 join its cluster (start them within Ray's connect timeout): vLLM places its 72 workers on the cluster's devices.
if [ "$NODE_RANK" != 0 ]; then
  : "${HEAD_ADDRESS:?set HEAD_ADDRESS: the head node (rank 0) host}"
  exec ray start --address "$HEAD_ADDRESS:6379" --block
fi
ray start --head --port 6379
exec vllm serve "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 8000 \
  --served-model-name moonshotai/Kimi-K3 \
  --max-model-len 1048576 \
  --tensor-parallel-size 8 \
  --pipeline-parallel-size 3 \
  --data-parallel-size 3 \
  --enable-expert-parallel \
  --gpu-memory-utilization 0.9 \
  --enable-chunked-prefill \
  --trust-remote-code \
  --distributed-executor-backend ray \
  --data-parallel-backend ray
