"""Affinity in Redis, shared by every gateway replica (design §5).

Key layout: `{key_prefix}:{pool}:{hash as 16 hex digits}` → worker URL (string), with a TTL of
`ttl_seconds`, rewritten (and so refreshed) each time a request with that prefix is served.
A lookup is one MGET of at most ~97 keys (1M-token prompt); writes go through a bounded queue
to a background task that pipelines them (one round trip per batch), one EVALSHA of `RECORD_LUA`
per request (SET ... PX, the TTL in milliseconds, for each of its keys): packing one SET command per block in redis-py
cost ~0.5 ms of CPU per 16 KiB prompt (33 blocks) in the overhead benchmark. On Redis Cluster the keys
carry a hash tag, `{key_prefix}:{pool}:{{first block's hash}}:{hash}` (`keys`), and the script is sent as
EVAL (its text): one prompt's keys share a slot.

Cost at 1,000 requests/s with ~20 sampled blocks each: 1,000 MGETs/s plus ~20,000 pipelined
SETs/s (about 50 batches/s) — a few percent of one Redis core. Each key is ~60 bytes of key and
value plus Redis' per-key overhead (~70 bytes) ≈ 130 bytes; keys live `ttl_seconds`, so memory is
bounded by the distinct prefix blocks seen in 10 minutes (e.g. 1M distinct blocks ≈ 130 MB).

Failure policy: every call has a hard timeout (`lookup_timeout`) of its own time (a deadline the
event loop passed while busy elsewhere is extended, `gateway/looplag.py`: the gateway's own stalls
are not a Redis outage); any error or timeout is a miss (fail open), counted in
`kimi_gateway_redis_errors_total`, logged at most once per 10 s, and Redis is skipped for
`retry_after` seconds (a simple circuit breaker, `breaker.py`) before it is tried again.
`kimi_gateway_redis_up` follows the breaker; a PING every `PING_EVERY_S` keeps it true when no
request calls Redis (a gauge stuck at 0 after an outage would keep "Redis down" alerts firing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from gateway.affinity.batch_writer import BatchWriter
from gateway.affinity.breaker import CircuitBreaker
from gateway.affinity.params import AffinityConfig
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.redis_client import close_redis, primary_known, redis_from_url
from gateway.redis_cluster import is_cluster_url
from gateway.redis_gate import StoreBusy, StoreGate

log = logging.getLogger("gateway.affinity")

RECORD_LUA = """
for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[1], 'PX', ARGV[2]) end
return #KEYS
"""
LOG_EVERY_S = 10.0
PING_EVERY_S = 5.0
LOOKUP_CONNECTIONS = 128
"""Lookups in flight to Redis (`StoreGate`); one more waits at most `lookup_timeout` for a turn,
then routes as a miss (Redis is not blamed). The writer and the pinger have connections of their own."""

# After Redis restarts, a pooled connection to the old server can fail its next command with
# "connection reset": resend once on a new connection (lookups and the record script are
# idempotent) instead of opening the breaker for a Redis that is up. Timeouts are not resent.
STALE_CONNECTION_RETRY = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


class RedisAffinityStore:
    """The shared store. Construction does no I/O: an unreachable Redis never blocks start-up."""

    def __init__(self, url: str, config: AffinityConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.gate = StoreGate(LOOKUP_CONNECTIONS, config.lookup_timeout)
        self.redis = redis_from_url(  # + the writer's and the pinger's connections
            url, socket_connect_timeout=SOCKET_BACKSTOP_S, socket_timeout=SOCKET_BACKSTOP_S,
            retry=STALE_CONNECTION_RETRY, max_connections=LOOKUP_CONNECTIONS + 2, health_check_interval=0,
        )
        self._writes: BatchWriter[tuple[str, Sequence[int], str]] = BatchWriter(
            self._write, config.write_queue, metrics.affinity_writes_dropped.inc, "affinity-writer")
        self._pinger: asyncio.Task[None] | None = None
        self.breaker = CircuitBreaker(config.retry_after)
        self._up: bool | None = None
        self._up_gauge = metrics.track_redis()
        self._record = self.redis.register_script(RECORD_LUA)
        self.cluster = is_cluster_url(url)
        self._last_log = 0.0

    def key(self, pool: str, h: int) -> str:
        return f"{self.config.key_prefix}:{pool}:{h:016x}"

    def keys(self, pool: str, hashes: Sequence[int]) -> list[str]:
        """The keys of one prompt's sampled blocks `hashes` (chained, the first block's first). On Redis
        Cluster they carry the first block's hash as their hash tag, `{prefix}:{pool}:{{first}}:{hash}`:
        one slot per prompt, so its MGET and record script stay on one node (gateway/redis_cluster.py)."""
        if not self.cluster or not hashes:
            head = f"{self.config.key_prefix}:{pool}:"  # `key`'s, without a call per block
            return [f"{head}{h:016x}" for h in hashes]
        tag = f"{self.config.key_prefix}:{pool}:{{{hashes[0]:016x}}}"
        return [f"{tag}:{h:016x}" for h in hashes]

    def _set_up(self, up: bool) -> None:
        if self._up is not up:
            self._up = up
            self._up_gauge.set(1 if up else 0)

    def _failed(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        self.breaker.trip()
        self._set_up(False)
        self.metrics.redis_error(op)
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("redis %s failed (%s: %s); routing without affinity for %.1fs", op, type(exc).__name__,
                        exc, self.config.retry_after)

    @property
    def available(self) -> bool:
        """False while the circuit breaker skips Redis after an error."""
        return self.breaker.closed

    async def lookup(self, pool: str, hashes: Sequence[int]) -> list[str | None] | None:
        if not hashes:
            return []
        if not self.available:
            self.metrics.affinity_lookup(pool, "skipped")
            return None
        try:
            async with self.gate:
                if not self.available:  # Redis failed while this lookup waited for its turn
                    self.metrics.affinity_lookup(pool, "skipped")
                    return None
                await primary_known(self.redis)
                started = time.perf_counter()
                timer = StoreTimeout(self.config.lookup_timeout)
                try:
                    async with timer:
                        values = await self.redis.mget(self.keys(pool, hashes))
                except (RedisError, OSError, TimeoutError) as exc:
                    # A loop still busy at the deadline, or this reply read late behind other
                    # lookups waiting for a turn, is not Redis' fault.
                    if not timer.expired_late and not self.gate.queued_behind(exc):
                        self._failed("lookup", exc)
                    self.metrics.affinity_lookup(pool, "error")
                    return None
        except StoreBusy:  # the gateway's own lookups fill the pool: a miss, Redis is not blamed
            self.metrics.affinity_lookup(pool, "skipped")
            return None
        self.metrics.redis_call("lookup", time.perf_counter() - started)
        self._set_up(True)
        # The client answers bytes (no decode_responses); redis-py's types also allow str.
        return [v.decode() if isinstance(v, bytes) else v for v in values]

    def record(self, pool: str, hashes: Sequence[int], worker: str) -> None:
        self._writes.put((pool, hashes, worker))

    async def flush(self) -> None:
        """Wait until every queued write has been sent to Redis (or dropped: breaker open, error).

        A no-op when the writer is not running (before `start`, after `stop`)."""
        await self._writes.flush()

    async def _write(self, batch: list[tuple[str, Sequence[int], str]]) -> None:
        """One pipelined round trip for `batch`; failures are counted, never raised."""
        ttl_ms = max(1, round(self.config.ttl_seconds * 1000))
        if not self.available:
            self.metrics.affinity_writes_dropped.inc(len(batch))
            return
        await primary_known(self.redis)
        started = time.perf_counter()
        timer = StoreTimeout(max(self.config.lookup_timeout * 10, 0.5))
        try:
            async with timer:
                try:
                    await self._send(batch, ttl_ms)
                except NoScriptError:  # a new primary (failover), which never ran the script: load it there
                    await self._send(batch, ttl_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            # A write timed out while lookups queue for a turn is read late behind them (the
            # gateway's own burst, `StoreGate.queued_behind`): dropped, but Redis is not blamed.
            if not timer.expired_late and not self.gate.queued_behind(exc):
                self._failed("write", exc)
            return
        self.metrics.redis_call("write", time.perf_counter() - started)
        self._set_up(True)

    async def _send(self, batch: list[tuple[str, Sequence[int], str]], ttl_ms: int) -> None:
        """`batch` in one pipeline. The pipeline checks that the record script is on its connection's
        server first (SCRIPT EXISTS, then LOAD), but a connection that answers READONLY is replaced
        (`STALE_CONNECTION_RETRY`), and the script then runs on a new primary that has not seen it:
        NoScriptError, which the caller answers with one more pipeline."""
        # `async with` resets the pipeline (its connection back to the pool) even when the timeout cuts it.
        async with self.redis.pipeline(transaction=False) as pipe:
            for pool, hashes, worker in batch:
                keys = self.keys(pool, hashes)
                if self.cluster:  # a cluster pipeline sends no SCRIPT LOAD on NOSCRIPT: the script's text
                    pipe.eval(RECORD_LUA, len(keys), *keys, worker, ttl_ms)
                else:
                    await self._record(keys=keys, args=[worker, ttl_ms], client=pipe)
            await pipe.execute()

    async def _ping_forever(self) -> None:
        while True:
            timer = StoreTimeout(max(self.config.lookup_timeout * 10, 0.5))
            try:
                async with timer:
                    await self.redis.ping()
            except (RedisError, OSError, TimeoutError) as exc:
                if not timer.expired_late and not self.gate.queued_behind(exc):
                    self._failed("ping", exc)
            else:
                self._set_up(True)
            await asyncio.sleep(PING_EVERY_S)

    async def start(self) -> None:
        self._writes.start()
        self._pinger = asyncio.create_task(self._ping_forever(), name="affinity-redis-ping")

    async def stop(self) -> None:
        await self._writes.stop()
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pinger
        await close_redis(self.redis, "affinity")
