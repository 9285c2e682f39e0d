"""A timeout for calls to a store (Redis) that does not blame the store for the event loop's own stalls.

`asyncio.timeout(0.05)` around a Redis call fires when its timer runs, and a timer runs late when
the loop was busy (one request's CPU-heavy work held it). If the loop was held across the deadline,
the reply may have been sitting in the socket for most of that time: when the loop resumes, the
timer and the reply are handled in the same iteration, and the timer cancels the call first. Found
by a break-it run (issue 15): a request holding the loop for 1.3 s timed out every rate-limit call
in flight, which opened the limiter's circuit breaker for everyone.

`StoreTimeout(seconds)` measures where the time is spent: when its deadline's timer runs more than
`LATE_S` late, the loop (not the store) was the slow one, so the call gets `seconds` more from now
(at most `MAX_EXTENSIONS` times) for the reply to be read. A call that expires anyway raises
TimeoutError as `asyncio.timeout` does; `expired_late` then says whether the loop was still lagging
at that deadline, so the caller can keep its circuit breaker closed (the store did nothing wrong).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

LATE_S = 0.002
"""A deadline's timer running this much late (seconds) means the event loop was busy at the deadline."""

MAX_EXTENSIONS = 3
"""Fresh budgets a call gets after late deadlines; a call lasts at most (1 + this) x `seconds` of a
lagging loop."""

SOCKET_BACKSTOP_S = 30.0
"""redis-py's own `socket_timeout` (seconds) for clients whose every call runs under a StoreTimeout,
which is what bounds them. redis-py times its reads with the event loop's timers too: a shorter one
(it was 1 s) fired after a loop stall that long, in the same iteration as the late StoreTimeout, and
cancelled the read with its reply already in the socket, a Redis error that opened the breaker
(issue 15's 1.3 s stall did; found again under a loaded CPU by the heavy-bodies test). The same
holds for its `socket_connect_timeout`: a connect opened in a burst (up to a pool's 128 at once)
whose timer fires after a loop stall is the gateway's own load, not a Redis outage, so the stores
set it to this backstop too and their StoreTimeout bounds the connect with the call."""


class StoreTimeout:
    """`async with StoreTimeout(seconds):` — like `asyncio.timeout(seconds)` (TimeoutError on expiry),
    but a deadline passed while the event loop was busy elsewhere is moved `seconds` past the moment
    the loop got back (see the module docstring). One instance per `async with`."""

    __slots__ = ("_handle", "_inner", "_left", "_loop", "expired_late", "extensions", "seconds")

    def __init__(self, seconds: float, max_extensions: int = MAX_EXTENSIONS) -> None:
        self.seconds = seconds
        self.extensions = 0  # deadlines moved because the loop was late
        self.expired_late = False
        self._left = max_extensions
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inner: asyncio.Timeout | None = None
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> StoreTimeout:
        loop = self._loop = asyncio.get_running_loop()
        self._inner = asyncio.timeout(None)
        await self._inner.__aenter__()
        due = loop.time() + self.seconds
        self._handle = loop.call_at(due, self._due, due)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self._handle is not None:
            self._handle.cancel()
        assert self._inner is not None
        await self._inner.__aexit__(exc_type, exc, tb)  # asyncio.Timeout's: None, never suppresses
        return None

    def _due(self, due: float) -> None:
        assert self._loop is not None and self._inner is not None
        now = self._loop.time()
        late = now - due > LATE_S
        if late and self._left > 0:
            self._left -= 1
            self.extensions += 1
            due = now + self.seconds
            self._handle = self._loop.call_at(due, self._due, due)
            return
        self.expired_late = late
        self._inner.reschedule(now)  # expires at once: the task is cancelled, TimeoutError on exit
