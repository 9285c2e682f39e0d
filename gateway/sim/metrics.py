"""`GET /metrics` of a simulated engine: Prometheus text with the engine's real metric names.

A custom collector reads an `EngineStats` snapshot at scrape time, so the exposition is always
consistent with the engine state and nothing is double-booked. Names and labels come from the
engine's dialect (vLLM: `vllm:num_requests_running{model_name,engine}`,
`vllm:prefix_cache_hits_total` ...; SGLang: `sglang:num_running_reqs{model_name}`,
`sglang:cache_hit_rate` ...; see `gateway.sim.dialects` for the sources). Counters are exposed with
the `_total` suffix. A dialect whose engine has it (`MetricNames.process_start_time`) also shows
`process_start_time_seconds`: when this simulated engine started (unix s), new for each engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.sim.config import SimConfig
from gateway.sim.dialects import EngineDialect
from gateway.sim.pd import PdState


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of an engine's load and counters.

    `kv_usage` is a fraction in [0, 1]; `finished_by_reason` counts finished requests by finish
    reason ("stop", "length", "abort"). Prefix cache: `prefix_cache_queries_total` prompt tokens
    looked up (0 without a cache), `prefix_cache_hits_total` of them found, `cache_hit_rate` the
    recent hit fraction in [0, 1]. `preemptions_total` counts running requests preempted for KV
    room (step scheduler only).
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
    preemptions_total: int = 0


class SimMetricsCollector(Collector):
    """Exposes `EngineStats` under the names and labels of one engine dialect."""

    def __init__(self, stats: Callable[[], EngineStats], dialect: EngineDialect, model_name: str,
                 started_at: float) -> None:
        self._stats = stats
        self._started_at = started_at
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

        if names.process_start_time:
            yield GaugeMetricFamily("process_start_time_seconds",
                                    "Start time of the process since unix epoch in seconds.", self._started_at)
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
        if names.preemptions is not None:
            yield counter(names.preemptions, "Running requests preempted for KV-cache room (simulated).",
                          stats.preemptions_total)
        if names.request_success is not None:
            family = CounterMetricFamily(names.request_success, "Finished requests by reason (simulated).",
                                         labels=[*label_names, "finished_reason"])
            for reason in ("stop", "length", "abort"):
                family.add_metric([*values, reason], stats.finished_by_reason.get(reason, 0))
            yield family


def build_registry(stats: Callable[[], EngineStats], dialect: EngineDialect, model_name: str,
                   started_at: float) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector (`started_at`: the engine's start, unix s)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimMetricsCollector(stats, dialect, model_name, started_at))
    return registry


class PdMetricsCollector(Collector):
    """The PD metrics of one worker, under its engine's names (sources in `gateway.sim.pd`).

    SGLang: `sglang:num_bootstrap_failed_reqs_total`, `sglang:num_transfer_failed_reqs_total`
    (counters), `sglang:kv_transfer_latency_ms` (histogram, one +Inf bucket), and the gauges
    `sglang:num_decode_transfer_queue_reqs` (decode) / `sglang:num_prefill_prealloc_queue_reqs`
    (prefill). vLLM NIXL: `vllm:nixl_xfer_time_seconds` (histogram, decode),
    `vllm:nixl_num_failed_transfers` (counter, decode), `vllm:nixl_num_kv_expired_reqs` (counter,
    prefill). vLLM Mooncake: `vllm:mooncake_xfer_time_seconds` (histogram; the sim measures it on
    the decode worker). Label values are the dialect's (`model_name`, plus `engine` for vLLM).
    """

    def __init__(self, pd: PdState, dialect: EngineDialect, config: SimConfig) -> None:
        self._pd = pd
        self._protocol = config.pd_protocol
        self._labels = dialect.metric_labels(config.model_name)

    def collect(self) -> Iterator[Metric]:
        c = self._pd.counters()
        names, values = list(self._labels), list(self._labels.values())

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                   value: float) -> Metric:
            metric = kind(name, doc, labels=names)
            metric.add_metric(values, value)
            return metric

        def histogram(name: str, doc: str, total: float) -> Metric:
            metric = HistogramMetricFamily(name, doc, labels=names)
            metric.add_metric(values, [("+Inf", float(c.transfers))], total)
            return metric

        if self._protocol == "vllm-mooncake":
            yield histogram("vllm:mooncake_xfer_time_seconds", "Mooncake KV transfer time (simulated).",
                            c.transfer_seconds)
        elif self._protocol == "sglang":
            yield family(CounterMetricFamily, "sglang:num_bootstrap_failed_reqs", "Bootstrap failed requests.",
                         c.bootstrap_failed)
            yield family(CounterMetricFamily, "sglang:num_transfer_failed_reqs", "Transfer failed requests.",
                         c.transfer_failed)
            yield histogram("sglang:kv_transfer_latency_ms", "KV transfer latency (ms, simulated).",
                            c.transfer_seconds * 1000.0)
            yield family(GaugeMetricFamily, "sglang:num_decode_transfer_queue_reqs",
                         "Decode requests waiting for their KV.", c.waiting_for_kv)
            yield family(GaugeMetricFamily, "sglang:num_prefill_prealloc_queue_reqs",
                         "Prefill requests waiting for their decode worker's bootstrap.", c.bootstrapping)
        else:
            yield histogram("vllm:nixl_xfer_time_seconds", "NIXL KV transfer time (simulated).", c.transfer_seconds)
            yield family(CounterMetricFamily, "vllm:nixl_num_failed_transfers", "Failed NIXL KV transfers.",
                         c.transfer_failed)
            yield family(CounterMetricFamily, "vllm:nixl_num_kv_expired_reqs",
                         "Requests whose held KV expired unread.", c.kv_expired)
