#!/usr/bin/env bash
# ascend-128k: Ascend 950, vllm-ascend (example sizing), on Kubernetes (deploy/kubernetes/generate.py; the flags are deploy/engines/ascend-128k.sh's).
# The engine key comes from the environment (VLLM_API_KEY), never the command line (/proc/PID/cmdline).
set -euo pipefail
: "${VLLM_API_KEY:?set VLLM_API_KEY: the bearer key the gateway sends pool ascend-128k}"
exec vllm serve \
  "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 8000 \
  --served-model-name moonshotai/Kimi-K3 \
  --max-model-len 131072 \
  --tensor-parallel-size 16 \
  --enable-expert-parallel \
  --gpu-memory-utilization 0.9 \
  --trust-remote-code \
  --safetensors-load-strategy eager \
  --shutdown-timeout 45
