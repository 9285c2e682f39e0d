"""A circuit breaker for a store in Redis: after a failed call, skip Redis for `retry_after` seconds.

Shared by the prefix-affinity store (`redis_store.py`: a skipped lookup is a miss, routing fails
open) and the stored-response store (`response_store.py`: a skipped lookup answers 503
`response_store_unavailable` at once). Without it, every request would wait the store's
`lookup_timeout` on a Redis that hangs, or open a fresh connection to one that refuses them. A
failure caused by the gateway's own event-loop stall (`looplag.StoreTimeout.expired_late`) is
not Redis' fault and must not trip it (the callers check that).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Open for `retry_after` seconds after each `trip()`; then the next call tries Redis again
    (half-open: one more failure trips it anew). Times are `clock()` seconds (monotonic)."""

    __slots__ = ("_clock", "_skip_until", "retry_after")

    def __init__(self, retry_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after = retry_after
        self._clock = clock
        self._skip_until = 0.0

    @property
    def closed(self) -> bool:
        """True when Redis may be called (no failure within the last `retry_after` seconds)."""
        return self._clock() >= self._skip_until

    def trip(self) -> None:
        """A call failed: skip Redis for `retry_after` seconds from now."""
        self._skip_until = self._clock() + self.retry_after
