"""The worker registry: every pool's workers and their health, built once from config."""

from __future__ import annotations

from collections.abc import Collection, Iterator

from gateway.backends.engines import ENGINES
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig


class WorkerRegistry:
    """Pools → workers. Candidates are healthy workers not yet tried by the request."""

    def __init__(self, config: GatewayConfig) -> None:
        self.pools: dict[str, list[Worker]] = {
            pool.name: [Worker(pool.name, i, url, ENGINES[pool.engine]) for i, url in enumerate(pool.workers)]
            for pool in config.pools
        }

    def __iter__(self) -> Iterator[Worker]:
        for workers in self.pools.values():
            yield from workers

    def candidates(self, pool: str, exclude: Collection[Worker] = ()) -> list[Worker]:
        """Healthy workers of `pool` that are not in `exclude`."""
        return [w for w in self.pools[pool] if w.healthy and w not in exclude]

    def mark_failure(self, worker: Worker, reason: str, unhealthy_after: int = 1) -> None:
        """Passive health: an upstream failure (connect error, 5xx...) counts against the worker."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.consecutive_failures >= unhealthy_after:
            worker.healthy = False

    def mark_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.healthy = True
        worker.last_error = None

    def unready_pools(self) -> list[str]:
        """Pools with no healthy worker."""
        return [name for name, workers in self.pools.items() if not any(w.healthy for w in workers)]
