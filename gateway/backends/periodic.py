"""Background loops: one coroutine function every `interval` seconds (`Periodic`), or one loop
per item (`PeriodicEach`: per-worker probes and scrapes), until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("gateway.periodic")

T = TypeVar("T")


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


class PeriodicEach(Generic[T]):
    """One loop per item, each on its own task: `round_fn(item)` every `interval` seconds,
    counted from the start of one call to the start of the next (a call that takes longer than the
    interval is followed by the next at once). A slow or stuck item delays only its own loop: the
    health prober and the load scraper run one per worker, so a worker that trickles its answer
    cannot hold back the others' rounds. `label(item)` names the item's task.

    `start()` launches the loops on the running event loop; `stop()` cancels and awaits them. An
    exception in one call is logged and that item's loop goes on. Items come and go at run time
    (`add`, `remove`: workers found by discovery or a config reload); items must be hashable.
    """

    def __init__(self, name: str, interval: float, items: Sequence[T], round_fn: Callable[[T], Awaitable[object]],
                 label: Callable[[T], str] = str) -> None:
        self.name = name
        self.interval = interval
        self.items = list(items)
        self.round_fn = round_fn
        self.label = label
        self._tasks: dict[T, asyncio.Task[None]] = {}
        self._started = False

    async def _run(self, item: T) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.round_fn(item)
            except Exception:
                log.exception("%s of %s failed", self.name, self.label(item))
            await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    def _launch(self, item: T) -> None:
        self._tasks[item] = asyncio.create_task(self._run(item), name=f"{self.name}:{self.label(item)}")

    def start(self) -> None:
        self._started = True
        for item in self.items:
            self._launch(item)

    def add(self, item: T) -> None:
        """Loop over `item` too: at once when started (its first round runs now), else from `start()`."""
        if item in self.items:
            return
        self.items.append(item)
        if self._started:
            self._launch(item)

    def remove(self, item: T) -> None:
        """Stop `item`'s loop (cancelled, not awaited: a round in progress ends at its next await)."""
        if item in self.items:
            self.items.remove(item)
        task = self._tasks.pop(item, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        self._started = False
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class FollowsWorkers(Generic[T]):
    """The registry-watcher half shared by tasks that run once per worker on its own schedule (the
    health prober, the load scraper): a worker that joins gets its loop (first round at once); a
    retired one that finished its requests loses it. Subclasses set `loop`."""

    loop: PeriodicEach[T]

    def worker_added(self, worker: T) -> None:
        """A worker joined (discovery, reload): its loop starts."""
        self.loop.add(worker)

    def worker_gone(self, worker: T) -> None:
        """A retired worker finished its requests: its loop stops."""
        self.loop.remove(worker)
