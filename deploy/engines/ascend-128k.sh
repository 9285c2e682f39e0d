#!/usr/bin/env bash
# ascend-128k: Ascend 950, vllm-ascend (example sizing).
# One engine instance (one gateway worker) of pool ascend-128k: vllm-ascend (vLLM's OpenAI server) on 1 node(s) x 16 Ascend 950,
# TP 16 x PP 1 x DP 1, EP 16, mxfp4, max context 131,072 tokens; the pool runs 1 of these.
# Generated from config/plans/ascend.yaml by `kimi-gateway plan config/k3-production.yaml --emit deploy/engines`.
# Do not edit: change the plan and emit again (tests/unit/test_plans.py fails on drift).
# Environment: MODEL_PATH (weights, default the Hugging Face repo), HOST (default 0.0.0.0), ASCEND_API_KEY (required).
set -euo pipefail
: "${ASCEND_API_KEY:?set ASCEND_API_KEY: the bearer key the gateway sends pool ascend-128k}"
export VLLM_API_KEY="$ASCEND_API_KEY"  # vLLM reads its key from here, not argv
exec vllm serve "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 8000 \
  --served-model-name moonshotai/Kimi-K3 \
  --max-model-len 131072 \
  --tensor-parallel-size 16 \
  --enable-expert-parallel \
  --gpu-memory-utilization 0.9 \
  --trust-remote-code
