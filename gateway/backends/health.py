"""Active health probes: every worker's engine health path, on an interval, in the background."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx

from gateway.backends.control import ControlError, control_get, pool_headers
from gateway.backends.periodic import PeriodicEach
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import HealthConfig, PoolConfig
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.health")


class HealthChecker:
    """Probes each worker every `interval` s, each on its own loop (a slow worker delays no other).

    A probe fails on a non-200, on no complete answer within `timeout` s (connect, headers and
    body together), on a body over `max_body_bytes`, or on a transport error; the failure's real
    cause (e.g. a host name that does not resolve, a refused connection, a refused key) becomes
    the worker's `last_error`. Probes carry the pool's `api_key`. A worker that passes a probe is
    healthy again, so a restarted engine rejoins by itself.
    """

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, config: HealthConfig,
                 metrics: GatewayMetrics, pools: Iterable[PoolConfig]) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.metrics = metrics
        self.headers = pool_headers(pools)
        self.loop = PeriodicEach("health probe", config.interval, list(registry), self.probe, label=lambda w: w.id)

    def worker_added(self, worker: Worker) -> None:
        """A worker joined (discovery, reload): its loop starts (its first round at once)."""
        self.loop.add(worker)

    def worker_gone(self, worker: Worker) -> None:
        """A retired worker finished its requests: its loop stops."""
        self.loop.remove(worker)

    def set_pools(self, pools: Iterable[PoolConfig]) -> None:
        """The pools' credentials after a reload."""
        self.headers = pool_headers(pools)

    async def probe(self, worker: Worker) -> bool:
        """One probe; updates the worker's state and metrics; returns the verdict."""
        reason: str | None = None
        try:
            answer = await control_get(self.client, worker.url + worker.engine.health_path,
                                       self.headers.get(worker.pool, {}), self.config.timeout,
                                       self.config.max_body_bytes)
            if answer.status in (401, 403):
                reason = (f"health probe answered HTTP {answer.status}: the worker refused the pool's "
                          "credentials (check the pool's api_key)")
            elif answer.status != 200:
                reason = f"health probe answered HTTP {answer.status}"
        except ControlError as exc:
            reason = f"health probe failed: {exc}"
        if reason is None:
            self.registry.probe_passed(worker)
        else:
            self.registry.probe_failed(worker, reason)
        self.registry.expire_ejections()
        return reason is None
