#!/usr/bin/env bash
# vllm-128k: Plan A, minimum viable (1 x 8 B300, vLLM).
# One engine instance (one gateway worker) of pool vllm-128k: vLLM OpenAI server on 1 node(s) x 8 B300,
# TP 8 x PP 1 x DP 1, EP 8, mxfp4, max context 131,072 tokens; the pool runs 2 of these.
# Generated from config/plans/plan-a.yaml by `kimi-gateway plan config/k3-production.yaml --emit deploy/engines`.
# Do not edit: change the plan and emit again (tests/unit/test_plans.py fails on drift).
# Environment: MODEL_PATH (weights, default the Hugging Face repo), HOST (default 0.0.0.0), VLLM_API_KEY (required).
set -euo pipefail
: "${VLLM_API_KEY:?set VLLM_API_KEY: the bearer key the gateway sends pool vllm-128k}"
exec vllm serve "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 8000 \
  --served-model-name moonshotai/Kimi-K3 \
  --max-model-len 131072 \
  --tensor-parallel-size 8 \
  --enable-expert-parallel \
  --gpu-memory-utilization 0.95 \
  --trust-remote-code
