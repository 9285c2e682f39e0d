"""Per-pool concurrency limits with a bounded wait queue (back-pressure toward clients).

A pool may cap the requests this replica sends to one worker (`max_in_flight_per_worker`) and
to the whole pool (`max_in_flight`). When every candidate is full, a request first spills over
to a later pool that has room (when the pool allows spillover), else waits for a slot: at most
`max_queue` requests wait, each at most `queue_timeout` seconds; beyond that it is refused with
503 and `Retry-After`, so memory and queues stay bounded under overload.
"""

from __future__ import annotations

import asyncio
import time

from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.errors import NoCapacity


class PoolGate:
    """Slots of one pool. Released leases wake the waiters, which then re-check for room."""

    def __init__(self, config: PoolConfig) -> None:
        self.in_flight = 0
        self.waiting = 0
        self._freed = asyncio.Event()
        self.configure(config)

    def configure(self, config: PoolConfig) -> None:
        """Take the pool's limits (at start-up and on a reload); counts and waiters stay."""
        self.per_worker = config.max_in_flight_per_worker
        pd = config.disaggregation
        # A PD pool's per-role limits (each falls back to the pool's own per-worker limit).
        self.per_role: dict[str | None, int | None] = {} if pd is None else {
            "prefill": pd.prefill_max_in_flight_per_worker or self.per_worker,
            "decode": pd.decode_max_in_flight_per_worker or self.per_worker}
        self.total = config.max_in_flight
        self.max_queue = config.max_queue
        self.queue_timeout = config.queue_timeout

    @property
    def limited(self) -> bool:
        return self.per_worker is not None or self.total is not None or any(self.per_role.values())

    def with_room(self, workers: list[Worker]) -> list[Worker]:
        """The workers that may take one more request now (all of them when the pool is unlimited);
        a PD pool's workers by their role's per-worker limit."""
        if self.total is not None and self.in_flight >= self.total:
            return []
        if not self.per_role:
            if self.per_worker is None:
                return workers
            return [w for w in workers if w.in_flight < self.per_worker]
        return [w for w in workers if (limit := self.per_role.get(w.role)) is None or w.in_flight < limit]

    def acquired(self) -> None:
        self.in_flight += 1

    def released(self) -> None:
        self.in_flight -= 1
        if self.waiting:  # nothing to wake (and nothing to allocate) on the usual path
            self._freed.set()
            self._freed = asyncio.Event()  # waiters hold the set one; new waiters get a fresh one

    async def wait_for_slot(self, deadline: float) -> None:
        """Wait until a slot may have freed up, or raise NoCapacity (503) when the queue is full or
        `deadline` (time.monotonic()) has passed."""
        remaining = deadline - time.monotonic()
        if self.waiting >= self.max_queue or remaining <= 0:
            raise NoCapacity("The inference servers are at capacity; try again shortly.",
                             headers={"retry-after": "1"}, code="server_overloaded")
        self.waiting += 1
        try:
            async with asyncio.timeout(remaining):
                await self._freed.wait()
        except TimeoutError:
            raise NoCapacity("The inference servers stayed at capacity; try again shortly.",
                             headers={"retry-after": "1"}, code="server_overloaded") from None
        finally:
            self.waiting -= 1
