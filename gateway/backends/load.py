"""Load signals scraped from each engine's own /metrics (design §5 "load guard").

Every `interval` seconds each worker's `/metrics` is fetched (each worker on its own loop, within
`timeout` seconds overall and at most `max_body_bytes`); only the lines of the three
signals its engine kind exports (running, waiting, KV usage; names in `engines.py`) are kept and
parsed with prometheus_client's parser, summing over label sets (several engines or models).
A failed scrape leaves the last values in place; the engine view, corrected by how this replica's
in-flight count moved since the scrape, is what policies compare, so it does not depend on how
many gateway replicas share the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.control import ControlError, control_get, pool_headers
from gateway.backends.engine_kinds import EngineSpec
from gateway.backends.h1 import H1Pool
from gateway.backends.params import LoadConfig
from gateway.backends.periodic import FollowsWorkers, PeriodicEach
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.observability.metrics import GatewayMetrics

log = logging.getLogger("gateway.load")


def parse_engine_load(text: str, spec: EngineSpec) -> tuple[float | None, float | None, float | None]:
    """(running, waiting, kv_usage) from a Prometheus exposition; None for a signal not present."""
    names = [n for n in (spec.running_metric, spec.waiting_metric, *spec.kv_usage_metrics) if n]
    if not names:
        return None, None, None
    prefixes = tuple(names)
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(prefixes))
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name in names:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    kv = next((totals[n] for n in spec.kv_usage_metrics if n in totals), None)
    running = totals.get(spec.running_metric) if spec.running_metric else None
    waiting = totals.get(spec.waiting_metric) if spec.waiting_metric else None
    return running, waiting, kv


START_TIME_METRIC = "process_start_time_seconds"


def parse_start_time(text: str) -> float | None:
    """The serving process' start (unix s) from a Prometheus exposition: prometheus_client's process
    collector gauge `process_start_time_seconds`, or None when it is not there. vLLM with one API
    server has it (`vllm/v1/metrics/prometheus.py` serves the default registry); vLLM with
    `--api-server-count` > 1 and SGLang serve a multiprocess registry without it
    (`vllm/entrypoints/cli/serve.py`, `python/sglang/srt/utils/common.py`)."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(START_TIME_METRIC))
    values = [sample.value for family in text_string_to_metric_families(wanted) for sample in family.samples
              if sample.name == START_TIME_METRIC]
    return max(values) if values else None


class LoadScraper(FollowsWorkers[Worker]):
    """Background loops (one per worker) that refresh every worker's engine load.

    A scrape has `timeout` seconds overall and reads at most `max_body_bytes` of `/metrics`; it
    carries the pool's `api_key`. A failed scrape keeps the last values; the first of a run of
    failures is logged (a warning), and the next success (info), not every one in between.
    """

    def __init__(self, registry: WorkerRegistry, client: H1Pool, config: LoadConfig,
                 metrics: GatewayMetrics, pools: Iterable[PoolConfig]) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.metrics = metrics
        self.headers = pool_headers(pools)
        self.failures: dict[str, str] = {}
        """Worker id → why its last scrape failed (absent once one succeeds)."""
        self.loop = PeriodicEach("load scrape", config.interval, list(registry), self.scrape, label=lambda w: w.id)

    def worker_gone(self, worker: Worker) -> None:
        """A retired worker finished its requests: its loop stops, its last failure is forgotten."""
        super().worker_gone(worker)
        self.failures.pop(worker.id, None)

    def set_pools(self, pools: Iterable[PoolConfig]) -> None:
        """The pools' credentials after a reload."""
        self.headers = pool_headers(pools)

    async def scrape(self, worker: Worker) -> bool:
        """One scrape; True when the worker's load was updated. The engine counts its requests when
        it answers, near when the scrape is sent: this replica's in-flight count is taken then too,
        so a request that finishes while a slow answer is read is not counted as still queued."""
        in_flight_at_send, sent_at = worker.in_flight, time.monotonic()
        try:
            answer = await control_get(self.client, worker.url + "/metrics", self.headers.get(worker.pool, {}),
                                       self.config.timeout, self.config.max_body_bytes)
            if answer.status != 200:
                return self._failed(worker, f"/metrics answered HTTP {answer.status}")
            running, waiting, kv = parse_engine_load(answer.body.decode("utf-8", "replace"), worker.engine)
        except ControlError as exc:
            return self._failed(worker, str(exc))
        except ValueError as exc:
            return self._failed(worker, f"unreadable /metrics ({exc})")
        if running is None and waiting is None and kv is None:
            return self._failed(worker, "/metrics has none of the engine's load metrics")
        if self.failures.pop(worker.id, None) is not None:
            log.info("load scrape of %s works again", worker.id)
        worker.engine_running, worker.engine_waiting, worker.kv_usage = running, waiting, kv
        worker.in_flight_at_scrape, worker.scraped_at = in_flight_at_send, sent_at
        for signal, value in (("running", running), ("waiting", waiting), ("kv_usage", kv)):
            if value is not None:
                self.metrics.engine_load_scraped(worker.pool, worker.id, signal, value)
        return True

    def _failed(self, worker: Worker, reason: str) -> bool:
        if worker.id not in self.failures:  # once per run of failures, not every second
            log.warning("load scrape of %s failed: %s (keeping its last load values)", worker.id, reason)
        self.failures[worker.id] = reason
        return False
