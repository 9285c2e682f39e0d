"""AppState: everything one gateway process shares, built once at start-up (no globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from gateway.backends.client import build_upstream_client
from gateway.backends.health import HealthChecker
from gateway.backends.registry import WorkerRegistry
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.routing.router import Router
from gateway.routing.tokens import TokenEstimator


@dataclass(slots=True)
class AppState:
    """Config, the upstream client, workers, router, estimator, metrics and background tasks."""

    config: GatewayConfig
    http: httpx.AsyncClient
    registry: WorkerRegistry
    router: Router
    estimator: TokenEstimator
    metrics: GatewayMetrics
    health: HealthChecker
    started_unix: int = 0

    @classmethod
    def build(cls, config: GatewayConfig) -> AppState:
        """Build the state (no I/O yet); `start()` launches the background tasks."""
        http = build_upstream_client(config.timeouts)
        registry = WorkerRegistry(config)
        metrics = GatewayMetrics()
        return cls(config=config, http=http, registry=registry, router=Router(config),
                   estimator=TokenEstimator(config.estimation), metrics=metrics,
                   health=HealthChecker(registry, http, config.health, metrics),
                   started_unix=int(time.time()))

    async def start(self) -> None:
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.http.aclose()
