"""Stored-response affinity: response id → the (pool, worker URL) that created it.

Engines keep stored Responses in their own process memory (vLLM's `response_store` dict, SGLang's
copy of it), so a request with `previous_response_id` and `GET/DELETE/cancel /v1/responses/{id}`
must reach the worker that created the response. The gateway records the owner when it accepts the
engine's answer (the id is in the first stream event `response.created`, or in the JSON body).

Each record also keeps the response's size as a follow-up's prompt holds it (`ResponseOwner.context_tokens`):
an engine prefills a `previous_response_id` follow-up with the whole stored conversation, so the
gateway reserves a key's tokens for it before the request is sent (`ProxyService.handle`).

Two stores behind one interface, like the prefix-affinity stores (`store.py`, `redis_store.py`):
in-process (one replica; an LRU + TTL dict), or Redis when `redis_url` is set (shared by every
replica). Redis layout: `{responses.key_prefix}:{response id}` → `{pool}\\n{worker URL}\\n{key
name}` (the key name empty when auth was off; a value without that line, written before owners
were recorded, reads as unowned), and `{responses.key_prefix}:ctx:{response id}` → its context
tokens (decimal; absent for a record written before they were kept), both with a TTL of
`responses.store_ttl` seconds (the engine itself never forgets, but a conversation idle for longer
is assumed over). Writes are queued and written by a background task (`flush()` waits for them:
a barrier for tests and shutdown); a lookup is one round trip (its two GETs pipelined) with a hard
timeout, at most `LOOKUP_CONNECTIONS` of them in flight (more wait up to `redis_gate.WAIT_S` for
a turn, then that lookup alone answers 503, and Redis is not blamed, as when it times out while
others wait for a turn: the loop reads a flood's replies late); the writer has a connection of its
own, so a flood of lookups never delays or drops a write (issue 25 §5).

A Redis error or timeout (counted in
`kimi_gateway_redis_errors_total{op="response_lookup"|"response_write"}`) fails the lookup with
ResponseStoreUnavailable (503, retryable): the response may well exist, so "not found" would be a
lie, and no other worker could serve it anyway. After a failure Redis is skipped for
`responses.retry_after` seconds (the affinity store's circuit breaker, `breaker.py`): lookups
answer the 503 at once instead of each waiting `lookup_timeout` on a Redis that hangs, and writes
are dropped (`kimi_gateway_affinity_writes_dropped_total`); only calls actually made count in
`kimi_gateway_redis_errors_total`. A deadline missed because the event loop itself was busy
(`looplag.StoreTimeout.expired_late`) fails that call but does not trip the breaker.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Protocol

from redis.exceptions import RedisError

from gateway.affinity.batch_writer import BatchWriter
from gateway.affinity.breaker import CircuitBreaker
from gateway.affinity.params import ResponsesConfig
from gateway.affinity.redis_store import STALE_CONNECTION_RETRY
from gateway.errors import GatewayError
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.redis_client import close_redis, primary_known, redis_from_url
from gateway.redis_gate import WAIT_S, StoreBusy, StoreGate

log = logging.getLogger("gateway.affinity")

LOOKUP_CONNECTIONS = 32
"""Lookups in flight to Redis (`StoreGate`, waiting up to `redis_gate.WAIT_S` for a turn); the
pool holds one connection more, the writer's, so lookups never starve the writes."""


class ResponseStoreUnavailable(GatewayError):
    """503 `response_store_unavailable`: the shared store (Redis) could not say which worker holds it."""

    status = 503
    error_type = "server_error"
    code = "response_store_unavailable"


@dataclass(frozen=True, slots=True)
class ResponseOwner:
    """Where a stored response lives and whose it is: its pool's name, its worker's URL (stable across
    replicas) and `principal`, the configured name of the API key that created it (`auth.keys[].name`,
    never the key; None when auth was off). Key names match `^[A-Za-z0-9_.-]{1,64}$`, so the
    newline-separated encoding is unambiguous.

    `context_tokens`: the tokens of the conversation the engine stores under this response, which a
    `previous_response_id` follow-up's prompt starts with (vLLM prepends the stored messages and the
    stored output: `_render_resolved_response_inputs` in vllm/entrypoints/openai/responses/serving.py):
    the engine's `input_tokens + output_tokens` once its usage came, until then the gateway's
    estimate of its prompt plus the output limit it reserved (an upper bound); None when unknown (a
    record written before these were kept). Not part of the owner's identity (`==`, `encode`)."""

    pool: str
    worker_url: str
    principal: str | None = None
    context_tokens: int | None = field(default=None, compare=False)

    def encode(self) -> str:
        return f"{self.pool}\n{self.worker_url}\n{self.principal or ''}"

    @staticmethod
    def decode(value: str) -> ResponseOwner | None:
        pool, sep, rest = value.partition("\n")
        url, _, principal = rest.partition("\n")
        return ResponseOwner(pool, url, principal or None) if sep and pool and url else None


class ResponseStore(Protocol):
    """Response id → owner. `lookup` answers None for an unknown id and raises only
    ResponseStoreUnavailable; `record`, `note_context` and `forget` are fire-and-forget, applied in
    order. A recorded id never changes owner: `record` of an id already recorded (and not expired or
    forgotten) keeps the first record (Redis `SET NX`), its context tokens too, so an engine answering
    an id it was made to reuse cannot hand another tenant's response, and its history, to the caller.
    `note_context` replaces a recorded response's context tokens (the engine's count, once its usage
    came); it does nothing for an id not recorded."""

    async def lookup(self, response_id: str) -> ResponseOwner | None: ...

    def record(self, response_id: str, owner: ResponseOwner) -> None: ...

    def note_context(self, response_id: str, tokens: int) -> None: ...

    def forget(self, response_id: str) -> None: ...

    async def flush(self) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class MemoryResponseStore:
    """One LRU + TTL dict for a single replica, bounded by `memory_max_entries`."""

    def __init__(self, config: ResponsesConfig) -> None:
        self.ttl = config.store_ttl
        self.max_entries = config.memory_max_entries
        self._entries: OrderedDict[str, tuple[ResponseOwner, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def lookup(self, response_id: str) -> ResponseOwner | None:
        entry = self._entries.get(response_id)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    def record(self, response_id: str, owner: ResponseOwner) -> None:
        now = time.monotonic()
        entry = self._entries.get(response_id)
        if entry is not None and entry[1] > now:
            if entry[0] != owner:
                log.warning("response %s already belongs to another owner; not recorded again", response_id[:64])
            return
        self._entries[response_id] = (owner, now + self.ttl)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def note_context(self, response_id: str, tokens: int) -> None:
        entry = self._entries.get(response_id)
        if entry is not None and entry[1] > time.monotonic():
            self._entries[response_id] = (replace(entry[0], context_tokens=tokens), entry[1])

    def forget(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    async def flush(self) -> None:
        return None  # `record`, `note_context` and `forget` apply at once

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._entries.clear()


class RedisResponseStore:
    """The shared store (module docstring). Construction does no I/O."""

    def __init__(self, url: str, config: ResponsesConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.gate = StoreGate(LOOKUP_CONNECTIONS, WAIT_S)
        self.redis = redis_from_url(url, socket_connect_timeout=SOCKET_BACKSTOP_S,
                                    socket_timeout=SOCKET_BACKSTOP_S, retry=STALE_CONNECTION_RETRY,
                                    max_connections=LOOKUP_CONNECTIONS + 1, health_check_interval=0)
        self._writes: BatchWriter[tuple[str, ResponseOwner | int | None]] = BatchWriter(
            self._write, config.write_queue, metrics.affinity_writes_dropped.inc, "response-store-writer")
        self._last_log = 0.0
        self.breaker = CircuitBreaker(config.retry_after)

    def key(self, response_id: str) -> str:
        return f"{self.config.key_prefix}:{response_id}"

    def context_key(self, response_id: str) -> str:
        """The key of a response's context tokens (`ResponseOwner.context_tokens`)."""
        return f"{self.config.key_prefix}:ctx:{response_id}"

    @property
    def available(self) -> bool:
        """False while the circuit breaker skips Redis after an error."""
        return self.breaker.closed

    def _failed(self, op: str, exc: BaseException, timer: StoreTimeout) -> None:
        # A loop still busy at the deadline, or a timeout while lookups queue for a turn (the write or
        # lookup was read late behind them: `StoreGate.queued_behind`), is not Redis' fault.
        if not timer.expired_late and not self.gate.queued_behind(exc):
            self.breaker.trip()
        self.metrics.redis_error(op)
        self._log_at_most_every_10s(f"redis {op} failed ({type(exc).__name__}: {exc})")

    def _log_at_most_every_10s(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning("%s", message)

    async def lookup(self, response_id: str) -> ResponseOwner | None:
        if not self.breaker.closed:  # Redis failed moments ago: answer at once, do not wait on it again
            raise self._unavailable()
        try:
            async with self.gate:
                if not self.breaker.closed:  # Redis failed while this lookup waited for its turn
                    raise self._unavailable()
                await primary_known(self.redis)
                timer = StoreTimeout(self.config.lookup_timeout)
                try:
                    async with timer, self.redis.pipeline(transaction=False) as pipe:
                        pipe.get(self.key(response_id))
                        pipe.get(self.context_key(response_id))
                        value, context = await pipe.execute()
                except (RedisError, OSError, TimeoutError) as exc:
                    if self.gate.queued_behind(exc):
                        self._log_at_most_every_10s(f"redis response_lookup not answered in time with "
                                                    f"{self.gate.waiting} more queued: that lookup alone fails")
                        raise self._unavailable() from None
                    self._failed("response_lookup", exc, timer)
                    raise self._unavailable() from None
        except StoreBusy as exc:  # the gateway's own lookups fill the pool: this one fails, Redis is fine
            self._log_at_most_every_10s(f"redis response_lookup not sent: {exc}")
            raise self._unavailable() from None
        if value is None:
            return None
        owner = ResponseOwner.decode(value.decode() if isinstance(value, bytes) else value)
        if owner is None or context is None:
            return owner
        tokens = int(context) if context.isdigit() else None
        return owner if tokens is None else replace(owner, context_tokens=tokens)

    def _unavailable(self) -> ResponseStoreUnavailable:
        retry = max(1, math.ceil(self.config.retry_after))
        return ResponseStoreUnavailable("The gateway's response store (Redis) did not answer; it cannot tell which "
                                        "worker holds this response now. Try again shortly.",
                                        headers={"retry-after": str(retry)})

    def record(self, response_id: str, owner: ResponseOwner) -> None:
        self._writes.put((response_id, owner))

    def note_context(self, response_id: str, tokens: int) -> None:
        self._writes.put((response_id, tokens))

    def forget(self, response_id: str) -> None:
        self._writes.put((response_id, None))

    async def flush(self) -> None:
        """Wait until every queued write was sent (or failed); a no-op when the writer is not running."""
        await self._writes.flush()

    async def _write(self, batch: list[tuple[str, ResponseOwner | int | None]]) -> None:
        ttl_ms = max(1, round(self.config.store_ttl * 1000))
        if not self.breaker.closed:
            self.metrics.affinity_writes_dropped.inc(len(batch))
            return
        await primary_known(self.redis)
        timer = StoreTimeout(max(self.config.lookup_timeout * 10, 0.5))
        try:
            async with timer, self.redis.pipeline(transaction=False) as pipe:
                for response_id, write in batch:
                    if write is None:
                        pipe.delete(self.key(response_id))  # one key a command: a cluster holds them on two slots
                        pipe.delete(self.context_key(response_id))
                    elif isinstance(write, int):  # the engine's count replaces the estimate, of a recorded id only
                        pipe.set(self.context_key(response_id), write, px=ttl_ms, xx=True)
                    else:
                        pipe.set(self.key(response_id), write.encode(), px=ttl_ms, nx=True)  # never a new owner
                        if write.context_tokens is not None:
                            pipe.set(self.context_key(response_id), write.context_tokens, px=ttl_ms, nx=True)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("response_write", exc, timer)

    async def start(self) -> None:
        self._writes.start()

    async def stop(self) -> None:
        await self._writes.stop(flush=True)
        await close_redis(self.redis, "responses")


def build_response_store(redis_url: str | None, config: ResponsesConfig, metrics: GatewayMetrics) -> ResponseStore:
    """Redis when `redis_url` is set (shared by replicas), else in-process."""
    if redis_url:
        return RedisResponseStore(redis_url, config, metrics)
    return MemoryResponseStore(config)
