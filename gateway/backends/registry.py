"""The worker registry: every pool's workers and their health, built once from config.

Two kinds of health, kept apart:
- active: probes of the engine's health path (HealthChecker) and refused connections set
  `healthy`; a passing probe restores it;
- passive (outlier ejection, as Envoy does it): `passive_failures` consecutive failed requests
  (5xx, timeouts, broken answers) eject a worker for `ejection_base` * 2^(ejections so far)
  seconds, capped at `ejection_max`. When the time is up the worker is a candidate again
  (half-open): one success closes the circuit and resets the back-off, one more failure ejects
  it again for twice as long. A passing probe does not end an ejection: an engine can answer
  `/health` and still fail every request.
A 429 keeps a worker out of new requests for its `Retry-After` (default 1 s) without counting as
a failure. A worker an operator drained (admin API) gets no new requests until undrained; its
in-flight requests finish as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator

from gateway.backends.capacity import PoolGate
from gateway.backends.engines import ENGINES
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.health")

DEFAULT_RETRY_AFTER_S = 1.0


class WorkerRegistry:
    """Pools → workers, their health and ejection state. Touched only on the event loop."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.health = config.health
        self.metrics = metrics
        self.clock = clock
        self.pools: dict[str, list[Worker]] = {
            pool.name: [Worker(pool.name, i, url, ENGINES[pool.engine]) for i, url in enumerate(pool.workers)]
            for pool in config.pools
        }
        self.gates: dict[str, PoolGate] = {pool.name: PoolGate(pool) for pool in config.pools}
        # Per worker: how to move each in-flight attempt still waiting for response headers.
        self._header_waits: dict[Worker, set[Callable[[], None]]] = {}
        if metrics is not None:  # every worker's series exists from the start (alerts see a 0, not nothing)
            for worker in self:
                metrics.worker_draining.labels(worker.pool, worker.id).set(0)
                metrics.worker_ejected.labels(worker.pool, worker.id).set(0)
                metrics.worker_misconfigured.labels(worker.pool, worker.id).set(0)

    def __iter__(self) -> Iterator[Worker]:
        for workers in self.pools.values():
            yield from workers

    def find(self, pool: str, index: int) -> Worker | None:
        """The worker `pool/index`, or None when there is no such pool or index."""
        workers = self.pools.get(pool)
        return workers[index] if workers is not None and 0 <= index < len(workers) else None

    def candidates(self, pool: str, exclude: Collection[Worker] = ()) -> list[Worker]:
        """Workers of `pool` that may take a request now: healthy, not drained, not ejected, not
        told to back off by a 429, and not in `exclude` (already tried by this request)."""
        now = self.clock()
        return [w for w in self.pools[pool] if w.in_service(now) and w.busy_until <= now and w not in exclude]

    # --- active health -------------------------------------------------------------------------

    def probe_failed(self, worker: Worker, reason: str) -> None:
        """A failed probe; `health.unhealthy_after` in a row make the worker unhealthy."""
        worker.failed_probes += 1
        worker.last_error = reason
        if worker.failed_probes >= self.health.unhealthy_after:
            self._set_healthy(worker, False, reason)

    def probe_passed(self, worker: Worker) -> None:
        worker.failed_probes = 0
        self._set_healthy(worker, True, None)

    def connect_failed(self, worker: Worker, reason: str) -> None:
        """The engine refused or dropped the connection: unhealthy until a probe passes."""
        worker.last_error = reason
        self._set_healthy(worker, False, reason)

    def awaiting_headers(self, worker: Worker, move: Callable[[], None]) -> None:
        """An attempt on `worker` waits for its response headers; `move()` is called (once) if the
        worker turns unhealthy meanwhile: an engine that has not answered is not generating, so
        the attempt should go to another worker rather than wait out its timeout."""
        self._header_waits.setdefault(worker, set()).add(move)

    def headers_done(self, worker: Worker, move: Callable[[], None]) -> None:
        """The attempt registered with `move` got its headers, or ended: no more moving."""
        waits = self._header_waits.get(worker)
        if waits is not None:
            waits.discard(move)

    def _set_healthy(self, worker: Worker, healthy: bool, reason: str | None) -> None:
        if worker.healthy != healthy:
            log.warning("worker %s is now %s%s", worker.id, "healthy" if healthy else "unhealthy",
                        f" ({reason})" if reason else "")
            if not healthy:
                for move in self._header_waits.pop(worker, ()):
                    move()
        worker.healthy = healthy
        if healthy:
            worker.last_error = None
        if self.metrics is not None:
            self.metrics.worker_healthy.labels(worker.pool, worker.id).set(1 if healthy else 0)

    def set_misconfigured(self, worker: Worker, reason: str | None) -> None:
        """The verdict of a `/v1/models` check: `reason` (in words) keeps the worker out of every
        request and of `/ready`'s count; None puts it back. Logged when it changes."""
        if worker.misconfigured != reason:
            if reason is None:
                log.warning("worker %s serves the pool's model and max context again", worker.id)
            else:
                log.warning("worker %s is misconfigured, no traffic: %s", worker.id, reason)
        worker.misconfigured = reason
        if self.metrics is not None:
            self.metrics.worker_misconfigured.labels(worker.pool, worker.id).set(0 if reason is None else 1)

    # --- operator drain ------------------------------------------------------------------------

    def set_draining(self, worker: Worker, draining: bool) -> None:
        """Drain (True) or undrain (False) a worker; idempotent. A drained worker is left out of
        `candidates` and of `/ready`'s count, so a pool whose workers are all drained is not ready."""
        if worker.draining != draining:
            log.info("worker %s %s by an operator", worker.id, "drained" if draining else "undrained")
        worker.draining = draining
        if self.metrics is not None:
            self.metrics.worker_draining.labels(worker.pool, worker.id).set(1 if draining else 0)

    # --- passive health: outlier ejection -------------------------------------------------------

    def request_failed(self, worker: Worker, reason: str) -> None:
        """A request failed on the worker's side (5xx, timeout, broken answer)."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        # Half-open after an ejection: a single failure is enough to eject again.
        threshold = 1 if worker.ejections else self.health.passive_failures
        if worker.consecutive_failures < threshold:
            return
        seconds = min(self.health.ejection_base * 2 ** worker.ejections, self.health.ejection_max)
        worker.ejected_until = self.clock() + seconds
        worker.ejections += 1
        worker.consecutive_failures = 0
        log.warning("worker %s ejected for %.1fs after %d consecutive failures (%s)", worker.id, seconds,
                    self.health.passive_failures, reason)
        if self.metrics is not None:
            self.metrics.ejections.labels(worker.pool, worker.id).inc()
            self.metrics.worker_ejected.labels(worker.pool, worker.id).set(1)

    def request_succeeded(self, worker: Worker) -> None:
        """A request succeeded: the failure streak and the ejection back-off start over."""
        worker.consecutive_failures = 0
        if worker.ejections:
            worker.ejections = 0
            if self.metrics is not None:
                self.metrics.worker_ejected.labels(worker.pool, worker.id).set(0)

    def expire_ejections(self) -> None:
        """Set `kimi_gateway_worker_ejected` to 0 for workers whose ejection time is over (called by
        the prober: an ejection ends by the clock, not by an event)."""
        if self.metrics is None:
            return
        now = self.clock()
        for worker in self:
            if worker.ejections and worker.ejected_until <= now:
                self.metrics.worker_ejected.labels(worker.pool, worker.id).set(0)

    def throttled(self, worker: Worker, retry_after: float | None) -> None:
        """A 429: no new requests to this worker for `retry_after` seconds (1 s when not given)."""
        worker.busy_until = self.clock() + (DEFAULT_RETRY_AFTER_S if retry_after is None else retry_after)

    def unready_pools(self) -> list[str]:
        """Pools with no healthy, correctly configured, undrained, non-ejected worker."""
        now = self.clock()
        return [name for name, workers in self.pools.items() if not any(w.in_service(now) for w in workers)]
