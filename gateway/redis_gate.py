"""A bound on a store's calls to Redis in flight, with a deadline to wait for a turn.

redis-py's asyncio connection pool refuses a connection when all `max_connections` are in use
(`MaxConnectionsError`, a ConnectionError) instead of waiting for one. A burst of requests
(hundreds at once from one client) then made some store calls fail at once, and the stores read
any ConnectionError as "Redis is down": the breaker opened and, for its `retry_after`, rate limits
were off for every key (issue 25 §1), or the stored-response store answered 503 to everyone and
dropped new responses' writes (§5). The gateway's own exhaustion is not an outage.

`StoreGate(slots, wait_s)` hands out `slots` turns (one Redis connection each: a store makes its
pool that large, so a call holding a turn always gets a connection); a call waits for a turn at
most `wait_s` seconds, then `StoreBusy` is raised. The time spent waiting is not part of the
call's own Redis budget (the store starts its `StoreTimeout` once it has a turn). StoreBusy is no
Redis error: a store that sees it must not trip its breaker nor count a Redis error.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from redis.exceptions import TimeoutError as RedisTimeout

WAIT_S = 2.0
"""Seconds a rate-limit check or a stored-response lookup waits for a turn (the affinity lookup,
which may just miss, waits its own `lookup_timeout`)."""


class StoreBusy(Exception):
    """Every turn to the store stayed taken for the whole wait deadline: the gateway's own calls
    fill it, which says nothing about Redis' health."""


class StoreGate:
    """`async with gate:` waits (FIFO) for one of `slots` turns, at most `wait_s` seconds (StoreBusy
    after that), and gives the turn back on exit. `waiting` and `in_use` count the calls waiting
    and holding a turn now."""

    __slots__ = ("_slots", "in_use", "slots", "wait_s", "waiting")

    def __init__(self, slots: int, wait_s: float) -> None:
        if slots < 1:
            raise ValueError("a store needs at least one slot")
        self.slots = slots
        self.wait_s = wait_s
        self.waiting = 0
        self.in_use = 0
        self._slots = asyncio.Semaphore(slots)

    async def __aenter__(self) -> StoreGate:
        if not self._slots.locked():
            await self._slots.acquire()  # a free turn: taken without suspending
            self.in_use += 1
            return self
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreBusy(f"all {self.slots} Redis connections stayed busy for {self.wait_s:g} s") from None
        finally:
            self.waiting -= 1
        self.in_use += 1
        return self

    def queued_behind(self, exc: BaseException) -> bool:
        """Whether `exc`, the failure of a call holding a turn, is a timeout (the call's deadline, or
        redis-py's connect or socket timeout) while other calls wait for one: the event loop read its
        reply late behind theirs (the gateway's own burst), which says nothing about Redis' health,
        so no breaker should trip on it."""
        return isinstance(exc, (TimeoutError, RedisTimeout)) and self.waiting > 0

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.in_use -= 1
        self._slots.release()
