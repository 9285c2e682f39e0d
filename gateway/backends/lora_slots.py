"""How the on-demand LoRA adapters on each worker are used, across every replica and serving
process: what `lora_evict: lru` unloads (gateway/backends/lora_loader.py) is judged by the fleet's
use, not one process's.

Which adapters a worker has loaded, and which of them are the gateway's to unload, follows the
engine's own list and the configuration (`WorkerRegistry.set_adapters`; the loader reads the list
again before it plans a load): whichever replica loaded one, before or after a restart, any
replica may unload it. What one process cannot see is the others' use of them. With `redis_url`,
each worker's use lives in three sorted sets keyed by the worker's URL (the engine, whatever pool
names it), under `{affinity.key_prefix}:lora:{<url>}:` (one Redis Cluster hash slot per worker):

- `loaded`: adapter -> when a replica loaded it there (unix s), written by the loading replica
  before its request goes on (`LoraSlots.loaded`), removed by the replica that unloads it;
- `used`: adapter -> when a request for it last started or ended there in some replica (unix s);
- `busy`: `"<adapter>\\x00<reporter>"` -> until when (unix s) that replica has a request for it in
  flight there; an entry not renewed within `BUSY_TTL_S` (a replica that died) stops counting.

Every process writes its own use once every `SYNC_EVERY_S` (`LoraSlots.sync`: the `used` times
that changed, `busy` renewed while it has requests in flight, removed when it has none). Until a
load's first use is written the adapter counts as fresh (`lora_loader.eviction_choice`: loaded
within the pool's `queue_timeout`, no use since), so for that long no replica unloads it; a
request for an older adapter that another replica started less than `SYNC_EVERY_S` ago may not be
seen yet: its engine still ends it
(vLLM drops only the name, vllm/entrypoints/openai/models/serving.py `unload_lora_adapter`; SGLang
waits for the adapter's running requests, python/sglang/srt/lora/lora_registry.py
`wait_for_unload`), and a replica whose next request finds the adapter gone loads it again
(gateway/dispatch/service.py). Each key expires `KEY_TTL_S` after its last write. A Redis that
cannot be reached leaves each process with its own use (logged at debug level). Without Redis, a
process knows its own use only.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.redis_client import close_redis, redis_from_url

log = logging.getLogger("gateway.lora")

SYNC_EVERY_S = 0.25
BUSY_TTL_S = 10.0
CALL_TIMEOUT_S = 0.5  # per round of calls, as a StoreTimeout (a stalled event loop is not Redis' fault)
KEY_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class SlotUse:
    """What is known of the LoRA adapters on one worker, times in unix seconds: `loaded_at` when
    one was loaded (absent: unknown, long ago), `used_at` when a request for it last started or
    ended there, `busy` those with a request in flight there."""

    loaded_at: Mapping[str, float]
    used_at: Mapping[str, float]
    busy: frozenset[str]

    def merged(self, other: SlotUse) -> SlotUse:
        """Both views together: the later of each time, the union of `busy`."""
        def later(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
            out = dict(a)
            for name, at in b.items():
                out[name] = max(at, out.get(name, -math.inf))
            return out
        return SlotUse(later(self.loaded_at, other.loaded_at), later(self.used_at, other.used_at),
                       self.busy | other.busy)


NO_USE = SlotUse({}, {}, frozenset())


def local_use(worker: Worker, wall_offset: float | None = None) -> SlotUse:
    """This process's own use of `worker`'s adapters (`Worker.on_demand`, `adapter_used_at`,
    `adapter_in_flight`), its monotonic times moved to unix seconds by `wall_offset` (time.time() -
    time.monotonic(); None: now's)."""
    offset = time.time() - time.monotonic() if wall_offset is None else wall_offset
    return SlotUse({name: at + offset for name, (_, at) in worker.on_demand.items() if math.isfinite(at)},
                   {name: at + offset for name, at in worker.adapter_used_at.items()},
                   frozenset(name for name, count in worker.adapter_in_flight.items() if count > 0))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _scores(members: Any) -> dict[str, float]:
    """A `ZRANGE ... WITHSCORES` answer (member, score) pairs as member -> score."""
    return {_text(member): float(score) for member, score in members}


class LoraSlots:
    """The fleet's use of on-demand adapters (module docstring): Redis with `redis_url`, else this
    process's own. `key_prefix` is `affinity.key_prefix`."""

    def __init__(self, registry: WorkerRegistry, redis_url: str | None, key_prefix: str) -> None:
        self.registry = registry
        self.prefix = f"{key_prefix}:lora:"
        self.reporter = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._redis = (redis_from_url(redis_url, socket_timeout=SOCKET_BACKSTOP_S,
                                      socket_connect_timeout=SOCKET_BACKSTOP_S)
                       if redis_url else None)
        self.loop = Periodic("lora-use-sync", SYNC_EVERY_S, self.sync)
        self._used_written: dict[tuple[str, str], float] = {}
        """(worker URL, adapter) -> the `used` time (monotonic s) this process wrote last."""
        self._busy_written: set[tuple[str, str]] = set()
        """(worker URL, adapter) whose `busy` entry of this process is in Redis."""

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def key(self, worker: Worker, kind: str) -> str:
        """`worker`'s sorted set `kind` (`loaded`, `used`, `busy`)."""
        return f"{self.prefix}{{{worker.url}}}:{kind}"

    async def fleet_use(self, worker: Worker) -> SlotUse:
        """The other replicas' use of `worker`'s adapters as Redis has it (this process's own
        entries included; merge with `local_use` for what happened since its last sync). NO_USE
        without Redis or when it cannot answer."""
        if self._redis is None:
            return NO_USE
        now = time.time()
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                loaded = await self._redis.zrange(self.key(worker, "loaded"), 0, -1, withscores=True)
                used = await self._redis.zrange(self.key(worker, "used"), 0, -1, withscores=True)
                busy = await self._redis.zrangebyscore(self.key(worker, "busy"), now, "+inf")
                await self._redis.zremrangebyscore(self.key(worker, "busy"), "-inf", now)
        except (RedisError, OSError) as exc:  # OSError: TimeoutError too
            log.debug("LoRA adapter use on %s not read from Redis: %s", worker.id, exc)
            return NO_USE
        return SlotUse(_scores(loaded), _scores(used), frozenset(_text(member).partition("\x00")[0] for member in busy))

    async def loaded(self, worker: Worker, adapter: str) -> None:
        """`adapter` was loaded on `worker` (by this process, `Worker.on_demand` says when): every
        replica sees it fresh until a request's use of it is written (`sync`)."""
        _, at = worker.on_demand.get(adapter, ("", time.monotonic()))
        await self._write(worker, [("zadd", "loaded", {adapter: at + time.time() - time.monotonic()})],
                          f"load of {adapter}")

    async def unloaded(self, worker: Worker, adapter: str) -> None:
        """`adapter` was unloaded from `worker` (by this process): its load and use are forgotten."""
        self._used_written.pop((worker.url, adapter), None)
        await self._write(worker, [("zrem", "loaded", adapter), ("zrem", "used", adapter)], f"unload of {adapter}")

    async def _write(self, worker: Worker, calls: list[tuple[str, str, object]], what: str) -> None:
        if self._redis is None:
            return
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                for method, kind, argument in calls:
                    await getattr(self._redis, method)(self.key(worker, kind), argument)
                    await self._redis.expire(self.key(worker, kind), KEY_TTL_S)
        except (RedisError, OSError) as exc:
            log.debug("LoRA %s on %s not written to Redis: %s", what, worker.id, exc)

    async def sync(self) -> None:
        """Write this process's use of every worker's on-demand adapters (module docstring): the
        `used` times that changed since the last sync, `busy` renewed for those with a request in
        flight, removed for those without. A failure is logged at debug level and the next sync
        writes again."""
        if self._redis is None:
            return
        now, offset = time.time(), time.time() - time.monotonic()
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                for worker in self.registry:
                    await self._sync_worker(worker, now, offset)
        except (RedisError, OSError) as exc:
            log.debug("LoRA adapter use not written to Redis: %s", exc)

    async def _sync_worker(self, worker: Worker, now: float, offset: float) -> None:
        assert self._redis is not None
        url = worker.url
        busy = {name for name, count in worker.adapter_in_flight.items() if count > 0 and name in worker.on_demand}
        written = {name for (at_url, name) in self._busy_written if at_url == url}
        if busy:
            await self._redis.zadd(self.key(worker, "busy"),
                                   {f"{name}\x00{self.reporter}": now + BUSY_TTL_S for name in busy})
            await self._redis.expire(self.key(worker, "busy"), KEY_TTL_S)
        for name in written - busy:
            await self._redis.zrem(self.key(worker, "busy"), f"{name}\x00{self.reporter}")
        self._busy_written = {entry for entry in self._busy_written if entry[0] != url} | {(url, n) for n in busy}
        changed = {name: at for name, at in worker.adapter_used_at.items()  # the load itself is no use
                   if name in worker.on_demand and at != worker.on_demand[name][1]
                   and self._used_written.get((url, name)) != at}
        if changed:
            await self._redis.zadd(self.key(worker, "used"), {name: at + offset for name, at in changed.items()})
            await self._redis.expire(self.key(worker, "used"), KEY_TTL_S)
            self._used_written.update({(url, name): at for name, at in changed.items()})

    async def start(self) -> None:
        if self._redis is not None:
            self.loop.start()

    async def stop(self) -> None:
        """Stop syncing, after a last sync (its last uses written); this process's `busy` entries
        are removed (its requests are over)."""
        await self.loop.stop()
        if self._redis is None:
            return
        await self.sync()
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                for url, name in self._busy_written:
                    await self._redis.zrem(f"{self.prefix}{{{url}}}:busy", f"{name}\x00{self.reporter}")
        except (RedisError, OSError) as exc:
            log.debug("LoRA busy entries left to expire: %s", exc)
        await close_redis(self._redis, "lora slots")
