"""A background loop that runs one coroutine function every `interval` seconds until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("gateway.periodic")


class Periodic:
    """`start()` launches the loop on the running event loop; `stop()` cancels and awaits it.

    An exception in one round is logged and the loop goes on.
    """

    def __init__(self, name: str, interval: float, round_fn: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.interval = interval
        self.round_fn = round_fn
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            try:
                await self.round_fn()
            except Exception:
                log.exception("%s round failed", self.name)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
