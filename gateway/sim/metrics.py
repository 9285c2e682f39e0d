"""`GET /metrics` of a simulated engine: Prometheus text with the engine's real metric names.

A custom collector reads an `EngineStats` snapshot at scrape time, so the exposition is always
consistent with the engine state and nothing is double-booked. Names and labels come from the
engine's dialect (vLLM: `vllm:num_requests_running{model_name,engine}` ...; SGLang:
`sglang:num_running_reqs{model_name}` ...). Counters are exposed with the `_total` suffix.
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
    reason ("stop", "length", "abort").
    """

    running: int
    waiting: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)


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
