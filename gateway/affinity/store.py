"""The affinity store interface and its in-process implementation (one replica, no Redis).

A store maps (pool, block hash) → the worker URL that last served a prompt with that prefix.
Lookups are one call for all sampled hashes of a prompt; records are fire-and-forget so the
first token never waits for them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class AffinityStore(Protocol):
    """Where block hashes → worker live. Implementations never raise from `lookup`/`record`."""

    async def lookup(self, pool: str, hashes: Sequence[int]) -> list[str | None] | None:
        """The owner of each hash (None where unknown), in order; None when the store could not
        answer (error, timeout, circuit open: the implementation counts it) so routing goes on
        without affinity."""
        ...

    def record(self, pool: str, hashes: Sequence[int], worker: str) -> None:
        """Make `worker` the owner of `hashes` (and refresh their TTL), in the background."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class MemoryAffinityStore:
    """LRU + TTL dict for a single gateway replica. Bounded by `max_entries`."""

    def __init__(self, ttl_seconds: float, max_entries: int) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def lookup(self, pool: str, hashes: Sequence[int]) -> list[str | None]:
        now = time.monotonic()
        owners: list[str | None] = []
        entries = self._entries
        for h in hashes:
            entry = entries.get((pool, h))
            if entry is None or entry[1] <= now:
                owners.append(None)
            else:
                owners.append(entry[0])
        return owners

    def record(self, pool: str, hashes: Sequence[int], worker: str) -> None:
        expires = time.monotonic() + self.ttl
        entries = self._entries
        for h in hashes:
            key = (pool, h)
            entries[key] = (worker, expires)
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._entries.clear()
