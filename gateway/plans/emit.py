"""Engine launch scripts from plans: one bash script per pool, for vLLM, SGLang or vllm-ascend.

Each script starts ONE engine instance (one gateway worker) of its pool with the plan's parallel
sizes, max model length (= the pool's `max_context_tokens`), precision, memory utilisation, served
model name, port and API key variable. Flag names are the engines' own:

- vLLM OpenAI server (`vllm serve`; vllm-ascend is a vLLM plugin with the same CLI):
  --tensor-parallel-size, --pipeline-parallel-size, --data-parallel-size, --enable-expert-parallel
  (vLLM derives the EP size from TP x DP), --max-model-len, --gpu-memory-utilization,
  --dtype (BF16 checkpoints only; a quantized checkpoint's method is left to the engine to detect),
  --enable-chunked-prefill, --served-model-name,
  --distributed-executor-backend ray and --data-parallel-backend ray across nodes (with
  VLLM_RAY_DP_PACK_STRATEGY=span when a data-parallel rank spans nodes: ray_pack_strategy_env).
- SGLang (`python3 -m sglang.launch_server`): --tp-size, --ep-size, --dp-size with --enable-dp-attention,
  --context-length, --dtype (as for vLLM), --mem-fraction-static, --served-model-name,
  --nnodes, --node-rank, --dist-init-addr.
- Either engine's priority scheduling when the plan's pool sets `flow_control.engine_priority`:
  vLLM `--scheduling-policy priority`, SGLang `--enable-priority-scheduling` (gateway/flow/priority.py).

The engine key never goes on the command line (`/proc/<pid>/cmdline`, `ps`): vLLM reads it from
VLLM_API_KEY (vllm/entrypoints/openai/api_server.py: `args.api_key or envs.VLLM_API_KEY`); SGLang
reads no variable, so `sglang_launcher` starts launch_server with the key set on its parsed
arguments and left out of the arguments' logged form.

The checked-in copies live in deploy/engines/ and a test regenerates them (no drift).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from gateway.flow.priority import launch_flags
from gateway.plans.models import LoadedPlan

RAY_PORT = 6379  # Ray's default GCS port on the head node


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _precision_flags(loaded: LoadedPlan) -> list[str]:
    """Flags for the checkpoint's precision. A quantized checkpoint gets none: vLLM and SGLang read its
    config.json quantization_config themselves, and a --quantization that differs from it is refused
    (vLLM ModelConfig._verify_quantization, SGLang ModelConfig._verify_quantization), while --dtype
    sets the activation and unquantized-weight dtype and never dequantizes. A plan may force
    `engine.quantization` (checked against the checkpoint when the plan loads). BF16 checkpoints get
    --dtype bfloat16."""
    quantization = loaded.plan.engine.quantization_flag()
    if quantization is not None:
        return [f"--quantization {_q(quantization)}"]
    return ["--dtype bfloat16"] if loaded.checkpoint().precision == "bf16" else []


def vllm_args(loaded: LoadedPlan) -> list[str]:
    """The `vllm serve` arguments (after the model path) that launch `loaded`'s engine."""
    plan = loaded.plan
    par, engine = plan.parallelism, plan.engine
    args = [
        '--host "${HOST:-0.0.0.0}"',
        f"--port {engine.port}",
        f"--served-model-name {_q(engine.served_model_name)}",
    ]
    args += [f"--max-model-len {plan.max_context_tokens}", f"--tensor-parallel-size {par.tensor}"]
    if par.pipeline > 1:
        args.append(f"--pipeline-parallel-size {par.pipeline}")
    if par.data > 1:
        args.append(f"--data-parallel-size {par.data}")
    if par.expert > 1:
        args.append("--enable-expert-parallel")
    args += _precision_flags(loaded)
    args.append(f"--gpu-memory-utilization {engine.memory_utilization:g}")
    if engine.chunked_prefill:
        args.append("--enable-chunked-prefill")
    if engine.trust_remote_code:
        args.append("--trust-remote-code")
    if plan.engine_priority:  # the gateway sets each request's priority from its band
        args += launch_flags(engine.kind)
    if plan.hardware.nodes > 1:
        args.append("--distributed-executor-backend ray")
        if par.data > 1:
            args.append("--data-parallel-backend ray")
    return args + [_q(a) for a in engine.extra_args]


def sglang_args(loaded: LoadedPlan) -> list[str]:
    """The `sglang.launch_server` arguments that launch `loaded`'s engine."""
    plan = loaded.plan
    par, engine = plan.parallelism, plan.engine
    args = [
        '--model-path "${MODEL_PATH:-' + engine.model_path + '}"',
        '--host "${HOST:-0.0.0.0}"',
        f"--port {engine.port}",
        f"--served-model-name {_q(engine.served_model_name)}",
    ]
    args += [f"--context-length {plan.max_context_tokens}", f"--tp-size {par.tensor}"]
    if par.data > 1:
        args += [f"--dp-size {par.data}", "--enable-dp-attention"]
    if par.expert > 1:
        args.append(f"--ep-size {par.expert}")
    args += _precision_flags(loaded)
    args.append(f"--mem-fraction-static {engine.memory_utilization:g}")
    # SGLang serves /metrics only with --enable-metrics (srt/entrypoints/http_server.py): the gateway's
    # load scrape (gateway/backends/load.py) and the engines' PodMonitor read it.
    args.append("--enable-metrics")
    if engine.trust_remote_code:
        args.append("--trust-remote-code")
    if plan.engine_priority:  # the gateway sets each request's priority from its band
        args += launch_flags(engine.kind)
    if plan.hardware.nodes > 1:
        args += [f"--nnodes {plan.hardware.nodes}", '--node-rank "$NODE_RANK"', '--dist-init-addr "$DIST_INIT_ADDR"']
    return args + [_q(a) for a in engine.extra_args]


def sglang_launcher(key_env: str) -> str:
    """`python3 -c` code that starts SGLang's launch_server with its key from `key_env`, never from argv.

    sglang/launch_server.py parses `prepare_server_args(sys.argv[1:])` when run as __main__; the
    wrapper replaces that function in sglang.srt.server_args by one that also sets `api_key` (the
    field --api-key fills) and runs the module as __main__, so the key is not in /proc/PID/cmdline.
    SGLang logs its arguments at start (`logger.info(f"{server_args=}")` in
    srt/entrypoints/engine.py `_launch_subprocesses`) and its repr hides no key, so the wrapper
    also makes ServerArgs' repr print the key as '<redacted>' in this process (the one that logs
    that line and serves HTTP)."""
    return ("import os, runpy, sglang.srt.server_args as s; p = s.prepare_server_args\n"
            "r = s.ServerArgs.__repr__\n"
            "def redacted(self):\n"
            "    text = r(self)\n"
            "    return text.replace(repr(self.api_key), \"'<redacted>'\") if self.api_key else text\n"
            "s.ServerArgs.__repr__ = redacted\n"
            "def with_key(argv):\n"
            "    args = p(argv)\n"
            f"    args.api_key = os.environ.pop({key_env!r})\n"
            "    return args\n"
            "s.prepare_server_args = with_key\n"
            "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


def ray_pack_strategy_env(loaded: LoadedPlan) -> dict[str, str]:
    """Environment the head node's `vllm serve` needs to place data-parallel ranks with Ray.

    vLLM places each DP rank in a Ray placement group (vllm/v1/engine/utils.py,
    CoreEngineActorManager.create_dp_placement_groups). VLLM_RAY_DP_PACK_STRATEGY (vllm/envs.py)
    defaults to `strict`: every rank packed on one node, so a rank of TP x PP devices larger than a
    node's is refused ("Not enough resources to allocate N DP ranks on DP master node ...").
    `span` lets one rank span several nodes (and makes --data-parallel-size-local 1:
    vllm/engine/arg_utils.py). Plan C: a rank is TP 8 x PP 3 = 24 GPUs over 6 trays of 4."""
    plan = loaded.plan
    par = plan.parallelism
    if plan.engine.kind == "sglang" or plan.hardware.nodes == 1 or par.data == 1:
        return {}
    if par.tensor * par.pipeline <= plan.hardware.devices_per_node:
        return {}
    return {"VLLM_RAY_DP_PACK_STRATEGY": "span"}


def shell_command(lines: list[str], head: str) -> str:
    """`head` followed by `lines`, one per line with a backslash continuation (a shell command)."""
    return head + " \\\n" + " \\\n".join(f"  {line}" for line in lines) + "\n"


def render_script(loaded: LoadedPlan) -> str:
    """The launch script of one plan's engine instance, as text (bash, `set -euo pipefail`)."""
    plan = loaded.plan
    engine, hw, par = plan.engine, plan.hardware, plan.parallelism
    source = f"{loaded.path.parent.name}/{loaded.path.name}"
    server = {"vllm": "vLLM OpenAI server", "ascend": "vllm-ascend (vLLM's OpenAI server)",
              "sglang": "SGLang launch_server"}[engine.kind]
    out = [
        "#!/usr/bin/env bash",
        f"# {plan.pool.name}: {plan.title}.",
        f"# One engine instance (one gateway worker) of pool {plan.pool.name}: {server} on "
        f"{hw.nodes} node(s) x {hw.devices_per_node} {hw.accelerator},",
        f"# TP {par.tensor} x PP {par.pipeline} x DP {par.data}, EP {par.expert}, {engine.precision}, "
        f"max context {plan.max_context_tokens:,} tokens; the pool runs {plan.replicas} of these.",
        f"# Generated from config/{source} by `kimi-gateway plan config/k3-production.yaml --emit deploy/engines`.",
        "# Do not edit: change the plan and emit again (tests/unit/test_plans.py fails on drift).",
        "# Environment: MODEL_PATH (weights, default the Hugging Face repo), HOST (default 0.0.0.0)"
        + (f", {engine.api_key_env} (required)" if engine.api_key_env else "")
        + ("; NODE_RANK (0 on the head node)" if hw.nodes > 1 else "")
        + ("; DIST_INIT_ADDR (node 0's host:port)" if hw.nodes > 1 and engine.kind == "sglang" else "")
        + ("; HEAD_ADDRESS (node 0's host, on the other nodes)" if hw.nodes > 1 and engine.kind != "sglang" else "")
        + ".",
        "set -euo pipefail",
    ]
    if engine.api_key_env:
        out.append(f': "${{{engine.api_key_env}:?set {engine.api_key_env}: the bearer key the gateway sends '
                   f'pool {plan.pool.name}}}"')
        if engine.kind != "sglang" and engine.api_key_env != "VLLM_API_KEY":
            out.append(f'export VLLM_API_KEY="${engine.api_key_env}"  # vLLM reads its key from here, not argv')
    if engine.kind == "sglang":
        if hw.nodes > 1:
            out.append(f': "${{NODE_RANK:?set NODE_RANK: the rank of this node, 0..{hw.nodes - 1}}}"')
            out.append(': "${DIST_INIT_ADDR:?set DIST_INIT_ADDR: host:port of node 0 for the process group}"')
        if engine.api_key_env:
            out.append("# SGLang reads its key from no variable: this launcher sets it (sglang_launcher).")
            out.append("launcher=" + shlex.quote(sglang_launcher(engine.api_key_env)))
            return "\n".join(out) + "\n" + shell_command(sglang_args(loaded), 'exec python3 -c "$launcher"')
        return "\n".join(out) + "\n" + shell_command(sglang_args(loaded), "exec python3 -m sglang.launch_server")
    serve = shell_command(vllm_args(loaded), 'exec vllm serve "${MODEL_PATH:-' + engine.model_path + '}"')
    if hw.nodes == 1:
        return "\n".join(out) + "\n" + serve
    out += [f"export {k}={v}  # ray_pack_strategy_env: a data-parallel rank spans nodes"
            for k, v in ray_pack_strategy_env(loaded).items()]
    out += [
        f': "${{NODE_RANK:?set NODE_RANK: the rank of this node, 0..{hw.nodes - 1}}}"',
        f"# Node 0 starts the Ray head and serves; nodes 1..{hw.nodes - 1} join its cluster (start them within "
        f"Ray's connect timeout): vLLM places its {hw.devices} workers on the cluster's devices.",
        'if [ "$NODE_RANK" != 0 ]; then',
        '  : "${HEAD_ADDRESS:?set HEAD_ADDRESS: the head node (rank 0) host}"',
        f'  exec ray start --address "$HEAD_ADDRESS:{RAY_PORT}" --block',
        "fi",
        f"ray start --head --port {RAY_PORT}",
    ]
    return "\n".join(out) + "\n" + serve


def emit_scripts(plans: list[LoadedPlan], out_dir: str | Path) -> list[Path]:
    """Write `{pool}.sh` (mode 755) for each plan into `out_dir` (created if missing); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for loaded in plans:
        path = out / f"{loaded.plan.pool.name}.sh"
        path.write_text(render_script(loaded), encoding="utf-8")
        path.chmod(0o755)
        paths.append(path)
    return paths
