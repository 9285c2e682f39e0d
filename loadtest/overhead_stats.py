"""Pure figures of the overhead benchmark: medians over rounds, added TTFT, ratios, tables, profiles.

A `Sample` is one target measured on one scenario in one round. `aggregate` turns the samples of
all rounds into one `Row` per (scenario, target): medians of the rounds' figures, and the added
TTFT over "direct" computed within each round first (the same round's direct figure), then the
median of those differences, so that a noisy round moves both sides together.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from loadtest.report import percentile

DIRECT = "direct"
MIN_BUSY_WINDOW_S = 0.5
"""Shorter windows give no busy fraction: /proc counts CPU in 10 ms ticks."""


@dataclass
class Sample:
    """One target, one scenario, one round. Times in µs, CPU in ms, RSS in MB; None = not measured."""

    scenario: str
    target: str
    round: int
    ok: int
    errors: int
    seconds: float
    events: int
    ttft_p50_us: float | None
    ttft_p99_us: float | None
    total_p50_us: float | None
    cpu_ms_per_req: float | None
    rss_peak_mb: float | None
    loadgen_busy: float | None = None
    engine_busy: float | None = None
    error_kinds: dict[str, int] = field(default_factory=dict)
    concurrency: int = 1
    little_rps: float | None = None
    """Set when too few requests ended inside the window: req/s by Little's law instead."""

    @property
    def rps(self) -> float | None:
        if self.little_rps is not None:
            return self.little_rps
        return self.ok / self.seconds if self.seconds > 0 else None

    @property
    def chunks_per_s(self) -> float | None:
        rps = self.rps
        return rps * self.events / self.ok if rps is not None and self.ok else None


def closed_loop_rps(concurrency: int, latencies_s: list[float]) -> float | None:
    """Throughput of `concurrency` clients that each send again as soon as an answer ends (no think
    time), from the mean answer time: Little's law, X = N / R. It needs no window of steady state,
    which a server that answers all its clients at once (a first wave ending late, then the next)
    does not give in a short run. None without latencies."""
    if not latencies_s or concurrency < 1:
        return None
    mean = sum(latencies_s) / len(latencies_s)
    return concurrency / mean if mean > 0 else None


def sample_from(scenario: str, target: str, rnd: int, ok: int, errors: int, seconds: float, events: int,
                first_us: list[float], total_us: list[float], cpu_s: float | None, rss_kb: int | None,
                loadgen_cpu_s: float | None = None, engine_cpu_s: float | None = None,
                error_kinds: dict[str, int] | None = None, concurrency: int = 1,
                little_rps: float | None = None) -> Sample:
    """A Sample from raw run figures (per-request µs lists, CPU seconds, RSS kB)."""
    return Sample(
        scenario, target, rnd, ok, errors, seconds, events,
        percentile(first_us, 50), percentile(first_us, 99), percentile(total_us, 50),
        cpu_s * 1000 / ok if cpu_s is not None and ok else None,
        rss_kb / 1024 if rss_kb is not None else None,
        loadgen_cpu_s / seconds if loadgen_cpu_s is not None and seconds >= MIN_BUSY_WINDOW_S else None,
        engine_cpu_s / seconds if engine_cpu_s is not None and seconds >= MIN_BUSY_WINDOW_S else None,
        dict(error_kinds or {}), concurrency, little_rps)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    """Medians over rounds of one (scenario, target). `added_*`: TTFT minus direct's, same round,
    at concurrency 1 only (under load, TTFT is mostly queueing at the client's own concurrency).
    `rss_peak_mb`: the highest sample while this scenario ran (memory grows over a run: it also
    reflects the scenarios before)."""

    scenario: str
    target: str
    rounds: int
    rps: float | None
    chunks_per_s: float | None
    ttft_p50_us: float | None
    ttft_p99_us: float | None
    added_p50_us: float | None
    added_p99_us: float | None
    total_p50_us: float | None
    cpu_ms_per_req: float | None
    rss_peak_mb: float | None
    errors: int
    requests: int
    loadgen_busy: float | None
    engine_busy: float | None
    error_kinds: dict[str, int]
    little_rounds: int = 0
    """Rounds whose req/s came from Little's law (`closed_loop_rps`), not from a window's count."""


def aggregate(samples: list[Sample]) -> list[Row]:
    """One Row per (scenario, target), in the order the pairs first appear in `samples`."""
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    direct: dict[tuple[str, int], Sample] = {}
    for s in samples:
        groups[(s.scenario, s.target)].append(s)
        if s.target == DIRECT:
            direct[(s.scenario, s.round)] = s
    rows = []
    for (scenario, target), group in groups.items():
        added50, added99 = [], []
        for s in group:
            base = direct.get((scenario, s.round))
            if base is not None and target != DIRECT and s.concurrency == 1:
                if s.ttft_p50_us is not None and base.ttft_p50_us is not None:
                    added50.append(s.ttft_p50_us - base.ttft_p50_us)
                if s.ttft_p99_us is not None and base.ttft_p99_us is not None:
                    added99.append(s.ttft_p99_us - base.ttft_p99_us)
        kinds: Counter[str] = Counter()
        for s in group:
            kinds.update(s.error_kinds)
        rss = [s.rss_peak_mb for s in group if s.rss_peak_mb is not None]
        rows.append(Row(
            scenario, target, len(group), median(s.rps for s in group), median(s.chunks_per_s for s in group),
            median(s.ttft_p50_us for s in group), median(s.ttft_p99_us for s in group),
            median(added50), median(added99), median(s.total_p50_us for s in group),
            median(s.cpu_ms_per_req for s in group), max(rss) if rss else None,
            sum(s.errors for s in group), sum(s.ok + s.errors for s in group),
            median(s.loadgen_busy for s in group), median(s.engine_busy for s in group), dict(kinds),
            sum(1 for s in group if s.little_rps is not None)))
    return rows


def find(rows: list[Row], scenario: str, target: str) -> Row | None:
    for row in rows:
        if row.scenario == scenario and row.target == target:
            return row
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    """A figure for a table: thousands separators, `digits` decimals; "-" for None."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def fmt_ratio(value: float | None) -> str:
    """A ratio as `1.23x` (2 significant decimals below 10, 1 below 100, none above); "-" for None."""
    if value is None:
        return "-"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{digits}f}x"


TABLE_HEAD = ("| scenario | target | req/s | chunks/s | TTFT p50 µs | TTFT p99 µs | added p50 µs | added p99 µs "
              "| CPU ms/req | errors | core-1 busy |")
TABLE_RULE = "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"


def markdown_table(rows: list[Row]) -> str:
    """The comparison table: one line per (scenario, target), scenarios in their order.

    "core-1 busy" is the load generator's plus the fake engine's CPU over the window, in cores:
    near 1.0 the client side, not the router, was the limit. "(L)" marks req/s from Little's law.
    """
    lines = [TABLE_HEAD, TABLE_RULE]
    for r in rows:
        busy = None if r.loadgen_busy is None else r.loadgen_busy + (r.engine_busy or 0.0)
        errors = f"{r.errors} of {r.requests:,}" if r.errors else "0"
        lines.append(
            f"| {r.scenario} | {r.target} | {fmt(r.rps)}{' (L)' if r.little_rounds else ''} | "
            f"{fmt(r.chunks_per_s)} | {fmt(r.ttft_p50_us)} | "
            f"{fmt(r.ttft_p99_us)} | {fmt(r.added_p50_us)} | {fmt(r.added_p99_us)} | {fmt(r.cpu_ms_per_req, 3)} | "
            f"{errors} | {fmt(busy, 2)} |")
    return "\n".join(lines)


# --- py-spy profiles ---------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def _short_file(path: str) -> str:
    """A path shortened to what identifies it: from `site-packages/` or the repository's package on."""
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker.startswith("/lib") and "/" in tail else tail
    for marker in ("/gateway/", "/loadtest/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


NO_FRAME = "(no Python frame)"


def _package(short_file: str) -> str:
    """`httpcore/_async/http11.py` -> `httpcore`; a top-level standard module -> `stdlib`."""
    return short_file.split("/", 1)[0] if "/" in short_file else "stdlib" if short_file != NO_FRAME else NO_FRAME


@dataclass
class ProfileTop:
    """Samples from py-spy's collapsed stacks. Self time: the innermost frame of each stack, per
    function, file and package. `gateway_inclusive`: stacks that pass through each function of the
    gateway's own code (`gateway/...`, less the entry point `gateway/cli.py`), counted once per stack."""

    total: int
    functions: list[tuple[str, int]]
    files: list[tuple[str, int]]
    packages: list[tuple[str, int]] = field(default_factory=list)
    gateway_inclusive: list[tuple[str, int]] = field(default_factory=list)


def _frame_name(frame: str) -> tuple[str, str]:
    """(`function (short file)`, short file) of one collapsed-stack frame."""
    match = _FRAME.match(frame)
    if match is None:
        return NO_FRAME, NO_FRAME  # py-spy's process/thread label: no Python code was running
    short = _short_file(match.group("file"))
    return f"{match.group('func')} ({short})", short


def top_self(collapsed_lines: Iterable[str], n: int = 15) -> ProfileTop:
    """Parse `frame;frame;...;leaf COUNT` lines (py-spy `--format raw`) and rank by samples.

    A frame is `function (file:line)` or `function (file)`; the first frame is py-spy's process or
    thread label, which is the leaf only when no Python frame was on the stack. Lines that do not
    end in a count are skipped.
    """
    funcs: Counter[str] = Counter()
    files: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        name, short = _frame_name(frames[-1])
        funcs[name] += samples
        files[short] += samples
        packages[_package(short)] += samples
        seen = set()
        for frame in frames:
            fname, fshort = _frame_name(frame)
            if fshort.startswith("gateway/") and fshort != "gateway/cli.py" and fname not in seen:
                seen.add(fname)
                inclusive[fname] += samples
    return ProfileTop(total, funcs.most_common(n), files.most_common(n), packages.most_common(n),
                      inclusive.most_common(n))


def profile_table(top: ProfileTop, what: str = "function") -> str:
    """A markdown table of a ProfileTop's ranking `what` (function, file, package, or gateway
    function (inclusive)), with each one's share of all samples."""
    items = {"function": top.functions, "file": top.files, "package": top.packages}.get(what, top.gateway_inclusive)
    label = f"{what} (self)" if what in ("function", "file", "package") else what
    lines = [f"| {label} | samples | share |", "| --- | ---: | ---: |"]
    for name, samples in items:
        share = samples / top.total if top.total else 0.0
        lines.append(f"| `{name}` | {samples:,} | {share:.1%} |")
    return "\n".join(lines)
