#!/usr/bin/env bash
# nvl72-1m: Plan C, full power (GB200 NVL72 rack, vLLM), on Kubernetes (deploy/kubernetes/generate.py; the flags are deploy/engines/nvl72-1m.sh's).
# The engine key comes from the environment (VLLM_API_KEY), never the command line (/proc/PID/cmdline).
set -euo pipefail
: "${VLLM_API_KEY:?set VLLM_API_KEY: the bearer key the gateway sends pool nvl72-1m}"
# One LeaderWorkerSet group = one instance of 18 nodes; the controller sets the rank variables.
: "${LWS_LEADER_ADDRESS:?}" "${LWS_WORKER_INDEX:?}" "${LWS_GROUP_SIZE:?}"
rank=$LWS_WORKER_INDEX
# The leader's address as an IP (its DNS record appears once its pod has one): the process
# group's and the engines' sockets bind and connect on it.
for _ in $(seq 60); do
  leader=$(getent hosts "$LWS_LEADER_ADDRESS" | awk '{print $1; exit}') && [ -n "$leader" ] && break
  sleep 5
done
: "${leader:?cannot resolve $LWS_LEADER_ADDRESS}"
args=(
  "${MODEL_PATH:-moonshotai/Kimi-K3}"
  --host "${HOST:-0.0.0.0}"
  --port 8000
  --served-model-name moonshotai/Kimi-K3
  --max-model-len 1048576
  --tensor-parallel-size 8
  --pipeline-parallel-size 3
  --data-parallel-size 3
  --enable-expert-parallel
  --gpu-memory-utilization 0.9
  --enable-chunked-prefill
  --trust-remote-code
  --safetensors-load-strategy eager
  --shutdown-timeout 45
  --nnodes "$LWS_GROUP_SIZE"
  --node-rank "$rank"
  --master-addr "$leader"
  --master-port 29501
  --data-parallel-size-local 1
  --data-parallel-address "$leader"
  --data-parallel-rpc-port 13345
)
# Nodes 0, 6, ... start data-parallel ranks 0..2 (6 nodes each).
if [ "$rank" != 0 ] && [ $((rank % 6)) = 0 ]; then args+=(--data-parallel-start-rank $((rank / 6))); fi
if [ "$rank" != 0 ]; then
  exec vllm serve "${args[@]}" --headless
fi
exec vllm serve "${args[@]}"
