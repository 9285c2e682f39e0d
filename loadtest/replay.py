"""Replay the Kimi (Mooncake) conversation trace through the gateway and compare routing policies.

    python -m loadtest.replay                       # defaults: 40 min of trace at 20x, 8 workers, ~9 min
    python -m loadtest.replay --quick --policies round_robin,least_load   # ~300 requests, ~1 min

For each policy (and each peer router) a fresh set of processes is started: one process hosting
N simulated SGLang workers with a prefix (KV) cache model (`loadtest.workers`), then the gateway
(`python -m gateway.cli serve -c <generated yaml>`, one pool of those workers, the policy under
test) or SGLang's own router (`sglang_router.launch_router --policy cache_aware`). This process is
the load generator: it replays the trace at its (compressed) arrival times, streaming, and reads
the workers' totals afterwards. Results: a markdown table on stdout and
`loadtest/results/replay-<timestamp>.{md,json}` (with the command line and every setting).

Default sizing (2 cores, all three policies plus the peer in about 9 minutes): the first 40
minutes of the trace (7,851 requests, 97.6M prompt tokens) compressed 20x into 2 minutes per run;
outputs scaled by 0.05 (mean ~17 tokens) at 5 ms a decode step; per worker 1M tokens of KV cache
(a realistic size for an 8-GPU Kimi node) and a prefill speed chosen ("auto") so that without any
cache hit the workers would be 80% busy on average. The workers run the simulator's step scheduler
(`--scheduler stepped`, `gateway.sim.stepper`): one prefill budget per worker shared by its
requests in chunks of 8,192 tokens, up to 256 requests at once. `--scheduler per_request` gives
the earlier model (each request prefills at the auto speed on its own, 4 requests at once). Trace
bursts (up to 28 requests in 3 s) then make queues, and every cached token shortens them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.sim.config import SimConfig
from loadtest import oracle
from loadtest.loadgen import LoadOptions, chat_body, replay
from loadtest.procs import (
    CpuMeter,
    ManagedProcess,
    ProcessError,
    ProcessGroup,
    child_env,
    free_port,
    python_argv,
)
from loadtest.report import RunResult, markdown, summarize_run, write_results
from loadtest.texts import DEFAULT_CACHE_BLOCKS, BlockTexts, prompt_bytes_for
from loadtest.trace import ScheduledRequest, TraceSummary, read_trace, schedule, summarize
from loadtest.workerstats import StatsReader

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "kimi-k3"
MAX_CONTEXT_TOKENS = 262_144
"""Context of the benchmark pool and its workers: above the trace's longest prompt (124,847
tokens) even after the gateway's deliberately high estimate (~0.26 tokens a byte of its English-like words)."""

SIM_MESSAGE_OVERHEAD_TOKENS: int = SimConfig.model_fields["message_overhead_tokens"].default
"""Tokens the simulator adds per chat message (the `SimConfig` default, 4)."""

DEFAULT_POLICIES = "round_robin,least_load,prefix_affinity"
TUNING_MINUTES = 40.0
"""Trace rows with timestamp < 2,400,000 ms are for tuning; later ones are held out."""
STARTUP_TIMEOUT_S = 60.0
QUICK = {"limit": 300, "speedup": 8.0, "max_seconds": 60.0, "drain_seconds": 30.0}
"""`--quick`: the first 300 requests (102 s of trace) at 8x: ~13 s of replay per run."""


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (units in the names or the `--help` text)."""

    trace: Path
    minutes: float
    limit: int | None
    speedup: float
    output_scale: float
    workers: int
    policies: list[str]
    policy_params: dict[str, dict[str, Any]]
    gateway_extra: dict[str, Any]
    peers: list[str]
    kv_capacity_tokens: int
    kv_block_tokens: int
    max_num_seqs: int
    scheduler: str
    chunk_tokens: int
    decode_s_per_seq: float
    ttft_s: float
    tpot_s: float
    decode_batch_slowdown: float
    prefill_tps: str
    target_util: float
    max_concurrency: int
    max_seconds: float
    drain_seconds: float
    text_cache_blocks: int
    seed: int
    results_dir: Path


# --- configuration of the processes ------------------------------------------------------------------


def auto_prefill_tps(summary: TraceSummary, s: Settings) -> float:
    """Prefill speed (tokens/s) at which the workers would be `target_util` busy with no cache hit.

    Per worker: arrival rate lam = requests / span / N. Per request (`per_request`): a request holds
    one of `max_num_seqs` slots for ttft + prompt / speed + output x tpot; busy fraction = lam x that
    / slots. Stepped: the worker's one prefill budget is busy lam x (prompt / speed + prompt /
    chunk x step time) of the time (decode steps fill the gaps between prefills).
    """
    lam = summary.requests / summary.span_s / s.workers
    mean_prompt = summary.prompt_tokens / summary.requests
    mean_output = summary.output_tokens / summary.requests
    if s.scheduler == "stepped":
        room = s.target_util - lam * mean_prompt / s.chunk_tokens * s.tpot_s
        if room <= 0:
            raise SystemExit("--prefill-tps auto: step overheads alone exceed the target utilisation")
        return lam * mean_prompt / room
    budget = s.target_util * s.max_num_seqs / lam - s.ttft_s - mean_output * s.tpot_s
    if budget <= 0:
        raise SystemExit("--prefill-tps auto: decode alone exceeds the target utilisation; "
                         "lower --tpot or --output-scale, or raise --max-num-seqs")
    return mean_prompt / budget


def sim_fields(s: Settings, prefill_tps: float | None) -> dict[str, Any]:
    """SimConfig fields of every worker (fields unknown to the SimConfig in use are dropped by the
    worker host, which reports them)."""
    fields: dict[str, Any] = {
        "engine": "sglang",
        "served_model_names": [MODEL],
        "max_context_tokens": MAX_CONTEXT_TOKENS,
        "ttft_s": s.ttft_s,
        "tpot_s": s.tpot_s,
        "max_num_seqs": s.max_num_seqs,
        "kv_capacity_tokens": s.kv_capacity_tokens,
        "kv_block_tokens": s.kv_block_tokens,
        "decode_batch_slowdown": s.decode_batch_slowdown,
        "keep_records": False,
    }
    if prefill_tps is not None:
        fields["prefill_tokens_per_s"] = prefill_tps
    if s.scheduler == "stepped":
        fields.update(scheduler="stepped", chunk_tokens=s.chunk_tokens, decode_step_s=s.tpot_s,
                      decode_s_per_seq=s.decode_s_per_seq)
    return fields


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in (nested dicts merged key by key, other values replaced)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gateway_config(port: int, worker_urls: list[str], policy: str, params: dict[str, Any] | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway config of a run: one SGLang pool of the workers with `policy` (and its params),
    with `extra` (top-level gateway settings such as `{"load": {"interval": 0.25}}`) merged in."""
    pool: dict[str, Any] = {
        "name": "replay",
        "engine": "sglang",
        "workers": worker_urls,
        "max_context_tokens": MAX_CONTEXT_TOKENS,
        "default_output_tokens": 1024,
        "spillover": False,
        "policy": policy,
    }
    if params:
        pool["policy_params"] = params
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning",
              "model": {"name": MODEL, "aliases": []}, "pools": [pool], "health": {"interval": 2.0}}
    return deep_merge(config, extra or {})


MIN_SCRAPE_INTERVAL_S = 0.05
"""Scaled load-scrape interval floor, seconds (8 workers x 20 scrapes/s is already real work)."""


def scaled_gateway_timers(speedup: float) -> dict[str, Any]:
    """Gateway settings whose time constants are divided by `speedup`, so that the replay keeps
    their meaning in trace time: the engine-load scrape interval (a stale load view at 20x is a
    20x staler one) and the affinity TTL. Only settings this gateway's config has are returned."""
    from gateway.config import GatewayConfig  # the gateway under test, as installed in this venv

    fields = GatewayConfig.model_fields
    out: dict[str, Any] = {}
    if "load" in fields and fields["load"].default_factory is not None:
        interval = fields["load"].default_factory().interval
        out["load"] = {"interval": max(MIN_SCRAPE_INTERVAL_S, interval / speedup)}
    if "affinity" in fields and fields["affinity"].default_factory is not None:
        ttl = fields["affinity"].default_factory().ttl_seconds
        out["affinity"] = {"ttl_seconds": max(1, round(ttl / speedup))}
    return out


def gateway_env() -> dict[str, str]:
    """The gateway's environment: ours without `KIMI_GATEWAY_*` overrides (the file decides)."""
    return {k: v for k, v in child_env().items() if not k.startswith("KIMI_GATEWAY_")}


def check_policy(policy: str, s: Settings, workdir: Path) -> str | None:
    """None when the gateway's `check-config` accepts a config with `policy`, else its message."""
    path = workdir / f"check-{policy}.yaml"
    urls = [f"http://127.0.0.1:{1 + i}" for i in range(s.workers)]
    config = gateway_config(8000, urls, policy, s.policy_params.get(policy), s.gateway_extra)
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    try:
        done = subprocess.run(python_argv("gateway.cli", "check-config", str(path)), capture_output=True,
                              text=True, timeout=60, env=gateway_env(), cwd=REPO, check=False)
    except subprocess.TimeoutExpired:
        return "check-config timed out"
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip().splitlines()[-1] if (done.stderr or done.stdout) else "rejected"


def peer_available() -> str | None:
    """None when `sglang_router` (PyPI sglang-router) is importable, else why not."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return "sglang-router is not installed (.venv/bin/pip install sglang-router)"
    return None


# --- processes ------------------------------------------------------------------------------------------


def start_workers(group: ProcessGroup, s: Settings, prefill_tps: float | None) -> tuple[list[str], list[str]]:
    """Start the worker host; returns the worker URLs and the SimConfig fields it had to drop."""
    spec_path = group.log_dir / "workers-spec.json"
    ports_path = group.log_dir / "workers-ports.json"
    spec_path.write_text(json.dumps({"count": s.workers, "sim": sim_fields(s, prefill_tps)}), encoding="utf-8")
    ports_path.unlink(missing_ok=True)
    proc = group.spawn("workers", python_argv("loadtest.workers", "--spec", str(spec_path),
                                              "--ports-file", str(ports_path)), env=child_env())
    proc.wait_until(ports_path.exists, STARTUP_TIMEOUT_S, "listening")
    info = json.loads(ports_path.read_text(encoding="utf-8"))
    urls = [f"http://127.0.0.1:{port}" for port in info["ports"]]
    for url in urls:
        proc.wait_http(url + "/health", STARTUP_TIMEOUT_S)
    return urls, list(info.get("dropped", []))


def start_gateway(group: ProcessGroup, urls: list[str], policy: str, s: Settings) -> str:
    """Start `kimi-gateway serve` for one policy; returns its base URL once `/ready` answers 200."""
    port = free_port()
    path = group.log_dir / "gateway.yaml"
    config = gateway_config(port, urls, policy, s.policy_params.get(policy), s.gateway_extra)
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = group.spawn("gateway", python_argv("gateway.cli", "serve", "-c", str(path)), env=gateway_env())
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/ready", STARTUP_TIMEOUT_S)
    return base


def _router_lists_workers(count: int) -> Callable[[httpx.Response], bool]:
    """A readiness test: the router's `GET /workers` lists at least `count` workers."""

    def accept(response: httpx.Response) -> bool:
        try:
            body = response.json()
        except ValueError:
            return True  # an older router without a JSON list: /readiness already said yes
        listed = body.get("workers") if isinstance(body, dict) else body
        return not isinstance(listed, list) or len(listed) >= count
    return accept


def start_peer(group: ProcessGroup, urls: list[str], policy: str) -> str:
    """Start SGLang's router (`cache_aware` etc.) over the workers; returns its base URL once it
    lists every worker. Offline: no model or tokenizer path is given, `HF_HUB_OFFLINE=1`."""
    port, metrics_port = free_port(), free_port()
    argv = python_argv("sglang_router.launch_router", "--worker-urls", *urls, "--policy", policy,
                       "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port))
    proc: ManagedProcess = group.spawn("router", argv, env=child_env())
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/readiness", STARTUP_TIMEOUT_S)
    proc.wait_http(base + "/workers", STARTUP_TIMEOUT_S, accept=_router_lists_workers(len(urls)))
    return base


# --- one run --------------------------------------------------------------------------------------------


async def replay_and_measure(base: str, urls: list[str], items: list[ScheduledRequest], texts: BlockTexts,
                             s: Settings, name: str, kind: str) -> RunResult:
    """Reset the workers' counters, replay, read the counters, summarise."""

    def build(item: ScheduledRequest) -> bytes:
        req = item.request
        text = texts.prompt(req.hash_ids, prompt_bytes_for(req.input_length, SIM_MESSAGE_OVERHEAD_TOKENS))
        return chat_body(MODEL, text, item.max_tokens)

    stats = StatsReader(urls)
    await stats.start()
    options = LoadOptions(max_concurrency=s.max_concurrency, max_seconds=s.max_seconds,
                          drain_seconds=s.drain_seconds)
    results, wall = await replay(base, items, build, options)
    totals = await stats.finish()
    return summarize_run(name, kind, results, totals, wall)


def run_one(name: str, kind: str, s: Settings, items: list[ScheduledRequest], texts: BlockTexts,
            prefill_tps: float | None, log_dir: Path, notes: list[str]) -> RunResult:
    """Fresh workers + gateway (or peer router), one replay, everything stopped afterwards."""
    started = time.monotonic()
    print(f"[{name}] starting {s.workers} workers and the {'gateway' if kind == 'gateway' else kind}...", flush=True)
    try:
        with ProcessGroup(log_dir / name) as group:
            urls, dropped = start_workers(group, s, prefill_tps)
            if dropped:
                note = (f"SimConfig lacks {', '.join(dropped)}: those worker settings were not applied "
                        "(TODO: they land with the simulator's KV-cache model)")
                if note not in notes:
                    notes.append(note)
                print(f"[{name}] warning: {note}", flush=True)
            if kind == "gateway":
                base = start_gateway(group, urls, name, s)
            else:
                base = start_peer(group, urls, name.removeprefix("sglang-router:"))
            print(f"[{name}] replaying {len(items)} requests...", flush=True)
            pids = {"loadgen": os.getpid(), **{c.name: c.pid for c in group.children if c.pid is not None}}
            with CpuMeter(pids) as meter:
                run = asyncio.run(replay_and_measure(base, urls, items, texts, s, name, kind))
                run.cpu_seconds, run.machine_busy = meter.read()
    except ProcessError as exc:
        print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
        run = RunResult(name, kind, status=f"failed: {str(exc).splitlines()[0][:120]}")
    run.total_s = time.monotonic() - started
    busy = "" if run.machine_busy is None else f", machine CPU {run.machine_busy:.0%} busy"
    print(f"[{name}] done in {run.total_s:.0f} s: {run.ok}/{run.sent} ok, hit ratio "
          f"{'n/a' if run.hit_ratio is None else f'{run.hit_ratio:.3f}'}{busy}", flush=True)
    return run


# --- command line ---------------------------------------------------------------------------------------


def _param_pairs(values: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for value in values:
        name, sep, raw = value.partition("=")
        if not sep:
            raise SystemExit(f"--policy-params wants POLICY=JSON, got {value!r}")
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--policy-params {name}: bad JSON: {exc}") from exc
        if not isinstance(params, dict):
            raise SystemExit(f"--policy-params {name}: want a JSON object")
        out[name] = params
    return out


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"bad JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("want a JSON object")
    return parsed


def _names(value: str) -> list[str]:
    return [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    add("--minutes", type=float, default=TUNING_MINUTES,
        help="use rows with timestamp < minutes x 60,000 ms (40 = the tuning window)")
    add("--limit", type=int, help="at most this many requests (the first ones)")
    add("--speedup", type=float, default=20.0, help="time compression of the arrivals (x)")
    add("--output-scale", type=float, default=0.05, help="max_tokens = round(output_length x this), at least 1")
    add("--workers", type=int, default=8, help="simulated SGLang workers")
    add("--policies", default=DEFAULT_POLICIES, help="gateway policies, comma-separated")
    add("--policy-params", action="append", default=[], metavar="POLICY=JSON",
        help="the pool's policy_params for one policy, e.g. prefix_affinity='{\"balance_abs\": 4}'")
    add("--gateway-extra", type=_json_object, default={}, metavar="JSON",
        help="merged into the generated gateway config, e.g. '{\"load\": {\"interval\": 0.25}}'")
    add("--no-gateway-time-scale", action="store_true",
        help="keep the gateway's load-scrape interval and affinity TTL as configured instead of / speedup")
    add("--peers", default="cache_aware", help="SGLang router policies to run as peers ('none' to skip)")
    add("--kv-capacity", type=int, default=1_000_000, help="KV cache per worker, tokens")
    add("--kv-block", type=int, default=16, help="KV cache block, tokens")
    add("--scheduler", choices=["stepped", "per_request"], default="stepped",
        help="worker model: one shared prefill budget per worker (stepped) or a prefill per request")
    add("--max-num-seqs", type=int, help="requests a worker runs at once, the rest queue (default: 256 "
        "stepped, 4 per_request)")
    add("--chunk-tokens", type=int, default=8192, help="stepped: tokens per step (max_num_batched_tokens)")
    add("--decode-ms-per-seq", type=float, default=0.025,
        help="stepped: step time per decoding sequence, ms (the sim's 0.1 ms per 20 ms step, scaled to --tpot)")
    add("--ttft", type=float, default=0.01, help="fixed part of every prefill, seconds")
    add("--tpot", type=float, default=0.005, help="seconds per output token (stepped: per decode step)")
    add("--decode-slowdown", type=float, default=0.0, help="SimConfig.decode_batch_slowdown")
    add("--prefill-tps", default="auto", help="prefill tokens/s per request, or 'auto' (see --target-util)")
    add("--target-util", type=float, default=0.8, help="'auto' prefill: busy fraction of workers with no cache hit")
    add("--max-concurrency", type=int, default=256, help="requests in flight at the client, at most")
    add("--max-seconds", type=float, default=600.0, help="stop sending after this many seconds (per run)")
    add("--drain-seconds", type=float, default=60.0, help="then wait at most this long for in-flight requests")
    add("--text-cache-blocks", type=int, default=DEFAULT_CACHE_BLOCKS, help="block texts kept in memory (LRU)")
    add("--seed", type=int, default=0, help="seed of the block texts")
    add("--quick", action="store_true", help="smoke test: 300 requests at 8x, ~1 minute in all")
    add("--results-dir", type=Path, default=RESULTS_DIR)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == build_parser().get_default(key):
                setattr(args, key, value)
    for name in ("speedup", "workers", "max_concurrency", "max_seconds", "minutes", "output_scale"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.minutes > TUNING_MINUTES:
        print(f"warning: --minutes {args.minutes:g} reaches past the {TUNING_MINUTES:g}-minute tuning window "
              "into held-out data", file=sys.stderr)
    if args.prefill_tps != "auto":
        try:
            if float(args.prefill_tps) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit("--prefill-tps wants 'auto' or a positive number") from None
    return Settings(
        trace=args.trace, minutes=args.minutes, limit=args.limit, speedup=args.speedup,
        output_scale=args.output_scale, workers=args.workers, policies=_names(args.policies),
        policy_params=_param_pairs(args.policy_params), peers=_names(args.peers),
        gateway_extra=deep_merge({} if args.no_gateway_time_scale else scaled_gateway_timers(args.speedup),
                                 args.gateway_extra),
        kv_capacity_tokens=args.kv_capacity, kv_block_tokens=args.kv_block,
        max_num_seqs=args.max_num_seqs or (256 if args.scheduler == "stepped" else 4), scheduler=args.scheduler,
        chunk_tokens=args.chunk_tokens, decode_s_per_seq=args.decode_ms_per_seq / 1000.0,
        ttft_s=args.ttft, tpot_s=args.tpot, decode_batch_slowdown=args.decode_slowdown,
        prefill_tps=args.prefill_tps, target_util=args.target_util, max_concurrency=args.max_concurrency,
        max_seconds=args.max_seconds, drain_seconds=args.drain_seconds,
        text_cache_blocks=args.text_cache_blocks, seed=args.seed, results_dir=args.results_dir)


def _git_describe() -> str:
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=REPO, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run every policy and peer; print the table; write the result files. Exit code 0, or 1 when
    no run completed a request."""
    argv = sys.argv[1:] if argv is None else argv
    s = settings_from(build_parser().parse_args(argv))
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = s.results_dir / f"replay-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "loadtest.replay", *argv])

    rows = read_trace(s.trace, s.minutes, s.limit)
    if not rows:
        raise SystemExit(f"{s.trace}: no requests in the first {s.minutes} minutes")
    items = schedule(rows, s.speedup, s.output_scale)
    summary = summarize(items)
    prefill_tps = auto_prefill_tps(summary, s) if s.prefill_tps == "auto" else float(s.prefill_tps)
    print(f"trace: {summary.requests} requests over {summary.span_s:.0f} s of replay ({s.speedup:g}x), "
          f"{summary.prompt_tokens / 1e6:.1f}M prompt tokens, {summary.distinct_blocks} distinct blocks; "
          f"prefill {prefill_tps:,.0f} tokens/s "
          f"{'per worker (shared)' if s.scheduler == 'stepped' else 'per request slot'}", flush=True)
    references = oracle.references(rows, s.workers, s.kv_capacity_tokens)
    texts = BlockTexts(seed=s.seed, cache_blocks=s.text_cache_blocks)

    notes: list[str] = []
    plan: list[tuple[str, str, str | None]] = []
    """(name, kind, why it is skipped or None), in run order."""
    for policy in s.policies:
        problem = check_policy(policy, s, log_dir)
        if problem is not None:
            print(f"warning: skipping policy {policy}: the gateway rejects it: {problem}", file=sys.stderr)
        plan.append((policy, "gateway", problem))
    missing = peer_available() if s.peers else None
    for peer in s.peers:
        if missing:
            print(f"warning: skipping peer {peer}: {missing}", file=sys.stderr)
        plan.append((f"sglang-router:{peer}", "peer", missing))

    meta: dict[str, Any] = {
        "started": stamp, "command": command, "gateway_version": _git_describe(), "notes": notes,
        "settings": {
            "trace": f"{s.trace.name}, first {s.minutes:g} min" + (f", limit {s.limit}" if s.limit else ""),
            "requests": summary.requests, "replay span (s)": round(summary.span_s, 1), "speedup": s.speedup,
            "prompt tokens": summary.prompt_tokens, "distinct blocks": summary.distinct_blocks,
            "workers": s.workers, "output scale": s.output_scale,
            "KV capacity (tokens/worker)": s.kv_capacity_tokens, "KV block (tokens)": s.kv_block_tokens,
            "max_num_seqs": s.max_num_seqs, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s,
            "scheduler": s.scheduler,
            **({"chunk tokens": s.chunk_tokens, "decode s per seq": s.decode_s_per_seq}
               if s.scheduler == "stepped" else {}),
            ("prefill (tokens/s per worker)" if s.scheduler == "stepped" else "prefill (tokens/s per request)"):
                round(prefill_tps),
            "prefill rule": (f"auto: {s.target_util:.0%} busy with no cache hit" if s.prefill_tps == "auto"
                             else "fixed"),
            "max concurrency": s.max_concurrency, "max seconds": s.max_seconds,
            "drain seconds": s.drain_seconds, "policy params": s.policy_params or "defaults",
            "gateway overrides": s.gateway_extra or "none",
            "logs": str(log_dir),
        },
    }
    runs: list[RunResult] = []
    for name, kind, skip in plan:
        if skip is not None:
            runs.append(RunResult(name, kind, status=f"skipped: {skip[:100]}"))
            continue
        try:
            runs.append(run_one(name, kind, s, items, texts, prefill_tps, log_dir, notes))
        except KeyboardInterrupt:
            print("interrupted: writing what was measured", file=sys.stderr)
            runs.append(RunResult(name, kind, status="failed: interrupted"))
            break
    md_path, json_path = write_results(s.results_dir, stamp, runs, references, meta)
    print()
    print(markdown(runs, references, meta))
    print(f"written: {md_path} and {json_path}")
    return 0 if any(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
