"""The load of the overhead benchmark: request bodies, the three kinds of runs, CPU and memory meters.

- `run_latency`: one connection, requests one after another (concurrency 1): time to the first
  SSE `data:` bytes (streaming) or to the whole answer (non-streaming) of each.
- `run_throughput`: `concurrency` connections each sending back to back for a warm-up, then a
  measured window (`Window`); what completes inside the window counts. After the window nobody
  sends; what is still running gets `drain_s` to finish, then its connection is closed.
- `run_streams`: N slow streams opened at once (the scale figure), each one connection.

Meters read the target's process tree from /proc (`loadtest.proctree`): CPU seconds at the
window's start and end, resident memory sampled every `RSS_SAMPLE_S`. Every request carries a
unique 12-digit number at the start of its prompt, so no two prompts share a prefix (the gateway's
affinity store sees only new blocks: its worst case, not its best).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import orjson

from loadtest import proctree
from loadtest.overhead_stats import closed_loop_rps
from loadtest.procs import process_cpu_seconds
from loadtest.rawhttp import Connection, Reply, request_head

HOST = "127.0.0.1"
RSS_SAMPLE_S = 0.25
SETTLE_IDLE_FRACTION = 0.05
"""A target counts as settled when it used under 5 % of a core over the last `SETTLE_STEP_S`."""
SETTLE_STEP_S = 0.2
WORDS = (b"alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         b"quebec romeo sierra tango uniform victor whiskey xray yankee zulu ")
UNIQUE_DIGITS = 12


def prompt_text(size: int) -> bytes:
    """`size` bytes of ASCII words (JSON-safe, no escapes), the same every time."""
    reps = size // len(WORDS) + 1
    return (WORDS * reps)[:size]


class RequestMaker:
    """The bytes of chat requests to one target: `size` bytes of user message (a unique number,
    a space, then words), `max_tokens` = `chunks`; streaming ones ask `include_usage`."""

    def __init__(self, port: int, size: int, stream: bool, chunks: int, bearer: str,
                 counter: itertools.count[int]) -> None:
        self.stream = stream
        self.size = size
        tail: dict[str, object] = {"max_tokens": chunks, "stream": stream}
        if stream:
            tail["stream_options"] = {"include_usage": True}
        self.pre = b'{"model":"kimi-k3","messages":[{"role":"user","content":"'
        self.post = b" " + prompt_text(max(0, size - UNIQUE_DIGITS - 1)) + b'"}],' + orjson.dumps(tail)[1:]
        length = len(self.pre) + UNIQUE_DIGITS + len(self.post)
        self.head = request_head(HOST, port, "/v1/chat/completions", length, bearer)
        self.counter = counter

    def parts(self) -> list[bytes]:
        return [self.head, self.pre, b"%012d" % (next(self.counter) % 10**UNIQUE_DIGITS), self.post]


@dataclass
class Snapshot:
    """CPU seconds used so far: the target's process tree, this process, the engine; at `t` (s)."""

    t: float
    target_cpu: float | None
    loadgen_cpu: float | None
    engine_cpu: float | None


class Meter:
    """CPU and memory of the target's process tree (`root` None: no router, nothing to measure)."""

    def __init__(self, root: int | None, engine: int | None) -> None:
        self.pids = proctree.descendants(root) if root is not None else []
        self.engine_pids = proctree.descendants(engine) if engine is not None else []
        self.rss_peak_kb: int | None = None
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> Snapshot:
        return Snapshot(time.perf_counter(), proctree.cpu_seconds(self.pids) if self.pids else None,
                        process_cpu_seconds(os.getpid()),
                        proctree.cpu_seconds(self.engine_pids) if self.engine_pids else None)

    def rss_kb(self) -> int | None:
        return proctree.rss_kb(self.pids) if self.pids else None

    def _sample(self) -> None:
        rss = self.rss_kb()
        if rss is not None and (self.rss_peak_kb is None or rss > self.rss_peak_kb):
            self.rss_peak_kb = rss

    async def _sampler(self, every: float) -> None:
        while True:
            self._sample()
            await asyncio.sleep(every)

    def start(self, every: float = RSS_SAMPLE_S) -> None:
        if self.pids:
            self._task = asyncio.get_running_loop().create_task(self._sampler(every))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._sample()

    async def settle(self, max_s: float) -> float:
        """Wait until the target is idle (or `max_s` passed); returns the seconds waited."""
        if not self.pids:
            return 0.0
        start = time.perf_counter()
        before = proctree.cpu_seconds(self.pids) or 0.0
        while time.perf_counter() - start < max_s:
            await asyncio.sleep(SETTLE_STEP_S)
            now = proctree.cpu_seconds(self.pids) or 0.0
            if now - before < SETTLE_IDLE_FRACTION * SETTLE_STEP_S:
                break
            before = now
        return time.perf_counter() - start


@dataclass
class RunFigures:
    """What one run measured. Times in µs; CPU in seconds over the measured part; RSS in kB."""

    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    events: int = 0
    seconds: float = 0.0
    first_us: list[float] = field(default_factory=list)
    total_us: list[float] = field(default_factory=list)
    target_cpu_s: float | None = None
    loadgen_cpu_s: float | None = None
    engine_cpu_s: float | None = None
    rss_peak_kb: int | None = None
    late: int = 0
    cut: int = 0
    little_rps: float | None = None
    """req/s by Little's law from every answer (see `run_throughput`), when the window had too few."""


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0][:60]


def _apply_cpu(fig: RunFigures, a: Snapshot, b: Snapshot) -> None:
    fig.seconds = b.t - a.t
    if a.target_cpu is not None and b.target_cpu is not None:
        fig.target_cpu_s = b.target_cpu - a.target_cpu
    if a.loadgen_cpu is not None and b.loadgen_cpu is not None:
        fig.loadgen_cpu_s = b.loadgen_cpu - a.loadgen_cpu
    if a.engine_cpu is not None and b.engine_cpu is not None:
        fig.engine_cpu_s = b.engine_cpu - a.engine_cpu


def _count(fig: RunFigures, reply: Reply, kinds: Counter[str]) -> bool:
    """Add an error to the figures; True when `reply` was a success."""
    if reply.error is None:
        return True
    fig.errors += 1
    kinds[_error_kind(reply.error)] += 1
    return False


def _add_ok(fig: RunFigures, reply: Reply) -> None:
    fig.ok += 1
    fig.events += reply.events
    fig.first_us.append((reply.first_ns or 0) / 1000)
    fig.total_us.append((reply.total_ns or 0) / 1000)


async def run_latency(port: int, maker: RequestMaker, meter: Meter, count: int, max_s: float, warmup: int,
                      timeout: float, fresh: bool = False) -> RunFigures:
    """`count` requests one after another on one connection (after `warmup` unmeasured ones), or
    as many as fit in `max_s` seconds; `fresh`: each on a new connection, closed after its answer
    (its TTFT counts from the send, after the connect)."""
    conn = Connection(HOST, port)
    fig, kinds = RunFigures(), Counter[str]()
    try:
        for _ in range(warmup):
            await conn.request(maker.parts(), maker.stream, timeout)
            if fresh:
                conn.close()
        meter.start()
        a = meter.snapshot()
        deadline = a.t + max_s
        for _ in range(count):
            reply = await conn.request(maker.parts(), maker.stream, timeout)
            if fresh:
                conn.close()
            if _count(fig, reply, kinds):
                _add_ok(fig, reply)
            if time.perf_counter() > deadline:
                break
        b = meter.snapshot()
        await meter.stop()
    finally:
        conn.close()
    _apply_cpu(fig, a, b)
    fig.rss_peak_kb, fig.error_kinds = meter.rss_peak_kb, dict(kinds)
    return fig


@dataclass(frozen=True)
class Window:
    """Bounds of a throughput run, seconds and requests. The warm-up lasts `warmup_s` and until
    `concurrency` requests have completed (one turnover: a slow target that serves all its clients
    at once finishes its first wave late), at most `warmup_max_s`; the window lasts `window_s` and
    until `min_window_requests` completed in it, at most `window_max_s`. Then `drain_s` for what
    is still running, after which its connections are closed."""

    warmup_s: float
    window_s: float
    drain_s: float
    warmup_max_s: float = 15.0
    window_max_s: float = 10.0
    min_window_requests: int = 100
    min_counted: int = 20
    """Fewer answers inside the window: figures from every answer since the start instead, req/s
    by Little's law (`closed_loop_rps`)."""


class _Phase:
    WARMUP, WINDOW, OVER = range(3)


async def run_throughput(port: int, maker: RequestMaker, meter: Meter, concurrency: int, bounds: Window,
                         timeout: float, fresh: bool = False) -> RunFigures:
    """`concurrency` clients back to back; figures of the requests that end inside the window.
    `fresh`: each request on a new connection, which the client closes after the answer."""
    fig, kinds = RunFigures(), Counter[str]()
    conns = [Connection(HOST, port) for _ in range(concurrency)]
    loop = asyncio.get_running_loop()
    phase, completed, goal = _Phase.WARMUP, 0, concurrency
    reached = asyncio.Event()  # set once `completed` reaches `goal`
    snaps: list[Snapshot] = []
    every = RunFigures()  # every success before the end of the window, for the fallback

    async def client(conn: Connection) -> None:
        nonlocal completed
        while phase != _Phase.OVER:
            reply = await conn.request(maker.parts(), maker.stream, timeout)
            if fresh:
                conn.close()
            if not _count(fig, reply, kinds):
                continue
            completed += 1
            if completed >= goal:
                reached.set()
            if phase != _Phase.OVER:
                _add_ok(every, reply)
            if phase == _Phase.WINDOW:
                _add_ok(fig, reply)
            elif phase == _Phase.OVER:
                fig.late += 1

    async def clock() -> None:
        nonlocal phase, goal
        snaps.append(meter.snapshot())
        await asyncio.sleep(bounds.warmup_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reached.wait(), max(0.0, bounds.warmup_max_s - bounds.warmup_s))
        snaps.append(meter.snapshot())
        reached.clear()
        phase, goal = _Phase.WINDOW, completed + bounds.min_window_requests
        await asyncio.sleep(bounds.window_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reached.wait(), max(0.0, bounds.window_max_s - bounds.window_s))
        phase = _Phase.OVER
        snaps.append(meter.snapshot())

    meter.start()
    tasks = [loop.create_task(client(c)) for c in conns]
    clock_task = loop.create_task(clock())
    try:
        await clock_task
        _, pending = await asyncio.wait(tasks, timeout=bounds.drain_s)
        fig.cut = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in [*tasks, clock_task]:
            task.cancel()
        for conn in conns:
            conn.close()
        await meter.stop()
    if len(snaps) == 3:
        if fig.ok >= bounds.min_counted:
            _apply_cpu(fig, snaps[1], snaps[2])
        else:
            fig.ok, fig.events, fig.first_us, fig.total_us = every.ok, every.events, every.first_us, every.total_us
            fig.little_rps = closed_loop_rps(concurrency, [t / 1e6 for t in every.total_us])
            _apply_cpu(fig, snaps[0], snaps[2])
    fig.rss_peak_kb, fig.error_kinds = meter.rss_peak_kb, dict(kinds)
    return fig


@dataclass
class StreamsFigures:
    """The scale run: N slow streams at once. Times in seconds, memory in kB."""

    streams: int
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    duration_s: list[float] = field(default_factory=list)
    rss_before_kb: int | None = None
    rss_peak_kb: int | None = None
    rss_after_kb: int | None = None
    target_cpu_s: float | None = None
    wall_s: float = 0.0


async def run_streams(port: int, maker: RequestMaker, meter: Meter, streams: int, timeout: float,
                      connect_batch: int = 100) -> StreamsFigures:
    """Open `streams` connections, then start one slow stream on each at once; wait for all."""
    fig, kinds = StreamsFigures(streams), Counter[str]()
    conns = [Connection(HOST, port) for _ in range(streams)]
    for i in range(0, streams, connect_batch):  # connect in batches: no SYN flood on the listen backlog
        await asyncio.gather(*(c.open() for c in conns[i:i + connect_batch]), return_exceptions=True)
    fig.rss_before_kb = meter.rss_kb()
    meter.start(every=0.1)
    a = meter.snapshot()
    try:
        replies = await asyncio.gather(*(c.request(maker.parts(), True, timeout) for c in conns))
    finally:
        for conn in conns:
            conn.close()
        b = meter.snapshot()
        await meter.stop()
    for reply in replies:
        if reply.error is None:
            fig.ok += 1
            fig.duration_s.append((reply.total_ns or 0) / 1e9)
        else:
            fig.errors += 1
            kinds[_error_kind(reply.error)] += 1
    fig.error_kinds = dict(kinds)
    fig.rss_peak_kb = meter.rss_peak_kb
    fig.wall_s = b.t - a.t
    if a.target_cpu is not None and b.target_cpu is not None:
        fig.target_cpu_s = b.target_cpu - a.target_cpu
    await asyncio.sleep(1.0)
    fig.rss_after_kb = meter.rss_kb()
    return fig
