#!/usr/bin/env bash
# sglang-512k: Plan B, production (2 x 8 B200, SGLang), on Kubernetes (deploy/kubernetes/generate.py; the flags are deploy/engines/sglang-512k.sh's).
# The engine key comes from the environment (SGLANG_API_KEY), never the command line (/proc/PID/cmdline).
set -euo pipefail
: "${SGLANG_API_KEY:?set SGLANG_API_KEY: the bearer key the gateway sends pool sglang-512k}"
# One LeaderWorkerSet group = one instance of 2 nodes; the controller sets the rank variables.
: "${LWS_LEADER_ADDRESS:?}" "${LWS_WORKER_INDEX:?}" "${LWS_GROUP_SIZE:?}"
rank=$LWS_WORKER_INDEX
# The leader's address as an IP (its DNS record appears once its pod has one): the process
# group's and the engines' sockets bind and connect on it.
for _ in $(seq 60); do
  leader=$(getent hosts "$LWS_LEADER_ADDRESS" | awk '{print $1; exit}') && [ -n "$leader" ] && break
  sleep 5
done
: "${leader:?cannot resolve $LWS_LEADER_ADDRESS}"
launcher='import os, runpy, sglang.srt.server_args as s; p = s.prepare_server_args
r = s.ServerArgs.__repr__
def redacted(self):
    text = r(self)
    return text.replace(repr(self.api_key), "'"'"'<redacted>'"'"'") if self.api_key else text
s.ServerArgs.__repr__ = redacted
def with_key(argv):
    args = p(argv)
    args.api_key = os.environ.pop('"'"'SGLANG_API_KEY'"'"')
    return args
s.prepare_server_args = with_key
runpy.run_module('"'"'sglang.launch_server'"'"', run_name='"'"'__main__'"'"', alter_sys=True)'
exec python3 -c "$launcher" \
  --model-path "${MODEL_PATH:-moonshotai/Kimi-K3}" \
  --host "${HOST:-0.0.0.0}" \
  --port 30000 \
  --served-model-name moonshotai/Kimi-K3 \
  --context-length 524288 \
  --tp-size 16 \
  --ep-size 16 \
  --mem-fraction-static 0.88 \
  --enable-metrics \
  --trust-remote-code \
  --nnodes "$LWS_GROUP_SIZE" \
  --node-rank "$rank" \
  --dist-init-addr "$leader:5000"
