"""Load signals scraped from each engine's own /metrics (design §5 "load guard").

Every `interval` seconds each worker's `/metrics` is fetched; only the lines of the three
signals its engine kind exports (running, waiting, KV usage; names in `engines.py`) are kept and
parsed with prometheus_client's parser, summing over label sets (several engines or models).
A failed scrape leaves the last values in place; the engine view, corrected by how this replica's
in-flight count moved since the scrape, is what policies compare, so it does not depend on how
many gateway replicas share the engines.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.engines import EngineSpec
from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import LoadConfig
from gateway.metrics import GatewayMetrics

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


class LoadScraper:
    """Background task that refreshes every worker's engine load."""

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, config: LoadConfig,
                 metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.metrics = metrics
        self.loop = Periodic("load-scraper", config.interval, self.scrape_all)

    async def scrape(self, worker: Worker) -> bool:
        """One scrape; True when the worker's load was updated."""
        try:
            response = await self.client.get(worker.url + "/metrics", timeout=self.config.timeout)
            if response.status_code != 200:
                return False
            running, waiting, kv = parse_engine_load(response.text, worker.engine)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("load scrape of %s failed: %s", worker.id, exc)
            return False
        if running is None and waiting is None and kv is None:
            return False
        worker.engine_running, worker.engine_waiting, worker.kv_usage = running, waiting, kv
        worker.in_flight_at_scrape = worker.in_flight
        for signal, value in (("running", running), ("waiting", waiting), ("kv_usage", kv)):
            if value is not None:
                self.metrics.engine_load.labels(worker.pool, worker.id, signal).set(value)
        return True

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(w) for w in self.registry))
