"""Operator drains shared by every serving process and replica through Redis (when configured).

Without Redis a drain (admin API) belongs to the process that took the call. With `redis_url`,
the drained workers also live in one Redis set, `{affinity.key_prefix}:drained-urls`, and every
process reads it every `SYNC_EVERY_S` seconds, so `processes: N` and a fleet of gateway replicas
drain together, as an operator of one router expects. The set holds only what operators drained:
a worker leaves it when undrained. A member names a worker by its stable identity,
`shared_key`: `"{pool} {url}"`, the pool's name and the worker's URL as the config (or discovery)
names it, never by its index: indices count the workers each process has met since it started (a
replica that reloaded a changed list numbers them differently from one that started fresh), so an
index would drain a different engine on another replica. The admin routes still take
`{pool}/{index}`; the replica that receives the call resolves it to its worker, and so to its URL.
(Before this key, members were `pool/index` in `{affinity.key_prefix}:drained`; that set is no
longer read, so a rolling upgrade across this change forgets the drains placed before it: the next
preStop drain places them again.) A Redis that cannot be reached leaves each process with the
drain state it last saw (logged; the admin answer says `"shared": false, "store": "redis_down"`, and
such a local-only change is undone by the next sync once Redis answers again: Redis is the source of
truth, so `kimi-gateway drain --undrain` counts such an undrain as not done and is run again).

While a worker is drained, each process also reports its own in-flight count on it at every sync,
as a field `host:pid:random` -> `"count unix-time"` of the hash `{affinity.key_prefix}:inflight:{shared_key}`
(expiring `REPORT_TTL_S` after the last write), so one `GET /admin/workers/{pool}/{index}` answers
for the whole fleet (`fleet_in_flight`): what `kimi-gateway drain` waits on behind a Service that
reaches one replica per call.

A drain holds for the engine it was placed on, not for the address: when the health prober saw the
drained worker's engine answer, then saw it gone at `GONE_PROBES` probes in a row
(`control.engine_gone`: the connection was refused, its name does not exist) and then answer
again, a new engine serves there (a restarted pod, a rolled-out release) and the drain is lifted
(`engine_seen`), shared the same way as an undrain. So a rolling restart whose preStop drains each
engine cannot leave the fleet drained when nothing undrains it. Where the engine tells when its
process started (`process_start_time_seconds` in its `/metrics`: vLLM with one API server; not
SGLang, nor vLLM with several API servers: gateway/backends/load.py `parse_start_time`), the
answers before and after the absence must also name different start times: the same process
refusing connections for a while (a listener blip) keeps its drain. Where it tells none, the
absence is the only evidence, so only a refused connection or a name that does not exist counts
as gone: an unreachable host or network (a network blip) and a timeout never do. A drain placed on
an engine that was already gone holds until that engine has answered, gone and answered again (an
operator keeping a broken engine out stays in control); one probe finding it gone between answers
(a blip) is the same engine, and a slow or failing engine (timeouts, 5xx) is never taken for a new one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from redis.exceptions import RedisError

from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.redis_client import close_redis, redis_from_url

log = logging.getLogger("gateway.drains")

SYNC_EVERY_S = 1.0
CALL_TIMEOUT_S = 0.5  # per call, as a StoreTimeout: a stall of this process' event loop is not Redis' fault
REPORT_FRESH_S = 3 * SYNC_EVERY_S  # an in-flight report older than this is from a process that stopped
REPORT_TTL_S = 30.0  # the report hash outlives its last writer by this much
GONE_PROBES = 2  # probes in a row finding a drained worker's engine gone before a new one may lift the drain

DrainStore = Literal["redis", "redis_down", "local"]
"""Where a drain or undrain was kept: "redis" (every process follows), "redis_down" (Redis is
configured but the write failed: this process only, and its next sync once Redis answers puts back
what Redis holds), "local" (no Redis configured: this process only, for good)."""


def shared_key(worker: Worker) -> str:
    """`worker`'s name in Redis, the same on every replica: `"{pool} {url}"` (module doc)."""
    return f"{worker.pool} {worker.url}"


@dataclass(frozen=True)
class FleetInFlight:
    """The in-flight requests on one drained worker over every process that reported in the last
    `REPORT_FRESH_S` seconds: their sum and how many processes reported."""

    in_flight: int
    reporters: int


class DrainBoard:
    """Sets and reads operator drains: in the registry always, in Redis when `redis_url` is given."""

    def __init__(self, registry: WorkerRegistry, redis_url: str | None, key_prefix: str) -> None:
        self.registry = registry
        self.key = f"{key_prefix}:drained-urls"
        self.report_prefix = f"{key_prefix}:inflight:"
        self.reporter = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # one per board
        self._redis = (redis_from_url(redis_url, socket_timeout=SOCKET_BACKSTOP_S,
                                      socket_connect_timeout=CALL_TIMEOUT_S)
                       if redis_url else None)
        self.loop = Periodic("drain-sync", SYNC_EVERY_S, self.sync)
        self._seen: dict[str, str] = {}
        """Drained worker id -> what the prober saw of its engine since: "up" (answered while
        drained) or "gone" (then gone `GONE_PROBES` times in a row); absent: neither yet (module doc)."""
        self._gone_runs: dict[str, int] = {}
        """Drained worker id -> probes in a row that found its engine gone (while "up" was seen)."""
        self._started: dict[str, float] = {}
        """Drained worker id -> the start time (unix s) its engine told at its last answer (before
        an absence); absent when it told none."""

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def set_draining(self, worker: Worker, draining: bool) -> DrainStore:
        """Drain or undrain `worker` here and, with Redis, everywhere. Returns where it was kept
        (DrainStore): "redis" when every process will see it, else it holds for this process only."""
        self._forget(worker)  # a new drain, or none: what the prober saw before counts no more
        self.registry.set_draining(worker, draining)
        if self._redis is None:
            return "local"
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                if draining:
                    await self._redis.sadd(self.key, shared_key(worker))
                else:
                    await self._redis.srem(self.key, shared_key(worker))
        except (RedisError, OSError) as exc:  # OSError: TimeoutError too
            log.warning("drain of %s applies to this process only: Redis failed (%s)", worker.id, exc)
            return "redis_down"
        return "redis"

    async def engine_seen(self, worker: Worker, up: bool, started: float | None = None) -> None:
        """The health prober's news of `worker`'s engine: it answered (`up`; `started`: the start
        time, unix s, its `/metrics` told then, None when it told none) or is gone (not `up`; only
        `control.engine_gone` failures count). Lifts the worker's drain when its engine answered,
        was gone `GONE_PROBES` times in a row and answers again: a new engine; when both answers
        told a start time, only if they differ (module doc)."""
        if not worker.draining:
            self._forget(worker)
            return
        seen = self._seen.get(worker.id)
        if not up:
            if seen is not None:
                runs = self._gone_runs[worker.id] = self._gone_runs.get(worker.id, 0) + 1
                if runs >= GONE_PROBES:
                    self._seen[worker.id] = "gone"
            return
        self._gone_runs.pop(worker.id, None)
        before = self._started.get(worker.id)
        same_process = before is not None and started is not None and started == before
        if seen != "gone" or same_process:
            self._seen[worker.id] = "up"
            if started is None:
                self._started.pop(worker.id, None)
            else:
                self._started[worker.id] = started
            if seen == "gone":
                log.info("drain of %s holds: its engine refused connections a while and answers again with "
                         "the same process start time (the same engine)", worker.id)
            return
        self._forget(worker)
        shared = await self.set_draining(worker, False) == "redis"
        log.info("drain of %s lifted: its engine went away and a new one answers at %s (%s)", worker.id,
                    worker.url, "every replica follows" if shared else "this process only")

    def _forget(self, worker: Worker) -> None:
        self._seen.pop(worker.id, None)
        self._gone_runs.pop(worker.id, None)
        self._started.pop(worker.id, None)

    async def sync(self) -> None:
        """Take the drain state from Redis (a no-op without it; kept as it was when Redis fails)."""
        if self._redis is None:
            return
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                members = await self._redis.smembers(self.key)
            drained = {member.decode() if isinstance(member, bytes) else member for member in members}
        except (RedisError, OSError) as exc:
            log.debug("drain sync skipped: %s", exc)
            return
        for worker in self.registry:
            if worker.draining != ((key := shared_key(worker)) in drained):
                self._forget(worker)
                self.registry.set_draining(worker, key in drained)
        await self._report_in_flight()

    async def _report_in_flight(self) -> None:
        """Write this process's in-flight count on each drained worker (module doc); a failure is
        logged at debug level and retried at the next sync."""
        assert self._redis is not None
        now = f"{time.time():.3f}"
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                for worker in self.registry:
                    if worker.draining:
                        key = self.report_prefix + shared_key(worker)
                        await self._redis.hset(key, self.reporter, f"{worker.in_flight} {now}")
                        await self._redis.expire(key, int(REPORT_TTL_S))
        except (RedisError, OSError) as exc:
            log.debug("in-flight report skipped: %s", exc)

    async def fleet_in_flight(self, worker: Worker) -> FleetInFlight | None:
        """The fleet's in-flight count on `worker` from the reports in Redis; None without Redis or
        when it cannot answer. Reports exist only for a drained worker (0 reporters otherwise)."""
        if self._redis is None:
            return None
        try:
            async with StoreTimeout(CALL_TIMEOUT_S):
                reports = await self._redis.hgetall(self.report_prefix + shared_key(worker))
        except (RedisError, OSError) as exc:
            log.debug("in-flight reports unreadable: %s", exc)
            return None
        oldest = time.time() - REPORT_FRESH_S
        counts = []
        for value in reports.values():
            count, _, written = (value.decode() if isinstance(value, bytes) else value).partition(" ")
            if float(written) >= oldest:
                counts.append(int(count))
        return FleetInFlight(sum(counts), len(counts))

    async def start(self) -> None:
        if self._redis is not None:
            self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self._redis is not None:
            await close_redis(self._redis, "drains")
