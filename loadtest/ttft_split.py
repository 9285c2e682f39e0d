"""Where the time to first token goes: each request's TTFT split into the router's time and the
engine's, from the client's results joined with the simulated workers' timings (issue 27 item 1).

The join. The load generator sends every request with its id as `x-request-id` and as the body's
`x_request_tag` (`loadtest.loadgen`); each worker keeps a compact timing of the last requests it
served (`GET /sim/timings`, `gateway.sim.timings`). A worker's timing matches a client request when
its `tag` or its `request_id` equals the client's id: SGLang's router forwards the header and drops
unknown body fields, the gateway sends its own `x-request-id` and relays the field. A request
retried by the router leaves one timing per attempt: the one that answered (a first byte, then the
latest received) is taken. Times are one clock: the client's `time.monotonic()` and the workers'
are CLOCK_MONOTONIC on the same Linux host.

Per request (seconds), with `sent` the client's send, `recv` the worker's end of reading the body,
`adm` its first admission, `fb` its first answer byte and `first` the client's first content token:

    router_in = recv - sent      client write + router: body read, parse, routing, connect, forward
    queue     = adm - recv       engine: wait for admission (includes the simulator's fixed `--ttft`,
                                 the API server's share, before the request reaches the scheduler)
    prefill   = fb - adm         engine: prefill in the shared chunked budget, first token, the
                                 handler's wake-up
    relay     = first - fb       router: first byte back to the client (+ the client's read)
    ttft      = first - sent     = router_in + queue + prefill + relay exactly

`router = router_in + relay` is the router's own latency, `engine = queue + prefill` what its
choice of worker (that worker's queue, the prompt's uncached tokens there) cost.

Time per output token, both ends (requests of 2+ output tokens): `tpot` is the client's (first to
last content token / (tokens - 1), `RequestResult.tpot_s`), `engine_tpot` the worker's (first
answer byte to its end of the answer / (tokens - 1)); what the client's exceeds the worker's is
the relay's jitter on the stream's first and last events, the rest is the worker's decode steps
(its batch, the prefill chunks other requests put between them).

The p50 gap between two layouts a and b splits into two parts that add up exactly:

    gap     = P50(ttft_a) - P50(ttft_b)
    choices = P50(engine_a) - P50(engine_b)                       the routing decisions
    router  = [P50(ttft_a) - P50(engine_a)] - [P50(ttft_b) - P50(engine_b)]   its own latency

(the router part is how much more each router adds on top of its engine times at the median).
Means split further and exactly, component by component. Both are reported; neither says whether
a router's slowness also made its choices worse (a stale load view), which shows in `choices`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from loadtest.loadgen import RequestResult

COMPONENTS = ("ttft_s", "router_in_s", "queue_s", "prefill_s", "relay_s", "router_s", "engine_s", "tpot_s",
              "engine_tpot_s")
"""The per-request times summarised (seconds)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) with linear interpolation; None for no values (also the
    replay report's, `loadtest/report.py`)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class RequestSplit:
    """One request's TTFT split (seconds; see the module docstring) and its tokens at the worker
    that answered (`worker`: its index in the run's worker list). `queue_s` / `prefill_s` are None
    when the worker did not record the admission (then only `engine_s` is known); `tpot_s` /
    `engine_tpot_s` (seconds per output token at the client / at the worker) for fewer than 2
    output tokens or no end time."""

    index: int
    worker: int
    ttft_s: float
    router_in_s: float
    queue_s: float | None
    prefill_s: float | None
    relay_s: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    tpot_s: float | None = None
    engine_tpot_s: float | None = None

    @property
    def engine_s(self) -> float:
        """Worker: from the body read to the first answer byte (queue + prefill)."""
        return self.ttft_s - self.router_in_s - self.relay_s

    @property
    def router_s(self) -> float:
        """The router's own time: router_in + relay."""
        return self.router_in_s + self.relay_s

    def value(self, name: str) -> float | None:
        """The component `name` (one of `COMPONENTS`)."""
        return getattr(self, name)  # type: ignore[no-any-return]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "engine_s": self.engine_s, "router_s": self.router_s}


@dataclass
class JoinResult:
    """The joined requests and what could not be joined: `unmatched` completed client requests
    with no worker timing, `no_first_byte` matched ones whose timing had no first byte or
    admission times out of order (left out)."""

    splits: list[RequestSplit]
    unmatched: int = 0
    no_first_byte: int = 0


def _better(candidate: tuple[int, dict[str, Any]], current: tuple[int, dict[str, Any]] | None) -> bool:
    """Prefer the attempt that answered (a first byte), then the latest received."""
    if current is None:
        return True
    new, old = candidate[1], current[1]
    new_key = (new.get("first_byte_at") is not None, new.get("received_at") or 0.0)
    old_key = (old.get("first_byte_at") is not None, old.get("received_at") or 0.0)
    return new_key > old_key


def index_timings(timings_by_worker: Sequence[Iterable[dict[str, Any]]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """Client request id -> (worker index, the timing that answered it), from every worker's
    `GET /sim/timings` entries (keyed by their `tag` and by their `request_id`)."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for worker, timings in enumerate(timings_by_worker):
        for timing in timings:
            for key in {timing.get("tag"), timing.get("request_id")}:
                if isinstance(key, str) and _better((worker, timing), out.get(key)):
                    out[key] = (worker, timing)
    return out


def join(results: Iterable[RequestResult], timings_by_worker: Sequence[Iterable[dict[str, Any]]]) -> JoinResult:
    """Split every completed client request with a first token (`ok`, `ttft_s`, `sent_at` and
    `request_id` set) by its worker's timing (see the module docstring)."""
    index = index_timings(timings_by_worker)
    out = JoinResult([])
    for result in results:
        if not result.ok or result.ttft_s is None or result.sent_at is None or result.request_id is None:
            continue
        found = index.get(result.request_id)
        if found is None:
            out.unmatched += 1
            continue
        worker, timing = found
        received, first_byte = timing.get("received_at"), timing.get("first_byte_at")
        if received is None or first_byte is None or first_byte < received:
            out.no_first_byte += 1
            continue
        admitted = timing.get("admitted_at")
        if admitted is not None and not received <= admitted <= first_byte:
            admitted = None
        first_token = result.sent_at + result.ttft_s
        tokens, finished = result.completion_tokens or 0, timing.get("finished_at")
        engine_tpot = (finished - first_byte) / (tokens - 1) if tokens >= 2 and finished is not None \
            and finished >= first_byte else None
        out.splits.append(RequestSplit(
            index=result.index, worker=worker, ttft_s=result.ttft_s, router_in_s=received - result.sent_at,
            queue_s=None if admitted is None else admitted - received,
            prefill_s=None if admitted is None else first_byte - admitted, relay_s=first_token - first_byte,
            prompt_tokens=int(timing.get("prompt_tokens") or 0), cached_tokens=int(timing.get("cached_tokens") or 0),
            prefill_tokens=int(timing.get("prefill_tokens") or 0), tpot_s=result.tpot_s,
            engine_tpot_s=engine_tpot))
    return out


def _values(splits: Sequence[RequestSplit], name: str) -> list[float]:
    return [v for s in splits if (v := s.value(name)) is not None]


def summarize(joined: JoinResult, completed: int) -> dict[str, Any]:
    """One run's split: per component p50 / p99 / mean (seconds), per request the mean computed
    (`prefill_tokens`) and cached tokens and the cached share; `joined` of `completed` client
    requests."""
    splits = joined.splits
    out: dict[str, Any] = {"joined": len(splits), "completed": completed, "unmatched": joined.unmatched,
                           "no_first_byte": joined.no_first_byte}
    for name in COMPONENTS:
        values = _values(splits, name)
        out[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                     "mean": sum(values) / len(values) if values else None}
    if splits:
        prompt = sum(s.prompt_tokens for s in splits)
        out["prefill_tokens_mean"] = sum(s.prefill_tokens for s in splits) / len(splits)
        out["prefill_tokens_p50"] = percentile([float(s.prefill_tokens) for s in splits], 50)
        out["cached_tokens_mean"] = sum(s.cached_tokens for s in splits) / len(splits)
        out["cached_share"] = sum(s.cached_tokens for s in splits) / prompt if prompt else None
    return out


@dataclass(frozen=True)
class GapSplit:
    """The TTFT gap between layouts a and b at one percentile, split as in the module docstring:
    `gap_s` = `choices_s` + `router_s`. `components` are the differences of each component's
    percentile (a - b; not additive); `mean_components` the differences of the means (additive:
    they sum to `mean_gap_s`)."""

    q: float
    gap_s: float
    choices_s: float
    router_s: float
    components: dict[str, float]
    mean_gap_s: float
    mean_components: dict[str, float]
    prefill_tokens_mean_delta: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gap_split(a: Sequence[RequestSplit], b: Sequence[RequestSplit], q: float = 50.0) -> GapSplit | None:
    """Split the `q`-th percentile TTFT gap of `a` over `b` (positive: `a` is slower) into the
    routers' choices and their own latency; None when either side is empty."""
    if not a or not b:
        return None

    def p(splits: Sequence[RequestSplit], name: str) -> float:
        value = percentile(_values(splits, name), q)
        return 0.0 if value is None else value

    def mean(splits: Sequence[RequestSplit], name: str) -> float:
        values = _values(splits, name)
        return sum(values) / len(values) if values else 0.0

    gap = p(a, "ttft_s") - p(b, "ttft_s")
    choices = p(a, "engine_s") - p(b, "engine_s")
    components = {name: p(a, name) - p(b, name) for name in COMPONENTS if name != "ttft_s"}
    additive = ("router_in_s", "engine_s", "relay_s")  # queue/prefill may be missing on some requests
    mean_components = {name: mean(a, name) - mean(b, name) for name in additive}
    tokens = (sum(s.prefill_tokens for s in a) / len(a)) - (sum(s.prefill_tokens for s in b) / len(b))
    return GapSplit(q, gap, choices, gap - choices, components, mean(a, "ttft_s") - mean(b, "ttft_s"),
                    mean_components, tokens)


# --- the report section -----------------------------------------------------------------------------


class SplitRun(Protocol):
    """What the section reads of a run (`loadtest.report.RunResult`)."""

    name: str
    kind: str
    status: str
    level: str
    repeat: int
    split: dict[str, Any]
    request_splits: list[RequestSplit]
    cpu_seconds: dict[str, float]
    machine_busy: float | None
    send_lag_p99_s: float | None
    ok: int


ROUTER_PROCESSES = ("gateway", "router")
"""`RunResult.cpu_seconds` keys of the router process (the gateway's, a peer router's)."""

SPLIT_KINDS = ("gateway", "peer")
"""Layouts whose workers answer the client directly (a PD layout's first byte comes from a decode
worker outside its `worker_urls`): the only ones split."""


BUSY_FLAG = 0.9
"""Machine busy share above which a run is marked saturated (`loadtest.report.BUSY_WARNING`)."""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _ms1(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _pair(summary: dict[str, Any], name: str) -> str:
    cell = summary.get(name) or {}
    return f"{_ms(cell.get('p50'))} / {_ms(cell.get('p99'))}"


def _signed_ms(value: float) -> str:
    return f"{round(value * 1000):+d}"  # an int: no "-0" for a float's rounding noise


SPLIT_HEADER = ("| load | layout | run | joined | TTFT | router in | queue | prefill | relay | router | engine "
                "| TPOT client / engine p99 | computed tokens/req | cached share | router CPU ms/req | machine busy "
                "| p99 send lag (s) |\n"
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                "| ---: | ---: | ---: |")


def router_cpu_ms(run: SplitRun) -> float | None:
    """CPU milliseconds the router process (gateway or peer router) spent per completed request."""
    seconds = sum(v for k, v in (run.cpu_seconds or {}).items() if k in ROUTER_PROCESSES)
    return seconds * 1000.0 / run.ok if seconds and run.ok else None
GAP_HEADER = ("| load | run | layout vs peer | p50 gap | choices (engine) | router | p99 gap | choices | router "
              "| mean gap | Δ router in | Δ engine | Δ relay | Δ computed tokens/req |\n"
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def split_section(runs: Sequence[SplitRun]) -> tuple[str, dict[str, Any]]:
    """The "Where the TTFT goes" section: a markdown text (per run: p50 / p99 of each component,
    ms; then every gateway run's gap to every peer run of the same level and repetition) and the
    same as JSON (`{"runs": [...], "gaps": [...]}`)."""
    split_runs = [r for r in runs if r.kind in SPLIT_KINDS and r.status == "ok" and r.split]
    lines = ["Where the TTFT goes (ms, p50 / p99 per request; router in = worker received - client sent, "
             "queue = admitted - received, prefill = first byte - admitted, relay = client first token - worker "
             "first byte; router = in + relay, engine = queue + prefill; TPOT p99 at the client and at the worker, "
             "ms with one decimal; `loadtest/ttft_split.py`):", "",
             SPLIT_HEADER]
    rows = []
    for run in split_runs:
        s = run.split
        share, tokens = s.get("cached_share"), s.get("prefill_tokens_mean")
        cells = " | ".join(_pair(s, n) for n in ("ttft_s", "router_in_s", "queue_s", "prefill_s", "relay_s",
                                                 "router_s", "engine_s"))
        tpot = f"{_ms1((s.get('tpot_s') or {}).get('p99'))} / {_ms1((s.get('engine_tpot_s') or {}).get('p99'))}"
        cpu, busy, lag = router_cpu_ms(run), run.machine_busy, run.send_lag_p99_s
        flag = " (saturated)" if busy is not None and busy > BUSY_FLAG else ""
        lines.append(f"| {run.level} | {run.name} | {run.repeat + 1} | {s['joined']}/{s['completed']} | {cells} | "
                     f"{tpot} | "
                     f"{'-' if tokens is None else f'{tokens:,.0f}'} | {'-' if share is None else f'{share:.3f}'} | "
                     f"{'-' if cpu is None else f'{cpu:.1f}'} | {'-' if busy is None else f'{busy:.0%}'}{flag} | "
                     f"{'-' if lag is None else f'{lag:.2f}'} |")
        rows.append({"level": run.level, "layout": run.name, "kind": run.kind, "repeat": run.repeat, **s,
                     "router_cpu_ms_per_request": cpu, "machine_busy": busy, "send_lag_p99_s": lag})
    gaps = []
    gap_lines = []
    for a in split_runs:
        if a.kind != "gateway":
            continue
        for b in split_runs:
            if b.kind != "peer" or (b.level, b.repeat) != (a.level, a.repeat):
                continue
            p50, p99 = gap_split(a.request_splits, b.request_splits, 50), gap_split(a.request_splits,
                                                                                     b.request_splits, 99)
            if p50 is None or p99 is None:
                continue
            m = p50.mean_components
            gap_lines.append(
                f"| {a.level} | {a.repeat + 1} | {a.name} vs {b.name} | {_signed_ms(p50.gap_s)} | "
                f"{_signed_ms(p50.choices_s)} | {_signed_ms(p50.router_s)} | {_signed_ms(p99.gap_s)} | "
                f"{_signed_ms(p99.choices_s)} | {_signed_ms(p99.router_s)} | {_signed_ms(p50.mean_gap_s)} | "
                f"{_signed_ms(m['router_in_s'])} | {_signed_ms(m['engine_s'])} | {_signed_ms(m['relay_s'])} | "
                f"{p50.prefill_tokens_mean_delta:+,.0f} |")
            gaps.append({"level": a.level, "repeat": a.repeat, "layout": a.name, "peer": b.name,
                         "p50": p50.to_json(), "p99": p99.to_json()})
    if gap_lines:
        lines += ["", "TTFT gap to the peer router (ms, layout - peer; gap = choices + router exactly: choices = "
                  "the gap of the engine times' percentile, router = the rest, the routers' own latency):", "",
                  GAP_HEADER, *gap_lines]
    if not split_runs:
        lines.append("| (no run with worker timings) | | | | | | | | | | | | | | | | |")
    return "\n".join(lines), {"runs": rows, "gaps": gaps}
