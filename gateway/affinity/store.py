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
    """LRU + TTL dicts (one per pool, keyed by the block hash) for a single gateway replica.

    Bounded by `max_entries` over all pools: the least recently written entry goes first.
    """

    def __init__(self, ttl_seconds: float, max_entries: int) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._pools: dict[str, OrderedDict[int, tuple[str, float]]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    async def lookup(self, pool: str, hashes: Sequence[int]) -> list[str | None]:
        entries = self._pools.get(pool)
        if entries is None:
            return [None] * len(hashes)
        now = time.monotonic()
        owners: list[str | None] = []
        for h in hashes:
            entry = entries.get(h)
            owners.append(entry[0] if entry is not None and entry[1] > now else None)
        return owners

    def record(self, pool: str, hashes: Sequence[int], worker: str) -> None:
        entries = self._pools.get(pool)
        if entries is None:
            entries = self._pools[pool] = OrderedDict()
        value = (worker, time.monotonic() + self.ttl)
        before = len(entries)
        for h in hashes:
            entries[h] = value
            entries.move_to_end(h)
        self._size += len(entries) - before
        while self._size > self.max_entries:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Drop the least recently written entry of any pool (the oldest expiry is the oldest write)."""
        oldest = min((e for e in self._pools.values() if e), key=lambda e: next(iter(e.values()))[1])
        oldest.popitem(last=False)
        self._size -= 1

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._pools.clear()
        self._size = 0
