"""Operator drains shared by every serving process and replica through Redis (when configured).

Without Redis a drain (admin API) belongs to the process that took the call. With `redis_url`,
the drained worker ids also live in one Redis set, `{affinity.key_prefix}:drained`, and every
process reads it every `SYNC_EVERY_S` seconds, so `processes: N` and a fleet of gateway replicas
drain together, as an operator of one router expects. The set holds only what operators drained:
a worker leaves it when undrained. A Redis that cannot be reached leaves each process with the
drain state it last saw (logged; the admin answer says `"shared": false`, and such a local-only
change is undone by the next sync once Redis answers again: Redis is the source of truth).
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.redis_client import close_redis, redis_from_url

log = logging.getLogger("gateway.drains")

SYNC_EVERY_S = 1.0
CALL_TIMEOUT_S = 0.5  # per call, as a StoreTimeout: a stall of this process' event loop is not Redis' fault


class DrainBoard:
    """Sets and reads operator drains: in the registry always, in Redis when `redis_url` is given."""

    def __init__(self, registry: WorkerRegistry, redis_url: str | None, key_prefix: str) -> None:
        self.registry = registry
        self.key = f"{key_prefix}:drained"
        self._redis = (redis_from_url(redis_url, socket_timeout=SOCKET_BACKSTOP_S,
                                      socket_connect_timeout=CALL_TIMEOUT_S)
                       if redis_url else None)
        self.loop = Periodic("drain-sync", SYNC_EVERY_S, self.sync)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def set_draining(self, worker: Worker, draining: bool) -> bool:
        """Drain or undrain `worker` here and, with Redis, everywhere. Returns True when every
        process will see it (written to Redis), False when it holds for this process only."""
        self.registry.set_draining(worker, draining)
        if self._redis is None:
            return False
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                if draining:
                    await self._redis.sadd(self.key, worker.id)
                else:
                    await self._redis.srem(self.key, worker.id)
        except (RedisError, OSError) as exc:  # OSError: TimeoutError too
            log.warning("drain of %s applies to this process only: Redis failed (%s)", worker.id, exc)
            return False
        return True

    async def sync(self) -> None:
        """Take the drain state from Redis (a no-op without it; kept as it was when Redis fails)."""
        if self._redis is None:
            return
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                members = await self._redis.smembers(self.key)
            drained = {member.decode() for member in members}
        except (RedisError, OSError) as exc:
            log.debug("drain sync skipped: %s", exc)
            return
        for worker in self.registry:
            if worker.draining != (worker.id in drained):
                self.registry.set_draining(worker, worker.id in drained)

    async def start(self) -> None:
        if self._redis is not None:
            self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self._redis is not None:
            await close_redis(self._redis, "drains")
