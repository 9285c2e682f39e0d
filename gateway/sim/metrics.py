"""`GET /metrics` of a simulated engine: Prometheus text with the engine's real metric names.

A custom collector reads an `EngineStats` snapshot at scrape time, so the exposition is always
consistent with the engine state and nothing is double-booked. Names and labels come from the
engine's dialect (vLLM: `vllm:num_requests_running{model_name,engine}`,
`vllm:prefix_cache_hits_total` ...; SGLang: `sglang:num_running_reqs{model_name}`,
`sglang:cache_hit_rate` ...; see `gateway.sim.dialects` for the sources). Counters are exposed with
the `_total` suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.sim.dialects import EngineDialect


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of an engine's load and counters.

    `kv_usage` is a fraction in [0, 1]; `finished_by_reason` counts finished requests by finish
    reason ("stop", "length", "abort"). Prefix cache: `prefix_cache_queries_total` prompt tokens
    looked up (0 without a cache), `prefix_cache_hits_total` of them found, `cache_hit_rate` the
    recent hit fraction in [0, 1].
    """

    running: int
    waiting: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    cache_hit_rate: float = 0.0


class SimMetricsCollector(Collector):
    """Exposes `EngineStats` under the names and labels of one engine dialect."""

    def __init__(self, stats: Callable[[], EngineStats], dialect: EngineDialect, model_name: str) -> None:
        self._stats = stats
        self._names = dialect.metric_names
        self._labels = dialect.metric_labels(model_name)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        names, label_names = self._names, list(self._labels)
        values = list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=label_names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=label_names)
            family.add_metric(values, value)
            return family

        yield gauge(names.running, "Requests being processed (simulated).", stats.running)
        yield gauge(names.waiting, "Requests queued for admission (simulated).", stats.waiting)
        yield gauge(names.kv_usage, "KV-cache usage fraction, 0 to 1 (simulated).", stats.kv_usage)
        yield counter(names.prompt_tokens, "Prompt tokens prefilled (simulated).", stats.prompt_tokens_total)
        yield counter(names.generation_tokens, "Tokens generated (simulated).", stats.generation_tokens_total)
        if names.prefix_cache_queries is not None:
            yield counter(names.prefix_cache_queries, "Prefix cache queries, in prompt tokens (simulated).",
                          stats.prefix_cache_queries_total)
        if names.prefix_cache_hits is not None:
            yield counter(names.prefix_cache_hits, "Prefix cache hits, in cached prompt tokens (simulated).",
                          stats.prefix_cache_hits_total)
        if names.cache_hit_rate is not None:
            yield gauge(names.cache_hit_rate, "Recent prefix cache hit rate, 0 to 1 (simulated).",
                        stats.cache_hit_rate)
        if names.request_success is not None:
            family = CounterMetricFamily(names.request_success, "Finished requests by reason (simulated).",
                                         labels=[*label_names, "finished_reason"])
            for reason in ("stop", "length", "abort"):
                family.add_metric([*values, reason], stats.finished_by_reason.get(reason, 0))
            yield family


def build_registry(stats: Callable[[], EngineStats], dialect: EngineDialect, model_name: str) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimMetricsCollector(stats, dialect, model_name))
    return registry
