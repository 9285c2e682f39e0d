#!/usr/bin/env bash
# vllm-128k: Plan A, minimum viable (1 x 8 B300, vLLM), on Kubernetes (deploy/kubernetes/generate.py; the flags are deploy/engines/vllm-128k.sh's).
# The engine key comes from the environment (VLLM_API_KEY), never the command line (/proc/PID/cmdline).
set -euo pipefail
: "${VLLM_API_KEY:?set VLLM_API_KEY: the bearer key the gateway sends pool vllm-128k}"
exec vllm serve \
  "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 8000 \
  --served-model-name moonshotai/Kimi-K3 \
  --max-model-len 131072 \
  --tensor-parallel-size 8 \
  --enable-expert-parallel \
  --gpu-memory-utilization 0.95 \
  --trust-remote-code \
  --safetensors-load-strategy eager \
  --shutdown-timeout 45
