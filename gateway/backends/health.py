"""Active health probes: every worker's engine health path, on an interval, in the background."""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import HealthConfig
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.health")


class HealthChecker:
    """Probes each worker every `interval` s; a non-200 or a probe slower than `timeout` fails it.

    A worker that passes a probe is healthy again, so a restarted engine rejoins by itself.
    """

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, config: HealthConfig,
                 metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.metrics = metrics
        self.loop = Periodic("health-checker", config.interval, self.probe_all)

    async def probe(self, worker: Worker) -> bool:
        """One probe; updates the worker's state and metrics; returns the verdict."""
        try:
            response = await self.client.get(worker.url + worker.engine.health_path,
                                             timeout=self.config.timeout)
            ok = response.status_code == 200
            reason = None if ok else f"health probe answered HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"health probe failed: {type(exc).__name__}"
        if ok:
            self.registry.probe_passed(worker)
        else:
            self.registry.probe_failed(worker, reason or "unhealthy")
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.registry))
        self.registry.expire_ejections()
