"""Side-by-side overhead of the gateway against going direct and against other routers (issue 5).

    python -m loadtest.overhead --quick                 # gateway vs direct, ~1.5 min
    python -m loadtest.overhead --peers                 # + vllm-router, sglang-router, LiteLLM: <= ~10 min
    python -m loadtest.overhead --peers --rounds 3 --json out.json
    python -m loadtest.overhead --quick --flow-control  # the gateway's pool with flow control on (issue 39)

One fast fake engine (`loadtest.stub_upstream`: no artificial delay, 32 SSE chunks an answer) serves
every target: "direct" (the engine itself), the gateway (`kimi-gateway serve` with one pool of one
vLLM-kind worker, its defaults: prefix affinity with the in-process store, health probes, load
scrapes, access log at info), the gateway with its affinity store in Redis, and with `--peers`
vLLM's and SGLang's routers (Rust, `cache_aware`) and LiteLLM's proxy. All run at once; this
process is the load generator (raw asyncio + httptools connections, kept alive).

Pinning (when there are 2+ cores and `taskset`): the router under test on core 0, the load
generator and the fake engine on core 1. So "req/s" of a fast router is bounded by what core 1
can generate and serve: the direct row shows that ceiling, and the "core-1 busy" column says how
close to it a run was.

Each round runs every scenario against every target, targets in a rotated order per round, and
waits for the target to be idle after each run. Reported: medians over rounds, the added TTFT over
direct computed within each round; CPU ms per request of the target's process tree over the
measured window (/proc utime + stime); its peak RSS (sampled every 0.25 s); errors. Then the scale
figure (`--scale-streams` slow streams at once through one gateway process: RSS before and at the
peak, per 1,000 streams) and, unless `--no-profile`, a py-spy profile of the gateway under the
streaming c=64 16 KiB load. Results: the tables on stdout and `loadtest/results/overhead-<ts>.{md,json}`
(`--json` names the JSON file), logs and generated configs in `overhead-<ts>-logs/`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest import overhead_targets as tg
from loadtest import proctree
from loadtest.overhead_load import (
    Meter,
    RequestMaker,
    RunFigures,
    StreamsFigures,
    Window,
    run_latency,
    run_streams,
    run_throughput,
)
from loadtest.overhead_stats import (
    DIRECT,
    ProfileTop,
    Row,
    Sample,
    aggregate,
    find,
    fmt,
    fmt_ratio,
    markdown_table,
    profile_table,
    ratio,
    sample_from,
    top_self,
)
from loadtest.procs import ProcessError, ProcessGroup
from loadtest.report import percentile

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZES = {"200B": 200, "16KiB": 16 * 1024, "1MiB": 1024 * 1024}
REQUEST_TIMEOUT_S = 60.0


NEWCONN = " newconn"
"""The suffix of a scenario whose every request opens a new connection (`Scenario.fresh`)."""


@dataclass(frozen=True)
class Scenario:
    """One kind of load: streaming or not, clients at once, prompt size label (a key of SIZES), and
    `fresh`: each request on a new TCP connection (the client closes it after the answer) instead
    of one kept alive per client."""

    stream: bool
    concurrency: int
    size: str
    fresh: bool = False

    @property
    def name(self) -> str:
        return f"{'stream' if self.stream else 'json'} c={self.concurrency} {self.size}{NEWCONN if self.fresh else ''}"


def _scenarios(spec: str) -> list[Scenario]:
    """`MODE:CONCURRENCY:SIZE[:new],...` (`new`: a new connection per request) as Scenarios."""
    out = []
    for item in spec.split(","):
        mode, conc, size, *rest = item.split(":")
        if rest not in ([], ["new"]):
            raise SystemExit(f"--scenarios: {item!r}: the fourth field can only be `new`")
        out.append(Scenario(mode == "stream", int(conc), size, fresh=rest == ["new"]))
    return out


FULL_SCENARIOS = _scenarios("stream:1:200B,stream:1:16KiB,stream:1:1MiB,json:1:16KiB,json:1:1MiB,"
                            "stream:64:16KiB,stream:64:16KiB:new,stream:64:1MiB,stream:256:16KiB,json:64:16KiB,"
                            "json:256:16KiB")
QUICK_SCENARIOS = _scenarios("stream:1:200B,stream:1:16KiB,stream:1:1MiB,json:1:16KiB,stream:64:16KiB,"
                             "stream:64:16KiB:new,stream:256:16KiB,json:64:16KiB")
PROFILE_SCENARIO = Scenario(True, 64, "16KiB")
PROFILE_HZ = 200


@dataclass(frozen=True)
class Timing:
    """How long each kind of run lasts (seconds) and how many requests a latency run sends."""

    latency_count: int
    latency_count_1mib: int
    latency_max_s: float
    latency_warmup: int
    window: Window
    settle_s: float


FULL_TIMING = Timing(300, 60, 1.5, 5, Window(0.4, 1.5, 2.0, warmup_max_s=8.0, window_max_s=5.0,
                                            min_window_requests=50), 4.0)
QUICK_TIMING = Timing(100, 20, 0.8, 3, Window(0.3, 1.0, 2.0, warmup_max_s=5.0, window_max_s=3.0,
                                             min_window_requests=30), 3.0)


# --- the machine ----------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """nproc, CPU model, kernel, Python, load average (a busy machine makes noisy figures)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_start": _loadavg()}


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def versions() -> dict[str, str | None]:
    return {name: tg.dist_version(name) for name in
            ("uvicorn", "starlette", "httpx", "aiohttp", "uvloop", "httptools", "orjson", "sglang-router",
             "vllm-router", "litellm", "py-spy")}


def raise_fd_limit() -> int:
    """Soft open-file limit raised to the hard one (1,000 streams need ~2,000 sockets); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        new = 65536 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        return new
    return soft


# --- starting the targets -------------------------------------------------------------------------------


@dataclass
class Plan:
    """What runs: targets by name in order, and the notes on what was skipped and why."""

    targets: list[tg.Target]
    notes: list[str]


def start_targets(group: ProcessGroup, engine: tg.Target, pin: tg.Pinning, args: argparse.Namespace) -> Plan:
    wanted = _wanted(args)
    targets, notes = [engine], []

    def attempt(name: str, start: Any) -> None:
        if name not in wanted:
            return
        print(f"  starting {name}...", flush=True)
        try:
            targets.append(start())
        except ProcessError as exc:
            notes.append(f"{name} did not start: {str(exc).splitlines()[0][:200]}")
            print(f"  warning: {notes[-1]}", file=sys.stderr, flush=True)

    attempt("gateway", lambda: tg.start_gateway(group, "gateway", engine, pin, args.gateway_log_level,
                                                flow=args.flow_control))
    for name in ("gateway+redis", "gateway+prod"):
        if name not in wanted:
            continue
        if tg.redis_available():
            attempt(name, lambda name=name: tg.start_gateway(group, name, engine, pin, args.gateway_log_level,
                                                             redis=True, prod=name == "gateway+prod"))
        else:
            notes.append(f"{name} skipped: no Redis at {tg.REDIS_URL}")
    if "gateway-2proc" in wanted:
        flag = tg.gateway_process_flag()
        if flag is not None:
            cores = f"{pin.router},{pin.engine}" if pin.router else None
            attempt("gateway-2proc", lambda: tg.start_gateway(group, "gateway-2proc", engine, pin,
                                                              args.gateway_log_level, processes=(flag, 2), cores=cores))
            notes.append(f"gateway-2proc: `kimi-gateway serve {flag} 2`, both processes on cores 0 and 1 (shared "
                         "with the load generator and the engine): its req/s and CPU are not comparable with "
                         "the one-core rows")
        else:
            notes.append("gateway-2proc skipped: `kimi-gateway serve` has no --processes/--workers option")
    for peer in ("vllm-router", "sglang-router", "litellm"):
        if peer not in wanted:
            continue
        missing = tg.peer_missing(peer)
        if missing:
            notes.append(f"{peer} skipped: {missing}")
            continue
        if peer == "litellm":
            attempt(peer, lambda: tg.start_litellm(group, engine, pin))
        else:
            attempt(peer, lambda peer=peer: tg.start_rust_router(group, peer, engine, pin))
    return Plan(targets, notes)


def _wanted(args: argparse.Namespace) -> list[str]:
    if args.targets:
        return [t.strip() for t in args.targets.split(",") if t.strip()]
    names = ["gateway"] + ([] if args.quick else ["gateway+redis", "gateway+prod", "gateway-2proc"])
    if args.peers:
        names += ["vllm-router", "sglang-router", "litellm"]
    return names


# --- measuring ------------------------------------------------------------------------------------------


def _sample(scenario: Scenario, target: tg.Target, rnd: int, fig: RunFigures) -> Sample:
    return sample_from(scenario.name, target.name, rnd, fig.ok, fig.errors, fig.seconds, fig.events,
                       fig.first_us, fig.total_us, fig.target_cpu_s, fig.rss_peak_kb, fig.loadgen_cpu_s,
                       fig.engine_cpu_s, fig.error_kinds, scenario.concurrency, fig.little_rps)


async def measure_one(scenario: Scenario, target: tg.Target, engine: tg.Target, timing: Timing, chunks: int,
                      counter: itertools.count[int]) -> RunFigures:
    size = SIZES[scenario.size]
    maker = RequestMaker(target.port, size, scenario.stream, chunks, tg.MASTER_KEY, counter)
    meter = Meter(target.pid if target.kind != "direct" else None, engine.pid)
    if scenario.concurrency == 1:
        count = timing.latency_count_1mib if size >= SIZES["1MiB"] else timing.latency_count
        fig = await run_latency(target.port, maker, meter, count, timing.latency_max_s, timing.latency_warmup,
                                REQUEST_TIMEOUT_S, fresh=scenario.fresh)
    else:
        fig = await run_throughput(target.port, maker, meter, scenario.concurrency, timing.window, REQUEST_TIMEOUT_S,
                                   fresh=scenario.fresh)
    await meter.settle(timing.settle_s)
    return fig


async def measure_rounds(plan: Plan, engine: tg.Target, scenarios: list[Scenario], rounds: int, timing: Timing,
                         chunks: int, deadline: float, notes: list[str]) -> tuple[list[Sample], int]:
    """Every scenario on every target, `rounds` times; returns the samples and the rounds done."""
    samples: list[Sample] = []
    counter = itertools.count()
    done = 0
    for rnd in range(rounds):
        started = time.monotonic()
        for scenario in scenarios:
            shift = rnd % len(plan.targets)
            order = plan.targets[shift:] + plan.targets[:shift]
            line = []
            for target in order:
                fig = await measure_one(scenario, target, engine, timing, chunks, counter)
                sample = _sample(scenario, target, rnd, fig)
                samples.append(sample)
                figure = (f"{fmt(sample.ttft_p50_us)} µs" if scenario.concurrency == 1
                          else f"{fmt(sample.rps)} req/s")
                line.append(f"{target.name} {figure}" + (f" ({fig.errors} err)" if fig.errors else ""))
            print(f"  round {rnd + 1} {scenario.name}: " + "; ".join(line), flush=True)
        done += 1
        took = time.monotonic() - started
        if rnd + 1 < rounds and time.monotonic() + took > deadline:
            notes.append(f"stopped after {done} of {rounds} rounds: the next would pass --max-minutes")
            break
    return samples, done


async def measure_scale(group: ProcessGroup, pin: tg.Pinning, args: argparse.Namespace,
                        log_level: str) -> dict[str, Any]:
    """N slow streams at once: direct (proves the engine and client keep up), then one gateway process."""
    chunk_delay = args.scale_seconds / args.scale_chunks
    slow = tg.start_stub(group, "slow-engine", pin, args.scale_chunks, chunk_delay)
    gateway = tg.start_gateway(group, "gateway-scale", slow, pin, log_level)
    counter = itertools.count(10**11)
    out: dict[str, Any] = {"streams": args.scale_streams, "chunks": args.scale_chunks,
                           "chunk_delay_ms": round(chunk_delay * 1000, 3), "ideal_s": args.scale_seconds}
    for target in (slow, gateway):
        maker = RequestMaker(target.port, SIZES["200B"], True, args.scale_chunks, tg.MASTER_KEY, counter)
        meter = Meter(target.pid, None)
        # A few requests first, so "before" is a warmed-up process rather than a fresh one.
        await run_latency(target.port, maker, Meter(None, None), 3, 30.0, 0, REQUEST_TIMEOUT_S)
        fig = await run_streams(target.port, maker, meter, args.scale_streams,
                                timeout=args.scale_seconds * 6 + 30)
        out["direct" if target is slow else "gateway"] = _streams_summary(fig)
        print(f"  scale {'direct' if target is slow else 'gateway'}: {fig.ok}/{fig.streams} ok, "
              f"duration p50 {fmt(percentile(fig.duration_s, 50), 2)} s, RSS "
              f"{_mb(fig.rss_before_kb)} -> peak {_mb(fig.rss_peak_kb)} MB", flush=True)
    return out


def _tree_rss_mb(target: tg.Target) -> float | None:
    """Resident memory of the target's process tree now, MB (None for direct: no router)."""
    if target.kind == "direct" or target.pid is None:
        return None
    kb = proctree.rss_kb(proctree.descendants(target.pid))
    return None if kb is None else kb / 1024


def _mb(kb: int | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.1f}"


def _streams_summary(fig: StreamsFigures) -> dict[str, Any]:
    per_1000 = None
    if fig.rss_peak_kb is not None and fig.rss_before_kb is not None and fig.streams:
        per_1000 = (fig.rss_peak_kb - fig.rss_before_kb) / 1024 * 1000 / fig.streams
    return {
        "ok": fig.ok, "errors": fig.errors, "error_kinds": fig.error_kinds,
        "duration_p50_s": percentile(fig.duration_s, 50), "duration_p99_s": percentile(fig.duration_s, 99),
        "duration_max_s": max(fig.duration_s) if fig.duration_s else None,
        "rss_before_mb": None if fig.rss_before_kb is None else fig.rss_before_kb / 1024,
        "rss_peak_mb": None if fig.rss_peak_kb is None else fig.rss_peak_kb / 1024,
        "rss_after_mb": None if fig.rss_after_kb is None else fig.rss_after_kb / 1024,
        "rss_per_1000_streams_mb": per_1000,
        "cpu_s": fig.target_cpu_s, "wall_s": fig.wall_s,
    }


def pyspy_path() -> str | None:
    """py-spy's executable (the venv's or on PATH), or None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def profile_load(target: tg.Target, engine: tg.Target, pin: tg.Pinning, pyspy: str, seconds: float,
                       chunks: int, out_path: Path) -> tuple[RunFigures, int | None, str]:
    """py-spy (sampling, non-blocking, 200 Hz, by function) on the gateway under the streaming c=64
    16 KiB load; returns the load's figures, py-spy's exit code and the tail of its output."""
    argv = pin.argv(pin.engine, [pyspy, "record", "--pid", str(target.pid), "--rate", str(PROFILE_HZ),
                                 "--duration", str(int(seconds)), "--nonblocking", "--nolineno", "--subprocesses",
                                 "--format", "raw", "--output", str(out_path)])
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    await asyncio.sleep(0.5)  # py-spy attaches
    counter = itertools.count(2 * 10**11)
    maker = RequestMaker(target.port, SIZES[PROFILE_SCENARIO.size], True, chunks, tg.MASTER_KEY, counter)
    meter = Meter(target.pid, engine.pid)
    bounds = Window(0.0, seconds + 0.5, 5.0, window_max_s=seconds + 0.5)
    fig = await run_throughput(target.port, maker, meter, PROFILE_SCENARIO.concurrency, bounds, REQUEST_TIMEOUT_S)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 30.0)
    except TimeoutError:
        proc.kill()
        output = b"py-spy did not finish"
    return fig, proc.returncode, output.decode("utf-8", "replace")[-300:]


def profile_gateway(target: tg.Target, engine: tg.Target, pin: tg.Pinning, seconds: float, chunks: int,
                    out_path: Path) -> dict[str, Any]:
    """Profile the gateway (see `profile_load`) and rank its functions and files by self time."""
    pyspy = pyspy_path()
    if pyspy is None or target.pid is None:
        return {"skipped": "py-spy is not installed (.venv/bin/pip install -e '.[bench]')"}
    fig, code, output = _run_async(profile_load(target, engine, pin, pyspy, seconds, chunks, out_path))
    if code != 0 or not out_path.exists():
        return {"skipped": f"py-spy failed (exit {code}): {output}"}
    top = top_self(out_path.read_text(encoding="utf-8").splitlines(), 15)
    return {"file": str(out_path), "seconds": seconds, "rate_hz": PROFILE_HZ, "scenario": PROFILE_SCENARIO.name,
            "req_per_s_while_profiled": fig.ok / fig.seconds if fig.seconds else None,
            "cpu_ms_per_req_while_profiled": fig.target_cpu_s * 1000 / fig.ok if fig.target_cpu_s and fig.ok else None,
            "samples": top.total, "top_functions": top.functions, "top_files": top.files,
            "top_packages": top.packages, "gateway_inclusive": top.gateway_inclusive}


# --- report ---------------------------------------------------------------------------------------------


def issue_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The four figures issue 5 sets, each with its value, its limit and whether it is met."""
    out: list[dict[str, Any]] = []
    gw16 = find(rows, "stream c=1 16KiB", "gateway")
    added = gw16.added_p50_us if gw16 else None
    out.append({"target": "added TTFT p50, stream c=1 16 KiB", "value": fmt(added, 0, " µs"), "limit": "<= 1,000 µs",
                "met": None if added is None else added <= 1000})
    cpu_gw = find(rows, "stream c=64 16KiB", "gateway")
    rust = [r for r in (find(rows, "stream c=64 16KiB", n) for n in ("vllm-router", "sglang-router")) if r]
    best = min((r.cpu_ms_per_req for r in rust if r.cpu_ms_per_req is not None), default=None)
    cpu_ratio = ratio(cpu_gw.cpu_ms_per_req if cpu_gw else None, best)
    out.append({"target": "CPU per streamed request (c=64 16 KiB) / the better Rust router's",
                "value": fmt_ratio(cpu_ratio), "limit": "<= 3x", "met": None if cpu_ratio is None else cpu_ratio <= 3})
    thr = ratio(*(r.rps if r else None for r in (find(rows, "stream c=256 16KiB", "gateway"),
                                                  find(rows, "stream c=256 16KiB", "litellm"))))
    out.append({"target": "req/s at c=256 (stream 16 KiB) / LiteLLM's", "value": fmt_ratio(thr), "limit": ">= 20x",
                "met": None if thr is None else thr >= 20})
    gw1m = find(rows, "stream c=1 1MiB", "gateway")
    d16, d1m = find(rows, "stream c=1 16KiB", DIRECT), find(rows, "stream c=1 1MiB", DIRECT)
    extra = None
    if gw1m and gw16 and gw1m.added_p50_us is not None and gw16.added_p50_us is not None:
        extra = (gw1m.added_p50_us - gw16.added_p50_us) / 1000  # the gateway's own extra cost, direct's removed
    raw = None
    if gw1m and gw16 and gw1m.ttft_p50_us is not None and gw16.ttft_p50_us is not None:
        raw = (gw1m.ttft_p50_us - gw16.ttft_p50_us) / 1000
    direct_extra = None
    if d16 and d1m and d16.ttft_p50_us is not None and d1m.ttft_p50_us is not None:
        direct_extra = (d1m.ttft_p50_us - d16.ttft_p50_us) / 1000
    out.append({"target": "1 MiB over 16 KiB, gateway TTFT p50 (c=1 stream)",
                "value": f"{fmt(raw, 2)} ms (direct: {fmt(direct_extra, 2)} ms; the gateway's own: {fmt(extra, 2)} ms)",
                "limit": "<= 15 ms", "met": None if raw is None else raw <= 15})
    return out


PROD_LIMIT_RATIO = 1.15
NEWCONN_LIMIT_RATIO = 1.3


def production_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """Issue 27 item 3's figures: per scenario, CPU per request of the production path
    (`gateway+prod`) over the bare one's (`gateway`), limit 1.15x; per gateway target, CPU per
    request of a `newconn` scenario over the same scenario kept alive, limit 1.3x. Only the pairs
    that were measured."""
    def compared(row: Row, base: Row | None, what: str, limit: float) -> dict[str, Any] | None:
        value = ratio(row.cpu_ms_per_req, base.cpu_ms_per_req if base else None)
        if base is None or value is None:
            return None
        return {"target": f"CPU per request, {what}",
                "value": f"{fmt_ratio(value)} ({fmt(row.cpu_ms_per_req, 3)} / {fmt(base.cpu_ms_per_req, 3)} ms)",
                "limit": f"<= {limit}x", "met": value <= limit}

    pairs = [compared(row, find(rows, row.scenario, "gateway"), f"{row.scenario}: gateway+prod / gateway",
                      PROD_LIMIT_RATIO) for row in rows if row.target == "gateway+prod"]
    pairs += [compared(row, find(rows, row.scenario.removesuffix(NEWCONN), row.target),
                       f"{row.target}: {row.scenario} / kept alive", NEWCONN_LIMIT_RATIO)
              for row in rows if row.scenario.endswith(NEWCONN) and row.target.startswith("gateway")]
    return [pair for pair in pairs if pair is not None]


def markdown_report(result: dict[str, Any], rows: list[Row]) -> str:
    m = result["machine"]
    lines = [f"# Overhead {result['started']}", "", f"`{result['command']}`", "",
             f"Machine: {m['nproc']} cores, {m['cpu_model']}, Linux {m['kernel']}, Python {m['python']}; "
             f"load average {m['loadavg_start']} at the start, {m.get('loadavg_end', '?')} at the end.",
             f"Pinning: {result['pinning']}.",
             f"Rounds: {result['rounds_done']} (medians over rounds; added TTFT = target minus direct in the same "
             f"round). Engine: {result['engine']}.", "",
             "| target | what | cores | RSS idle MB | RSS peak MB | RSS at the end MB | notes |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |",
             *(f"| {t['name']} | {t['version']} | {t['cores'] or '-'} | {fmt(t.get('idle_mb'), 1)} | "
               f"{fmt(t.get('peak_sampled_mb'), 1)} | {fmt(t.get('end_mb'), 1)} | {'; '.join(t['notes'])} |"
               for t in result["targets"]), "",
             markdown_table(rows), "",
             "Columns: medians over rounds; TTFT = to the first SSE `data:` bytes (streaming) or the whole answer "
             "(JSON); added = minus direct's in the same round (concurrency 1 only); CPU = the target's process tree "
             "over the window; core-1 busy = load generator + engine CPU in cores (near 1: the client side was the "
             "limit); (L) = too few answers ended inside the window, req/s by Little's law (clients / mean answer "
             "time).", "", "## Issue 5 targets", "", "| target | value | limit | met |",
             "| --- | --- | --- | --- |"]
    for t in result["issue_targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['value']} | {t['limit']} | {met} |")
    if result.get("production_targets"):
        lines += ["", "## Issue 27 item 3: the production path and new connections", "",
                  "| figure | value | limit | met |", "| --- | --- | --- | --- |"]
        for t in result["production_targets"]:
            lines.append(f"| {t['target']} | {t['value']} | {t['limit']} | {'yes' if t['met'] else '**no**'} |")
    scale = result.get("scale")
    if scale:
        lines += ["", f"## Scale: {scale['streams']:,} streams at once, {scale['chunks']} chunks "
                  f"{scale['chunk_delay_ms']:g} ms apart (ideal {scale['ideal_s']:g} s)", "",
                  "| through | ok | errors | duration p50 / p99 / max s | RSS before / peak / after MB "
                  "| RSS per 1,000 streams MB | CPU s |", "| --- | ---: | ---: | --- | --- | ---: | ---: |"]
        for key in ("direct", "gateway"):
            s = scale.get(key)
            if not s:
                continue
            errs = f"{s['errors']} {s['error_kinds']}" if s["errors"] else "0"
            lines.append(f"| {key} | {s['ok']:,} | {errs} | {fmt(s['duration_p50_s'], 2)} / "
                         f"{fmt(s['duration_p99_s'], 2)} / {fmt(s['duration_max_s'], 2)} | "
                         f"{fmt(s['rss_before_mb'], 1)} / {fmt(s['rss_peak_mb'], 1)} / {fmt(s['rss_after_mb'], 1)} | "
                         f"{fmt(s['rss_per_1000_streams_mb'], 1) if key == 'gateway' else '-'} | "
                         f"{fmt(s['cpu_s'], 2)} |")
    prof = result.get("profile")
    if prof and "top_functions" in prof:
        top = ProfileTop(prof["samples"], *([tuple(x) for x in prof[key]] for key in (
            "top_functions", "top_files", "top_packages", "gateway_inclusive")))
        lines += ["", f"## Profile: gateway under {prof['scenario']} ({prof['seconds']:g} s, py-spy "
                  f"{prof['rate_hz']} Hz, {prof['samples']:,} busy samples, "
                  f"{fmt(prof['req_per_s_while_profiled'])} req/s while profiled; `{prof['file']}`)", "",
                  profile_table(top, "function"), "", profile_table(top, "file"), "", profile_table(top, "package"),
                  "", profile_table(top, "gateway function (inclusive)")]
    elif prof:
        lines += ["", f"Profile: {prof.get('skipped')}"]
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


# --- command line ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--peers", action="store_true", help="also vllm-router, sglang-router and LiteLLM (the bench extra)")
    add("--targets", help="comma-separated subset, e.g. gateway,vllm-router (direct always runs)")
    add("--rounds", type=int, default=3, help="repetitions of every scenario on every target")
    add("--quick", action="store_true", help="fewer scenarios, shorter runs, small scale run, no profile")
    add("--scenarios", help="MODE:CONCURRENCY:SIZE[:new],... e.g. stream:1:16KiB,stream:64:16KiB:new (sizes: 200B, "
        "16KiB, 1MiB; new: a new connection per request)")
    add("--chunks", type=int, default=32, help="SSE chunks per answer of the fast engine")
    add("--engine-procs", type=int, default=1, help="fake engine processes (one listening socket)")
    add("--gateway-log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="the gateway's log_level (info, its default, writes one access line a request)")
    add("--scale-streams", type=int, help="slow streams at once through one gateway (default 1000; quick 200)")
    add("--scale-chunks", type=int, default=100, help="chunks per slow stream")
    add("--scale-seconds", type=float, default=5.0, help="a slow stream's length without overhead (quick: 2.5)")
    add("--no-scale", action="store_true")
    add("--no-profile", action="store_true")
    add("--profile-seconds", type=float, default=10.0)
    add("--no-pin", action="store_true", help="do not pin processes to cores")
    add("--flow-control", action="store_true",
        help="the gateway row's pool with flow control on, never saturated: the cost of its bookkeeping")
    add("--max-minutes", type=float, default=12.0, help="stop starting rounds after this")
    add("--json", type=Path, help="write the JSON result here (default loadtest/results/overhead-<ts>.json)")
    add("--results-dir", type=Path, default=RESULTS_DIR)
    return parser


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a gateway dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.chunks < 1 or args.scale_chunks < 1 or args.scale_seconds <= 0:
        raise SystemExit("--rounds, --chunks and --scale-chunks must be >= 1, --scale-seconds > 0")
    scenarios = _scenarios(args.scenarios) if args.scenarios else (QUICK_SCENARIOS if args.quick else FULL_SCENARIOS)
    if any(s.size not in SIZES for s in scenarios):
        raise SystemExit(f"--scenarios: sizes are {', '.join(SIZES)}")
    timing = QUICK_TIMING if args.quick else FULL_TIMING
    streams = args.scale_streams or (200 if args.quick else 1000)
    args.scale_streams = streams
    if args.quick and args.scale_seconds == build_parser().get_default("scale_seconds"):
        args.scale_seconds = 2.5
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    started_at = time.monotonic()
    deadline = started_at + args.max_minutes * 60
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = args.results_dir / f"overhead-{stamp}-logs"
    fd_limit = raise_fd_limit()
    pin = tg.plan_pinning(not args.no_pin)
    if pin.engine:
        os.sched_setaffinity(0, {int(pin.engine)})
    notes: list[str] = []
    result: dict[str, Any] = {
        "started": stamp, "command": shlex.join(["python", "-m", "loadtest.overhead", *argv]),
        "machine": machine(), "versions": versions(), "pinning": pin.describe(), "fd_limit": fd_limit,
        "engine": f"loadtest.stub_upstream, {args.chunks} chunks an answer, no delay, {args.engine_procs} process(es)",
        "scenarios": [s.name for s in scenarios], "timing": asdict(timing), "notes": notes, "logs": str(log_dir),
    }
    print(f"overhead: {len(scenarios)} scenarios x {args.rounds} rounds; {pin.describe()}; logs in {log_dir}",
          flush=True)
    samples: list[Sample] = []
    plan: Plan | None = None
    memory: dict[str, dict[str, float | None]] = {}
    try:
        with ProcessGroup(log_dir) as group:
            engine = tg.start_stub(group, "engine", pin, args.chunks, procs=args.engine_procs)
            engine.name = DIRECT
            plan = start_targets(group, engine, pin, args)
            notes.extend(plan.notes)
            print("targets: " + ", ".join(t.name for t in plan.targets), flush=True)
            idle_rss = {t.name: _tree_rss_mb(t) for t in plan.targets}
            samples, done = _run_async(measure_rounds(plan, engine, scenarios, args.rounds, timing, args.chunks,
                                                      deadline, notes))
            result["rounds_done"] = done
            memory = {t.name: {"idle_mb": idle_rss[t.name], "end_mb": _tree_rss_mb(t),
                               "peak_sampled_mb": max((s.rss_peak_mb for s in samples
                                                       if s.target == t.name and s.rss_peak_mb is not None),
                                                      default=None)} for t in plan.targets}
            for target in plan.targets:
                outcomes = tg.redis_outcomes(target) if target.kind == "gateway" else {}
                if outcomes:
                    result.setdefault("redis_outcomes", {})[target.name] = outcomes
                    if any(k.startswith("redis_errors") or k.endswith("skipped]") for k in outcomes):
                        notes.append(f"{target.name}: Redis calls failed or were skipped (breaker open) during the "
                                     f"rounds, so its CPU per request undercounts them: "
                                     + ", ".join(f"{k} {v:,.0f}" for k, v in outcomes.items()))
            gateway = next((t for t in plan.targets if t.name == "gateway"), None)
            if not args.no_profile and not args.quick and gateway is not None:
                print(f"profiling the gateway under {PROFILE_SCENARIO.name} for {args.profile_seconds:g} s...",
                      flush=True)
                result["profile"] = profile_gateway(gateway, engine, pin, args.profile_seconds, args.chunks,
                                                    args.results_dir / f"overhead-{stamp}-profile.txt")
            if not args.no_scale:
                print(f"scale: {streams} slow streams at once...", flush=True)
                result["scale"] = _run_async(measure_scale(group, pin, args, args.gateway_log_level))
    except KeyboardInterrupt:
        notes.append("interrupted: partial results")
        print("interrupted: writing what was measured", file=sys.stderr)
    except ProcessError as exc:
        notes.append(f"a process failed: {str(exc).splitlines()[0][:200]}")
        print(f"error: {exc}", file=sys.stderr)
    finally:
        for target in plan.targets if plan else []:
            for prefix in target.cleanup.get("redis_prefixes", []):
                tg.delete_redis_prefix(prefix)
    result.setdefault("rounds_done", 0)
    result["machine"]["loadavg_end"] = _loadavg()
    result["minutes"] = round((time.monotonic() - started_at) / 60, 1)
    result["targets"] = [{"name": t.name, "kind": t.kind, "version": t.version, "cores": t.cores, "notes": t.notes,
                          **memory.get(t.name, {})} for t in (plan.targets if plan else [])]
    rows = aggregate(samples)
    result["issue_targets"] = issue_targets(rows)
    result["production_targets"] = production_targets(rows)
    result["rows"] = [asdict(r) for r in rows]
    result["samples"] = [asdict(s) for s in samples]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.json or args.results_dir / f"overhead-{stamp}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    text = markdown_report(result, rows)
    md_path = args.results_dir / f"overhead-{stamp}.md"
    md_path.write_text(text, encoding="utf-8")
    print()
    print(text)
    print(f"written: {md_path} and {json_path} ({result['minutes']} min)")
    return 0 if rows and not any(r.errors for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
