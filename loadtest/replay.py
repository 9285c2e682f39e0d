"""Replay the Kimi (Mooncake) conversation trace through the gateway and compare routing policies.

    python -m loadtest.replay                       # defaults: 40 min of trace at 20x, 8 workers, ~11 min
    python -m loadtest.replay --quick --policies round_robin,least_load   # ~300 requests, ~1.5 min
    python -m loadtest.replay --minutes 10 --utilisation 0.6,0.8,0.9 --repeat 3   # levels x repetitions
    python -m loadtest.replay --layouts aggregated,pd,sglang-pd   # + prefill/decode pools (loadtest.replay_pd)

Each layout (`loadtest.layouts`: a gateway policy, or a peer router such as SGLang's or vLLM's
`cache_aware`) runs on a fresh set of processes: one process hosting N simulated SGLang workers
with a prefix (KV) cache model (`loadtest.workers`), then the gateway (`python -m gateway.cli
serve -c <generated yaml>`) or the peer router, whose time and size settings are scaled as the
gateway's are (`loadtest.peers`). This process is the load generator: it replays the trace at its
(compressed) arrival times, streaming, and reads the workers' totals afterwards. Load levels
(`--utilisation`) set the speed-up from the workers' capacity (`loadtest.capacity`); repetitions
rotate the order of the layouts (`loadtest.plan`); the table gives medians and min-max
(`loadtest.spread`). Results: a markdown table on stdout and
`loadtest/results/replay-<timestamp>.{md,json}` (with the command line and every setting).

Default sizing (2 cores, three policies plus two peers in about 11 minutes): the first 40
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
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from loadtest import oracle
from loadtest.capacity import Workload, prefill_for_utilisation, speedup_for_utilisation, utilisation
from loadtest.layouts import Launched, Layout, RunContext, build_layouts, gateway_overrides
from loadtest.loadgen import LoadOptions, chat_body, replay
from loadtest.peers import KV_AWARE_NOTE, Peer, parse_peer
from loadtest.plan import Level, run_order
from loadtest.procs import CpuMeter, ProcessError, ProcessGroup
from loadtest.replay_settings import MODEL, SIM_MESSAGE_OVERHEAD_TOKENS, Settings, auto_or_positive, sim_fields, window
from loadtest.report import BUSY_WARNING, RunResult, summarize_run, summary_table, write_results
from loadtest.texts import DEFAULT_CACHE_BLOCKS, BlockTexts, prompt_bytes_for
from loadtest.trace import ScheduledRequest, TraceRequest, read_trace, schedule, summarize
from loadtest.ttft_split import SPLIT_KINDS, join, split_section
from loadtest.ttft_split import summarize as summarize_split
from loadtest.workerstats import StatsReader

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("KIMI_SHARED_DATA", REPO.parent / "shared" / "data"))
"""The shared data directory (`KIMI_SHARED_DATA`, as the tests read it; a worktree sits elsewhere)."""
DEFAULT_TRACE = SHARED_DATA / "traces" / "mooncake" / "conversation_trace.jsonl"
RESULTS_DIR = Path(__file__).resolve().parent / "results"

DEFAULT_POLICIES = "least_load,prefix_affinity,ttft_cost"  # a baseline, the earlier default, the default
DEFAULT_PEERS = "sglang-router:cache_aware,vllm-router:cache_aware"
TUNING_MINUTES = 40.0
"""Trace rows with timestamp < 2,400,000 ms are for tuning; later ones are held out."""
QUICK = {"limit": 300, "speedup": 8.0, "max_seconds": 60.0, "drain_seconds": 30.0}
"""`--quick`: the first 300 requests (102 s of trace) at 8x: ~13 s of replay per run."""


# --- load levels ----------------------------------------------------------------------------------------


def workload_of(rows: list[TraceRequest], s: Settings) -> Workload:
    """The trace's offer at speed-up 1 (arrival rate, mean prompt and output tokens)."""
    summary = summarize(schedule(rows, 1.0, s.output_scale))
    return Workload.from_totals(summary.requests, summary.span_s, 1.0, summary.prompt_tokens,
                                summary.output_tokens)


def plan_levels(s: Settings, load: Workload) -> list[Level]:
    """The load levels to run. The workers' prefill speed is fixed first: `--prefill-tps`, or "auto"
    (the speed at which they would be `target_util` busy at the reference `--speedup`). Then each
    `--utilisation` target gets the speed-up that offers that share of their capacity
    (`loadtest.capacity`); without targets, one level at `--speedup`."""
    base = sim_fields(s, None)
    try:
        prefill = (prefill_for_utilisation(s.target_util, base, load, s.workers, s.speedup)
                   if s.prefill_tps == "auto" else float(s.prefill_tps))
        sim = sim_fields(s, prefill)
        if not s.utilisations:
            return [Level(None, s.speedup, prefill)]
        return [Level(u, speedup_for_utilisation(u, sim, load, s.workers), prefill) for u in s.utilisations]
    except ValueError as exc:
        raise SystemExit(f"load levels: {exc}") from exc


# --- one run --------------------------------------------------------------------------------------------


async def replay_and_measure(launched: Launched, items: list[ScheduledRequest], texts: BlockTexts,
                             s: Settings, name: str, kind: str) -> RunResult:
    """Reset the workers' counters, replay, read the counters, summarise (a layout's side workers,
    e.g. PD decode workers, into `RunResult.pd`)."""

    def build(item: ScheduledRequest, request_id: str) -> bytes:
        req = item.request
        text = texts.prompt(req.hash_ids, prompt_bytes_for(req.input_length, SIM_MESSAGE_OVERHEAD_TOKENS))
        return chat_body(MODEL, text, item.max_tokens, tag=request_id)

    stats, side = StatsReader(launched.worker_urls), StatsReader(launched.side_urls)
    await stats.start()
    await side.start()
    options = LoadOptions(max_concurrency=s.max_concurrency, max_seconds=s.max_seconds,
                          drain_seconds=s.drain_seconds)
    results, wall = await replay(launched.base, items, build, options)
    run = summarize_run(name, kind, results, await stats.finish(), wall)
    if kind in SPLIT_KINDS:
        timings, dropped = await stats.timings()
        if any(timings):
            joined = join(results, timings)
            run.request_splits = joined.splits
            run.split = {**summarize_split(joined, run.ok), "dropped": dropped}
    side_totals = await side.finish()
    if launched.side_figures is not None:
        run.pd = launched.side_figures(side_totals)
    return run


def run_one(layout: Layout, ctx: RunContext, repeat: int, items: list[ScheduledRequest], texts: BlockTexts,
            log_dir: Path, notes: list[str]) -> RunResult:
    """Fresh processes for one layout at one load level, one replay, everything stopped afterwards."""
    s, level = ctx.settings, ctx.level
    tag = f"{layout.name} @ {level.label} #{repeat + 1}"
    started = time.monotonic()
    print(f"[{tag}] starting {s.workers} workers and the {layout.kind}...", flush=True)
    details: dict[str, Any] = {}
    try:
        run_dir = log_dir / f"{level.label.replace('%', 'pct')}-r{repeat + 1}-{layout.name.replace(':', '-')}"
        with ProcessGroup(run_dir) as group:
            launched = layout.launch(group, ctx)
            details = launched.details
            if launched.dropped:
                note = (f"SimConfig lacks {', '.join(launched.dropped)}: those worker settings were not applied")
                if note not in notes:
                    notes.append(note)
                print(f"[{tag}] warning: {note}", flush=True)
            print(f"[{tag}] replaying {len(items)} requests at {level.speedup:.3g}x...", flush=True)
            pids = {"loadgen": os.getpid(), **{c.name: c.pid for c in group.children if c.pid is not None}}
            with CpuMeter(pids) as meter:
                run = asyncio.run(replay_and_measure(launched, items, texts, s, layout.name, layout.kind))
                run.cpu_seconds, run.machine_busy = meter.read()
            if run.request_splits:
                with (run_dir / "splits.jsonl").open("wb") as out:
                    out.writelines(orjson.dumps(split.to_json()) + b"\n" for split in run.request_splits)
            if launched.after_replay is not None:
                details = {**details, **launched.after_replay()}
            exited = [c.name for c in group.children if not c.alive()]
            if exited and run.status == "ok":  # e.g. could not bind: the load went to whoever holds the port
                run.status = f"failed: {', '.join(exited)} exited during the run"
    except ProcessError as exc:
        print(f"[{tag}] failed: {exc}", file=sys.stderr, flush=True)
        run = RunResult(layout.name, layout.kind, status=f"failed: {str(exc).splitlines()[0][:120]}")
    run.level, run.utilisation, run.speedup, run.repeat, run.details = (level.label, level.utilisation,
                                                                        level.speedup, repeat, details)
    run.total_s = time.monotonic() - started
    busy = "" if run.machine_busy is None else f", machine CPU {run.machine_busy:.0%} busy"
    if (run.machine_busy or 0.0) > BUSY_WARNING:
        busy += " (CPU-saturated: figures are not reliable)"
    lag = "" if run.send_lag_p99_s is None else f", p99 send lag {run.send_lag_p99_s:.2f} s"
    print(f"[{tag}] done in {run.total_s:.0f} s: {run.ok}/{run.sent} ok, hit ratio "
          f"{'n/a' if run.hit_ratio is None else f'{run.hit_ratio:.3f}'}, p99 TTFT "
          f"{'n/a' if run.ttft_p99_s is None else f'{run.ttft_p99_s:.3f} s'}{lag}{busy}", flush=True)
    if run.split:
        p50 = {k: (run.split.get(k) or {}).get("p50") for k in ("ttft_s", "router_s", "queue_s", "prefill_s")}
        print(f"[{tag}] TTFT split (p50, ms): " + ", ".join(
            f"{k[:-2]} {'-' if v is None else f'{v * 1000:.0f}'}" for k, v in p50.items())
            + f"; {run.split['joined']}/{run.split['completed']} joined", flush=True)
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


def _fractions(value: str) -> list[float]:
    out = []
    for part in _names(value):
        try:
            u = float(part.rstrip("%")) / (100.0 if part.endswith("%") else 1.0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not 0 < u <= 2:
            raise argparse.ArgumentTypeError(f"utilisation {part!r} is not in (0, 2]")
        out.append(u)
    return out


def _peers(value: str) -> list[Peer]:
    try:
        return [parse_peer(name) for name in _names(value)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    add("--minutes", type=float, default=TUNING_MINUTES,
        help="use rows with timestamp < minutes x 60,000 ms (40 = the tuning window)")
    add("--from-minutes", type=float, default=0.0,
        help="and timestamp >= this x 60,000 ms: --from-minutes 40 --minutes 60 is all of the held-out "
             "traffic (the published table uses minutes 40-50)")
    add("--limit", type=int, help="at most this many requests (the first ones)")
    add("--speedup", type=float, default=20.0,
        help="time compression of the arrivals (x); with --utilisation only the reference of --prefill-tps auto")
    add("--utilisation", type=_fractions, default=[], metavar="U[,U...]",
        help="run each load level: the speed-up at which the workers' offered load (no cache hit) is this "
             "share of their capacity, e.g. 0.6,0.8,0.9 (see loadtest/capacity.py)")
    add("--repeat", type=int, default=1, help="repetitions of every run; repetition i starts with layout i")
    add("--output-scale", type=float, default=0.05, help="max_tokens = round(output_length x this), at least 1")
    add("--workers", type=int, default=8, help="simulated SGLang workers")
    add("--policies", default=DEFAULT_POLICIES, help="gateway policies, comma-separated ('none' to skip)")
    add("--policy-params", action="append", default=[], metavar="POLICY=JSON",
        help="the pool's policy_params for one policy, e.g. prefix_affinity='{\"balance_abs\": 4}'")
    add("--gateway-extra", type=_json_object, default={}, metavar="JSON",
        help="merged into the generated gateway config, e.g. '{\"load\": {\"interval\": 0.25}}'")
    add("--no-gateway-time-scale", action="store_true",
        help="keep the gateway's load-scrape interval and affinity TTL as configured instead of / speedup")
    add("--peers", type=_peers, default=DEFAULT_PEERS, metavar="ROUTER:POLICY[,...]",
        help="peer routers: sglang-router:POLICY, vllm-router:POLICY (a bare POLICY = sglang-router; 'none' to skip)")
    add("--no-peer-scale", action="store_true",
        help="run the peers with their default eviction interval and tree size (see loadtest/peers.py)")
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
    add("--prefill-tps", type=auto_or_positive, default="auto",
        help="prefill tokens/s (stepped: per worker, shared; per_request: per request), or 'auto' (--target-util)")
    add("--target-util", type=float, default=0.8,
        help="'auto' prefill: utilisation of the workers at --speedup with no cache hit")
    add("--max-concurrency", type=int, default=256, help="requests in flight at the client, at most")
    add("--max-seconds", type=float, default=600.0, help="stop sending after this many seconds (per run)")
    add("--drain-seconds", type=float, default=60.0, help="then wait at most this long for in-flight requests")
    add("--text-cache-blocks", type=int, default=DEFAULT_CACHE_BLOCKS, help="block texts kept in memory (LRU)")
    add("--seed", type=int, default=0, help="seed of the block texts")
    add("--quick", action="store_true", help="smoke test: 300 requests at 8x, ~20 s a run")
    add("--results-dir", type=Path, default=RESULTS_DIR)
    from loadtest import replay_pd  # builds on this module's helpers: imported when used

    replay_pd.add_arguments(parser)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == build_parser().get_default(key):
                setattr(args, key, value)
    if isinstance(args.peers, str):  # the default string is not passed through `type`
        args.peers = _peers(args.peers)
    for name in ("speedup", "workers", "max_concurrency", "max_seconds", "minutes", "output_scale", "repeat",
                 "target_util"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.from_minutes < args.minutes:
        raise SystemExit("--from-minutes must be at least 0 and below --minutes")
    if args.minutes > TUNING_MINUTES and args.from_minutes < TUNING_MINUTES:
        print(f"warning: --minutes {args.minutes:g} reaches past the {TUNING_MINUTES:g}-minute tuning window "
              "into held-out data", file=sys.stderr)
    return Settings(
        trace=args.trace, minutes=args.minutes, from_minutes=args.from_minutes, limit=args.limit, speedup=args.speedup,
        output_scale=args.output_scale, workers=args.workers, policies=_names(args.policies),
        policy_params=_param_pairs(args.policy_params), gateway_extra=args.gateway_extra,
        gateway_time_scale=not args.no_gateway_time_scale, peers=args.peers, peer_scale=not args.no_peer_scale,
        kv_capacity_tokens=args.kv_capacity, kv_block_tokens=args.kv_block,
        max_num_seqs=args.max_num_seqs or (256 if args.scheduler == "stepped" else 4), scheduler=args.scheduler,
        chunk_tokens=args.chunk_tokens, decode_s_per_seq=args.decode_ms_per_seq / 1000.0, ttft_s=args.ttft,
        tpot_s=args.tpot, decode_batch_slowdown=args.decode_slowdown,
        prefill_tps=args.prefill_tps, target_util=args.target_util, utilisations=args.utilisation,
        repeats=args.repeat, max_concurrency=args.max_concurrency, max_seconds=args.max_seconds,
        drain_seconds=args.drain_seconds, text_cache_blocks=args.text_cache_blocks, seed=args.seed,
        results_dir=args.results_dir)


def _git_describe() -> str:
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=REPO, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _meta(s: Settings, stamp: str, command: str, rows: list[TraceRequest], load: Workload, levels: list[Level],
          log_dir: Path, notes: list[str]) -> dict[str, Any]:
    """The report's header: the command, every setting, the load levels and how they were derived."""
    sim = sim_fields(s, levels[0].prefill_tps)
    distinct = len({h for row in rows for h in row.hash_ids})
    return {
        "started": stamp, "command": command, "gateway_version": _git_describe(), "notes": notes,
        "settings": {
            "trace": f"{s.trace.name}, {window(s)}" + (f", limit {s.limit}" if s.limit else ""),
            "requests": load.requests, "trace span (s)": round(load.span_s_1x, 1),
            "prompt tokens": round(load.mean_prompt_tokens * load.requests), "distinct blocks": distinct,
            "load levels": [{"load": lv.label, "utilisation": round(utilisation(sim, load, s.workers, lv.speedup), 4),
                             "speedup": round(lv.speedup, 3), "replay span (s)": round(load.span_s_1x / lv.speedup, 1)}
                            for lv in levels],
            "repetitions": s.repeats, "run order": "repetition i starts with layout i mod n (loadtest/plan.py)",
            "workers": s.workers, "output scale": s.output_scale,
            "KV capacity (tokens/worker)": s.kv_capacity_tokens, "KV block (tokens)": s.kv_block_tokens,
            "max_num_seqs": s.max_num_seqs, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "scheduler": s.scheduler,
            **({"chunk tokens": s.chunk_tokens, "decode s per seq": s.decode_s_per_seq}
               if s.scheduler == "stepped" else {}),
            ("prefill (tokens/s per worker)" if s.scheduler == "stepped" else "prefill (tokens/s per request)"):
                round(levels[0].prefill_tps or 0),
            "prefill rule": (f"auto: {s.target_util:.0%} utilisation at {s.speedup:g}x with no cache hit"
                             if s.prefill_tps == "auto" else "fixed"),
            "max concurrency": s.max_concurrency, "max seconds": s.max_seconds,
            "drain seconds": s.drain_seconds, "policy params": s.policy_params or "defaults",
            "gateway overrides": {lv.label: gateway_overrides(s, lv.speedup) for lv in levels},
            "peer scaling": "eviction interval / speed-up, tree size = worker KV in chars" if s.peer_scale
                            else "router defaults",
            "logs": str(log_dir),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Run every layout at every load level, `--repeat` times in rotated order; print the tables;
    write the result files. Exit code 0, or 1 when no run completed a request."""
    from loadtest import replay_pd  # builds on this module's helpers: imported when used

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    s, pd = replay_pd.pd_settings(args, settings_from(args))
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = s.results_dir / f"replay-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "loadtest.replay", *argv])

    rows = read_trace(s.trace, s.minutes, s.limit, s.from_minutes)
    if not rows:
        raise SystemExit(f"{s.trace}: no requests in the {window(s)}")
    load = workload_of(rows, s)
    levels = plan_levels(s, load)
    schedules = [schedule(rows, level.speedup, s.output_scale) for level in levels]
    for level, items in zip(levels, schedules, strict=True):
        summary = summarize(items)
        print(f"load {level.label}: {summary.requests} requests over {summary.span_s:.0f} s of replay "
              f"({level.speedup:.3g}x), {summary.prompt_tokens / 1e6:.1f}M prompt tokens; prefill "
              f"{level.prefill_tps or 0:,.0f} tokens/s "
              f"{'per worker (shared)' if s.scheduler == 'stepped' else 'per request slot'}", flush=True)
    references = oracle.references(rows, s.workers, s.kv_capacity_tokens) + replay_pd.references(rows, pd)
    texts = BlockTexts(seed=s.seed, cache_blocks=s.text_cache_blocks)

    notes: list[str] = []
    if any(p.router == "vllm-router" and p.policy == "kv_aware" for p in s.peers):
        notes.append(KV_AWARE_NOTE)
    layouts = build_layouts(s, log_dir) + replay_pd.layouts(pd)
    runs: list[RunResult] = []
    for layout in layouts:
        if layout.problem is not None:
            print(f"warning: skipping {layout.name}: {layout.problem}", file=sys.stderr)
            runs += [RunResult(layout.name, layout.kind, status=f"skipped: {layout.problem[:100]}",
                               level=level.label, utilisation=level.utilisation, speedup=level.speedup)
                     for level in levels]
    runnable = [layout for layout in layouts if layout.problem is None]
    meta = _meta(s, stamp, command, rows, load, levels, log_dir, notes)
    meta["settings"].update(replay_pd.describe(pd, levels[0].prefill_tps))
    order = run_order(len(runnable), len(levels), s.repeats)
    for i, slot in enumerate(order):
        layout, level = runnable[slot.layout], levels[slot.level]
        print(f"--- run {i + 1}/{len(order)}", flush=True)
        try:
            runs.append(run_one(layout, RunContext(s, level), slot.repeat, schedules[slot.level], texts,
                                log_dir, notes))
        except KeyboardInterrupt:
            print("interrupted: writing what was measured", file=sys.stderr)
            runs.append(RunResult(layout.name, layout.kind, status="failed: interrupted", level=level.label,
                                  utilisation=level.utilisation, speedup=level.speedup, repeat=slot.repeat))
            break
    md_path, json_path = write_results(s.results_dir, stamp, runs, references, meta)
    print()
    print(summary_table(runs, references))
    print()
    print(split_section(runs)[0])
    print(f"\nwritten: {md_path} and {json_path}")
    return 0 if any(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
