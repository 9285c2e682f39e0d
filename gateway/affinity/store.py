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

import xxhash


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

    async def flush(self) -> None:
        """Return once every `record` made before the call has been applied or dropped (a barrier
        for tests and shutdown; never raises)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class MemoryAffinityStore:
    """One LRU + TTL dict for a single gateway replica, bounded by `max_entries`.

    Keys are ints: the block hash XOR a per-pool salt (the pool name's xxh64), so pools never share
    an entry (a collision needs two 64-bit hashes to meet) and eviction is one `popitem`.
    """

    def __init__(self, ttl_seconds: float, max_entries: int) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._salts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _salt(self, pool: str) -> int:
        salt = self._salts.get(pool)
        if salt is None:
            salt = self._salts[pool] = xxhash.xxh64_intdigest(pool.encode())
        return salt

    async def lookup(self, pool: str, hashes: Sequence[int]) -> list[str | None]:
        salt, entries, now = self._salt(pool), self._entries, time.monotonic()
        owners: list[str | None] = []
        for h in hashes:
            entry = entries.get(h ^ salt)
            owners.append(entry[0] if entry is not None and entry[1] > now else None)
        return owners

    def record(self, pool: str, hashes: Sequence[int], worker: str) -> None:
        salt, entries = self._salt(pool), self._entries
        value = (worker, time.monotonic() + self.ttl)
        for h in hashes:
            key = h ^ salt
            entries[key] = value
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    async def flush(self) -> None:
        return None  # `record` writes at once

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._entries.clear()
