#!/usr/bin/env bash
# sglang-512k: Plan B, production (2 x 8 B200, SGLang).
# One engine instance (one gateway worker) of pool sglang-512k: SGLang launch_server on 2 node(s) x 8 B200,
# TP 16 x PP 1 x DP 1, EP 16, mxfp4, max context 524,288 tokens; the pool runs 2 of these.
# Generated from config/plans/plan-b.yaml by `kimi-gateway plan config/k3-production.yaml --emit deploy/engines`.
# Do not edit: change the plan and emit again (tests/unit/test_plans.py fails on drift).
# Environment: MODEL_PATH (weights, default the Hugging Face repo), HOST (default 0.0.0.0), SGLANG_API_KEY (required); NODE_RANK (0 on the head node); DIST_INIT_ADDR (node 0's host:port).
set -euo pipefail
: "${SGLANG_API_KEY:?set SGLANG_API_KEY: the bearer key the gateway sends pool sglang-512k}"
: "${NODE_RANK:?set NODE_RANK: the rank of this node, 0..1}"
: "${DIST_INIT_ADDR:?set DIST_INIT_ADDR: host:port of node 0 for the process group}"
# SGLang reads its key from no variable: this launcher sets it (sglang_launcher).
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
  --nnodes 2 \
  --node-rank "$NODE_RANK" \
  --dist-init-addr "$DIST_INIT_ADDR"
