"""`kimi-gateway` command line: serve, check-config, drain, demo, sim, engine, plan, hash-key."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config_base import explain_validation_error
from gateway.observability.logs import setup_logging

if TYPE_CHECKING:
    from gateway.plans.safety import Finding

REPO_CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def _load_or_exit(path: str) -> GatewayConfig:
    try:
        return load_config(path, os.environ)
    except ConfigError as exc:
        sys.exit(f"config error: {exc}")
    except ValidationError as exc:
        sys.exit(f"config error in {path}:\n{explain_validation_error(exc)}")


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (`shutdown:` in the config;
    gateway/serving/lifecycle.py)."""
    from gateway.app import begin_draining, create_app
    from gateway.process.supervisor import Supervisor, bind_socket
    from gateway.serving.lifecycle import GracefulServer, tune_gc
    from gateway.serving.request_head import http_options

    config = _load_or_exit(args.config)
    setup_logging(config.log_level)
    _serve_safety(args.config, config, args.strict)
    processes = args.processes or config.processes
    host, port = args.host or config.host, args.port or config.port
    # The port is bound before anything starts, so one already in use ends the command at once
    # with status 1 (uvicorn binds after the app's start-up and then waits on its shutdown).
    if processes > 1:
        shutdown = config.shutdown
        try:
            supervisor = Supervisor(args.config, host, port, processes, shutdown.drain_delay + shutdown.grace_period,
                                    hang_timeout=config.hung_process_timeout)
        except OSError as exc:
            sys.exit(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
        sys.exit(supervisor.run())
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        sys.exit(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    app = create_app(config, config_path=args.config)
    server = GracefulServer(app, host, port, config.shutdown, on_drain=lambda: begin_draining(app),
                            log_level=config.log_level, **http_options(config))
    tune_gc()
    logging.getLogger("gateway.cli").info("kimi-gateway serving on http://%s:%d", *sock.getsockname()[:2])
    server.run(sockets=[sock])


def cmd_check_config(args: argparse.Namespace) -> None:
    config = _load_or_exit(args.config)
    try:
        from gateway.routing.pool_policies import PoolPolicies

        PoolPolicies(config)
    except ValueError as exc:
        sys.exit(f"config error in {args.config}: {exc}")
    models = config.served_models()
    if len(models) == 1:
        print(f"{args.config}: OK — model {models[0].name} (aliases: {', '.join(models[0].aliases) or 'none'})")
    else:
        print(f"{args.config}: OK — {len(models)} models")
        for model in models:
            print(f"  model {model.name} (aliases: {', '.join(model.aliases) or 'none'}): "
                  f"pools {', '.join(model.pools or [p.name for p in config.pools])}")
    for pool in config.pools:
        found = f" + from DNS {pool.discover.name} ({pool.discover.record.upper()})" if pool.discover else ""
        workers, policy = f"{len(pool.workers)} worker(s){found}", pool.policy
        if (pd := pool.disaggregation) is not None:
            workers = f"PD {pd.mode}: {len(pd.prefill)} prefill + {len(pd.decode)} decode worker(s)"
            policy = f"{pd.prefill_policy} (prefill) / {pd.decode_policy} (decode)"
        extras = f", apis {'+'.join(pool.apis)}" if pool.apis is not None else ""
        if pool.lora_adapters or pool.lora_on_demand:
            adapters = [*pool.lora_adapters, *(f"{m.name} (on demand)" for m in pool.lora_on_demand)]
            extras += f", LoRA adapters {', '.join(adapters)}"
        print(f"  pool {pool.name}: {pool.engine}, {workers}, "
              f"max context {pool.max_context_tokens:,} tokens, policy {policy}, "
              f"modalities {'+'.join(pool.modalities)}, spillover {'on' if pool.spillover else 'off'}{extras}")
    _check_production_safety(args.config, config, args.strict)


def _check_production_safety(path: str, config: GatewayConfig, strict: bool) -> None:
    """Warn about what is valid but unsafe to deploy (gateway/plans/safety.py); `strict` exits 1 on any."""
    findings = _safety_findings(path, config)
    for finding in findings:
        print(f"warning: {finding}")
    if findings and strict:
        sys.exit(f"check-config --strict: {len(findings)} warning(s) in {path}")


def _serve_safety(path: str, config: GatewayConfig, strict: bool) -> None:
    """`serve`'s start-up run of check-config's production checks: each finding logged as a warning;
    with `strict`, one `warning: ...` line each on stderr and exit 1 before anything listens."""
    findings = _safety_findings(path, config)
    if findings and strict:
        for finding in findings:
            print(f"warning: {finding}", file=sys.stderr)
        sys.exit(f"serve --strict: {len(findings)} warning(s) in {path}; not starting")
    log = logging.getLogger("gateway.cli")
    for finding in findings:
        log.warning("config warning: %s", finding)


def _safety_findings(path: str, config: GatewayConfig) -> list[Finding]:
    """The production-safety findings of the config at `path` (loaded as `config`) in this environment."""
    from gateway.plans.safety import production_findings, read_tree

    return production_findings(read_tree(path), config, os.environ) + _redis_cluster_findings(config)


def _redis_cluster_findings(config: GatewayConfig) -> list[Finding]:
    """A finding when a plain `redis://` URL names a Redis Cluster node (asked with `INFO cluster`, 1 s at
    most; an unreachable Redis says nothing): the gateway's connections would refuse that node. The
    probe runs in a daemon thread given 1.5 s: a name lookup that hangs holds no exit."""
    import asyncio
    import threading

    from gateway.plans.safety import Finding
    from gateway.redis_cluster import probe_cluster_node

    url = config.redis_url
    if not url:
        return []
    answer: list[bool | None] = []
    probe = threading.Thread(target=lambda: answer.append(asyncio.run(probe_cluster_node(url))), daemon=True)
    probe.start()
    probe.join(1.5)
    if not answer or not answer[0]:
        return []
    return [Finding("redis_url", "this Redis is a Redis Cluster node (INFO cluster: cluster_enabled:1): a plain "
                                 "redis:// URL reaches only its own slots' keys, so the gateway refuses it; "
                                 "give the nodes as redis+cluster://host:port[,host:port...]")]


def cmd_drain(args: argparse.Namespace) -> None:
    """Drain one worker on every gateway replica and wait for its in-flight requests (gateway/drain_command.py)."""
    from gateway.drain_command import run_drain

    sys.exit(run_drain(args.gateway, args.pool, args.worker, wait_s=args.wait, interval_s=args.interval,
                       admin_key_env=args.admin_key_env, resolve_every_address=args.every_address,
                       undrain=args.undrain))


def cmd_demo(args: argparse.Namespace) -> None:
    from gateway.process.demo import run_demo

    config = _load_or_exit(args.config)
    setup_logging("info" if args.verbose else "warning")
    run_demo(config, host=args.host, port=args.port)


def cmd_sim(args: argparse.Namespace) -> None:
    from gateway.sim.server import run_sim

    setup_logging("warning")
    pooling = args.runner == "pooling"
    print(f"sim {args.engine} on http://{args.host}:{args.port} (max context {args.max_context} tokens, "
          f"ttft {args.ttft}s, tpot {args.tpot}s{', pooling APIs' if pooling else ''}; faults: POST /sim/faults)",
          file=sys.stderr, flush=True)
    run_sim(args.engine, args.port, host=args.host, max_context_tokens=args.max_context,
            ttft_s=args.ttft, tpot_s=args.tpot, served_model_names=args.served_model_name or ["kimi-k3"],
            max_num_seqs=args.max_num_seqs, kv_capacity_tokens=args.kv_capacity,
            prefill_tokens_per_s=args.prefill_rate, api_key=args.api_key, api_key_scope=args.api_key_scope,
            keep_alive_s=args.keep_alive, log_level="warning", pd_role=args.pd_role,
            pd_protocol=args.pd_protocol, bootstrap_port=args.bootstrap_port,
            pd_wait_timeout_s=args.pd_wait_timeout, kv_transfer_tokens_per_s=args.kv_transfer_rate,
            kv_load_failure_policy=args.kv_load_failure_policy, scheduler=args.scheduler,
            chunk_tokens=args.chunk_tokens,
            decode_step_s=None if args.decode_step_ms is None else args.decode_step_ms / 1000.0,
            decode_s_per_seq=None if args.decode_ms_per_seq is None else args.decode_ms_per_seq / 1000.0,
            lora_modules=args.lora_modules or [], pooling=pooling)


def cmd_engine(args: argparse.Namespace) -> None:
    from gateway.llamacpp_worker.llamacpp import run_engine

    run_engine(port=args.port, n_ctx=args.ctx, host=args.host, threads=args.threads)


def cmd_hash_key(args: argparse.Namespace) -> None:
    """Print the SHA-256 to put in `auth.keys[].sha256`; `-` reads the key from stdin (keeps it out of `ps`)."""
    from gateway.auth.keys import MIN_KEY_CHARS, hash_key

    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    if not key:
        sys.exit("hash-key: the key is empty")
    if len(key) < MIN_KEY_CHARS:
        print(f"warning: keys shorter than {MIN_KEY_CHARS} characters can be guessed from their hash; "
              "use a random key", file=sys.stderr)
    print(hash_key(key))


def cmd_plan(args: argparse.Namespace) -> None:
    """Capacity report of a plan (or of every plan a config's pools name); `--emit DIR` writes launch scripts."""
    from gateway.plans.command import run_plan

    sys.exit(run_plan(args.file, as_json=args.json, precision=args.precision, emit=args.emit))


def cmd_config_reference(args: argparse.Namespace) -> None:
    """Print the configuration reference (docs/config-reference.md) generated from the config models."""
    from gateway.config_reference import render

    sys.stdout.write(render())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway with a config file")
    serve.add_argument("--config", "-c", required=True)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--processes", type=int, help="serving processes sharing the port (overrides `processes`)")
    serve.add_argument("--strict", action="store_true",
                       help="refuse to start on any production-safety warning (those of check-config --strict)")
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="validate a config file and explain errors")
    check.add_argument("config")
    check.add_argument("--strict", action="store_true", help="fail on production-safety warnings too")
    check.set_defaults(func=cmd_check_config)

    reference = sub.add_parser("config-reference", help="print every config key with its type, default and meaning "
                                                         "(Markdown: docs/config-reference.md)")
    reference.set_defaults(func=cmd_config_reference)

    from gateway.drain_command import DEFAULT_ADMIN_KEY_ENV

    drain = sub.add_parser("drain", help="drain a worker on every gateway replica and wait for its requests "
                                         "(an engine pod's preStop hook)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    drain.add_argument("--gateway", action="append", required=True,
                       help="a gateway's base URL; repeat it for each replica (each counts its own in-flight "
                            "requests), or give one name with --every-address")
    drain.add_argument("--pool", required=True, help="the worker's pool")
    drain.add_argument("--worker", required=True, help="the worker's URL (as the gateway has it) or its index")
    drain.add_argument("--wait", type=float, default=300.0, help="seconds to wait for in-flight requests to end")
    drain.add_argument("--interval", type=float, default=0.5, help="seconds between polls of /admin/workers")
    drain.add_argument("--admin-key-env", default=DEFAULT_ADMIN_KEY_ENV,
                       help="environment variable holding a key with the drain (or admin) scope (none: no key sent)")
    drain.add_argument("--every-address", action="store_true",
                       help="drain, poll (and undrain) every address each --gateway host resolves to (a headless "
                            "Service: every replica)")
    drain.add_argument("--undrain", action="store_true",
                       help="put the worker back into service instead (when its engine starts again) and exit")
    drain.set_defaults(func=cmd_drain)

    demo = sub.add_parser("demo", help="simulated pools + the gateway in one process")
    demo.add_argument("--config", default=str(REPO_CONFIG_DIR / "demo.yaml"))
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--verbose", "-v", action="store_true", help="print one JSON log line per request")
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser("sim", help="run one simulated engine (vLLM, SGLang or Ascend API)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--engine", choices=["vllm", "sglang", "ascend"], required=True)
    sim.add_argument("--port", type=int, required=True)
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--max-context", type=int, default=131072, help="tokens")
    sim.add_argument("--ttft", type=float, default=0.05, help="seconds of simulated prefill")
    sim.add_argument("--tpot", type=float, default=0.01, help="seconds per output token")
    sim.add_argument("--served-model-name", nargs="+", action="extend", metavar="NAME",
                     help="the model's names, first one primary, as vLLM takes them (`--served-model-name a b`, "
                          "vllm/engine/arg_utils.py); repeatable; none given: kimi-k3")
    sim.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                     help="LoRA adapters to serve (listed in /v1/models with their parent), as vLLM takes them")
    sim.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                     help="pooling: also serve /v1/embeddings, /v1/rerank and /v1/score, as vLLM's `--runner "
                          "pooling` (vllm/config/model.py) does for an embedding or cross-encoder model")
    sim.add_argument("--is-embedding", dest="runner", action="store_const", const="pooling",
                     help="SGLang's name for --runner pooling (python/sglang/srt/server_args.py)")
    sim.add_argument("--max-num-seqs", type=int, help="requests running at once; the rest wait")
    sim.add_argument("--kv-capacity", type=int, help="prefix/KV cache size in tokens (enables the cache model)")
    sim.add_argument("--prefill-rate", "--prefill-tokens-per-s", type=float,
                     help="uncached prompt tokens prefilled per second (per request; with --scheduler "
                          "stepped, the worker's whole budget, default 20000)")
    sim.add_argument("--kv-capacity-tokens", dest="kv_capacity", type=int, help=argparse.SUPPRESS)
    sim.add_argument("--scheduler", choices=["per_request", "stepped"], default="per_request",
                     help="per_request: each request sleeps its own prefill/decode time; stepped: one "
                          "scheduler loop shares the prefill budget, batches decode, preempts on a full KV")
    sim.add_argument("--chunk-tokens", type=int,
                     help="stepped: tokens per step (vLLM max_num_batched_tokens, SGLang chunked_prefill_size; "
                          "default 8192)")
    sim.add_argument("--decode-step-ms", type=float, help="stepped: fixed time of each step, ms (default 20)")
    sim.add_argument("--decode-ms-per-seq", type=float,
                     help="stepped: extra step time per decoding sequence, ms (default 0.1)")
    sim.add_argument("--api-key", help="require `Authorization: Bearer KEY` (as the engine's --api-key does)")
    sim.add_argument("--api-key-scope", choices=["engine", "all"], default="engine",
                     help="paths the key guards: the engine's own choice (vLLM: /v1/*; SGLang: all but "
                          "/health and /metrics) or every path (an authenticating proxy in front)")
    sim.add_argument("--keep-alive", type=float, default=5.0,
                     help="seconds an idle connection stays open (uvicorn's timeout_keep_alive)")
    sim.add_argument("--pd-role", choices=["prefill", "decode"],
                     help="prefill/decode disaggregation role (needs --pd-protocol)")
    sim.add_argument("--pd-protocol", choices=["sglang", "vllm-nixl", "vllm-mooncake"],
                     help="KV hand-over protocol: SGLang bootstrap rooms (--engine sglang) or vLLM's "
                          "kv_transfer_params with the NIXL or Mooncake connector (--engine vllm/ascend)")
    sim.add_argument("--bootstrap-port", type=int,
                     help="SGLang / vLLM Mooncake prefill: also listen here for bootstrap calls")
    sim.add_argument("--pd-wait-timeout", type=float, default=300.0,
                     help="SGLang: seconds a decode worker waits for its room's KV (and a prefill "
                          "worker for its decode partner)")
    sim.add_argument("--kv-transfer-rate", type=float,
                     help="decode: KV tokens received per second (default: instant)")
    sim.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail",
                     help="vLLM decode: what a failed KV read does (vLLM's kv_load_failure_policy)")
    sim.set_defaults(func=cmd_sim)

    engine = sub.add_parser("engine", help="run a real llama.cpp CPU worker (SmolLM2-135M)")
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--ctx", type=int, default=2048, help="context size, tokens")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--threads", type=int)
    engine.set_defaults(func=cmd_engine)

    plan = sub.add_parser("plan", help="capacity report of a K3 plan (config/plans/) and its engine launch scripts")
    plan.add_argument("file", help="a plan file, or a config whose pools name plans")
    plan.add_argument("--json", action="store_true", help="the report as JSON")
    plan.add_argument("--precision", choices=["bf16", "mxfp8", "mxfp4"], help="what if the weights were this")
    plan.add_argument("--emit", metavar="DIR", help="write one launch script per pool into DIR")
    plan.set_defaults(func=cmd_plan)

    hash_key = sub.add_parser("hash-key", help="print an API key's SHA-256 for auth.keys[].sha256")
    hash_key.add_argument("key", help="the key, or - to read it from stdin")
    hash_key.set_defaults(func=cmd_hash_key)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
