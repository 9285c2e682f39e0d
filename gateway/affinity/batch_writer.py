"""A bounded queue of writes sent to Redis in batches by one background task: the affinity store's
block records and the stored-response store's owner records share it. The request path only
enqueues (no await); a full queue drops the write and says so, since both records only steer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")

WRITE_BATCH = 64  # items per pipelined round trip


class BatchWriter(Generic[Item]):
    """Queues items (at most `capacity`) and awaits `write(batch)` with up to WRITE_BATCH of them at a
    time from one task. `write` must count its own failures and never raise; `dropped(n)` is told
    of items refused by a full queue."""

    def __init__(self, write: Callable[[list[Item]], Awaitable[None]], capacity: int,
                 dropped: Callable[[int], None], name: str) -> None:
        self._write = write
        self._dropped = dropped
        self._name = name
        self._queue: asyncio.Queue[Item] = asyncio.Queue(capacity)
        self._task: asyncio.Task[None] | None = None

    def put(self, item: Item) -> None:
        """Enqueue `item` without waiting; dropped (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._dropped(1)

    async def flush(self) -> None:
        """Wait until every queued item has been written (or its write failed). A no-op when the
        writer is not running (before `start`, after `stop`)."""
        task = self._task
        if task is None or task.done():
            return
        joined = asyncio.ensure_future(self._queue.join())
        try:  # a writer stopped meanwhile never drains the queue: do not wait for it then
            await asyncio.wait({joined, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            joined.cancel()

    def start(self) -> None:
        """Start the background task (in the running loop)."""
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self, flush: bool = False) -> None:
        """Stop the task, after writing what is queued when `flush`."""
        if self._task is None:
            return
        if flush:
            await self.flush()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < WRITE_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._write(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()
