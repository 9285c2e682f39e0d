"""StatusWindow: what happened lately, as deltas of the gateway's own Prometheus counters.

The status page (`/dashboard`) and `GET /admin/status` show "recent" traffic: requests per second,
error ratio, the mix of route decisions, the affinity hit ratio and mean TTFT, per pool. They are
not counted twice: each call reads the cumulative values of `GatewayMetrics`' collectors (summed
over every serving process in multiprocess mode, as `/metrics` is, so whichever process answers
the poll reports the whole gateway), keeps a sample at most every `min_spacing_s`, and reports
the difference between now and the oldest sample still covering `window_s`. The first sample is
all zeros at construction, so the first call already reports everything since start-up. Memory
is bounded: at most `window_s / min_spacing_s + 2` samples of at most (pools x label values)
numbers each. Worker states beside these figures stay those of the process that answered.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.observability.metrics import GatewayMetrics

Key = tuple[str, str, str]
"""(series, pool, label): e.g. ("decisions", "vllm-128k", "affinity") or ("ttft_sum", "p", "")."""


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    """time.monotonic() seconds."""
    totals: dict[Key, float] = field(default_factory=dict)


FAMILIES = {"kimi_gateway_requests": ("requests", "status_class", "_total"),
            "kimi_gateway_route_decisions": ("decisions", "reason", "_total"),
            "kimi_gateway_affinity_lookups": ("affinity", "result", "_total"),
            "kimi_gateway_ttft_seconds": ("ttft", "", "")}
"""Metric family → (series, label shown, sample suffix): the counters the status page reads."""


def _families(metrics: GatewayMetrics) -> Iterable[Metric]:
    if metrics.multiprocess_dir is None:
        return metrics.registry.collect()
    return MultiProcessCollector(None, path=metrics.multiprocess_dir).collect()


def read_totals(metrics: GatewayMetrics) -> dict[Key, float]:
    """The cumulative counts the status page needs, summed over the labels it does not show."""
    totals: dict[Key, float] = defaultdict(float)
    for family in _families(metrics):
        if family.name not in FAMILIES:
            continue
        series, label, suffix = FAMILIES[family.name]
        for sample in family.samples:
            if series == "ttft":  # a histogram: its sum and count give the mean
                if sample.name.endswith(("_sum", "_count")):
                    totals["ttft_" + sample.name.rsplit("_", 1)[1], sample.labels["pool"], ""] += sample.value
            elif sample.name.endswith(suffix):
                totals[series, sample.labels["pool"], sample.labels[label]] += sample.value
    return dict(totals)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def summarize(delta: dict[Key, float], span_s: float) -> dict[str, object]:
    """One pool's (or all pools') recent figures from counter deltas over `span_s` seconds.

    Returns `requests` (count), `requests_per_s`, `status` ({"2xx": n, ...}), `errors` (5xx
    answers) and `error_ratio` (errors / requests), `decisions` ({reason: n}), `affinity`
    ({result: n}: hit, miss, error, skipped) and `affinity_hit_ratio` (hits / lookups: the share
    of requests that found a usable cached prefix), `ttft_mean_s` (streaming requests). Ratios and
    means are None when there is nothing to divide by.
    """
    status: dict[str, int] = defaultdict(int)
    decisions: dict[str, int] = defaultdict(int)
    affinity: dict[str, int] = defaultdict(int)
    ttft_sum = ttft_count = 0.0
    for (series, _pool, label), value in delta.items():
        if series == "requests":
            status[label] += int(value)
        elif series == "decisions":
            decisions[label] += int(value)
        elif series == "affinity":
            affinity[label] += int(value)
        elif series == "ttft_sum":
            ttft_sum += value
        elif series == "ttft_count":
            ttft_count += value
    requests = sum(status.values())
    errors = status.get("5xx", 0)
    return {"requests": requests, "requests_per_s": round(requests / span_s, 3) if span_s > 0 else None,
            "status": dict(status), "errors": errors, "error_ratio": _ratio(errors, requests),
            "decisions": dict(decisions), "affinity": dict(affinity),
            "affinity_hit_ratio": _ratio(affinity.get("hit", 0), sum(affinity.values())),
            "ttft_mean_s": round(ttft_sum / ttft_count, 4) if ttft_count else None}


class StatusWindow:
    """Recent deltas of the gateway's counters over a sliding window (see the module docstring).

    `window_s` (30 s) is how far back "recent" reaches once the page has polled that long;
    `min_spacing_s` (1 s) bounds how many samples polling keeps. Touched only on the event loop.
    """

    def __init__(self, metrics: GatewayMetrics, window_s: float = 30.0, min_spacing_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.window_s = window_s
        self.min_spacing_s = min_spacing_s
        self.clock = clock
        self.samples: deque[Sample] = deque([Sample(clock())])

    def recent(self, pools: Iterable[str]) -> dict[str, object]:
        """`{"span_s": seconds covered, "total": summary, "pools": {pool: summary}}` for `pools`
        (configured pool names; `total` also counts requests refused before a pool was chosen)."""
        now = self.clock()
        totals = read_totals(self.metrics)
        if now - self.samples[-1].at >= self.min_spacing_s:
            self.samples.append(Sample(now, totals))
        # Keep the newest sample that is at least window_s old: the baseline covering the window.
        while len(self.samples) >= 2 and self.samples[1].at <= now - self.window_s:
            self.samples.popleft()
        baseline = self.samples[0]
        span = now - baseline.at
        delta = {key: value - baseline.totals.get(key, 0.0) for key, value in totals.items()}
        by_pool: dict[str, dict[Key, float]] = defaultdict(dict)
        for key, value in delta.items():
            by_pool[key[1]][key] = value
        return {"span_s": round(span, 3), "total": summarize(delta, span),
                "pools": {pool: summarize(by_pool.get(pool, {}), span) for pool in pools}}
