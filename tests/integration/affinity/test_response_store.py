"""The same contract for both stored-response owner stores: in-process and the tests' shared Redis."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.affinity.params import ResponsesConfig
from gateway.affinity.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseOwner,
    ResponseStore,
    ResponseStoreUnavailable,
)
from gateway.auth.keys import Principal
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.response_affinity import may_use
from tests.support import OwnRedis, shared_redis_url

REDIS_URL = shared_redis_url()
TTL_S = 1.0
OWNER = ResponseOwner("pool-a", "http://10.0.0.1:8000")


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResponseStore]:
    prefix = f"test-resp-{uuid.uuid4().hex[:12]}"
    config = ResponsesConfig(key_prefix=prefix, store_ttl=TTL_S, lookup_timeout=0.5, memory_max_entries=3)
    s: ResponseStore = MemoryResponseStore(config) if request.param == "memory" else \
        RedisResponseStore(REDIS_URL, config, GatewayMetrics())
    await s.start()
    yield s
    await s.stop()
    if request.param == "redis":
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.mark.anyio
async def test_record_lookup_forget(store: ResponseStore) -> None:
    assert await store.lookup("resp_unknown") is None
    store.record("resp_1", OWNER)
    store.record("resp_2", ResponseOwner("pool-b", "http://10.0.0.2:8000"))
    await store.flush()
    assert await store.lookup("resp_1") == OWNER
    assert await store.lookup("resp_2") == ResponseOwner("pool-b", "http://10.0.0.2:8000")
    store.forget("resp_1")
    await store.flush()
    assert await store.lookup("resp_1") is None
    assert await store.lookup("resp_2") is not None


@pytest.mark.anyio
async def test_records_expire_after_the_ttl(store: ResponseStore) -> None:
    store.record("resp_ttl", OWNER)
    await store.flush()
    written = time.monotonic()
    assert await store.lookup("resp_ttl") == OWNER
    deadline = written + 5 * TTL_S
    while await store.lookup("resp_ttl") is not None:
        assert time.monotonic() < deadline, "the record did not expire"
        await asyncio.sleep(0.02)
    assert time.monotonic() - written >= TTL_S - 0.05


@pytest.mark.anyio
async def test_memory_store_is_bounded() -> None:
    store = MemoryResponseStore(ResponsesConfig(memory_max_entries=3))
    for i in range(5):
        store.record(f"resp_{i}", OWNER)
    assert len(store) == 3
    assert await store.lookup("resp_0") is None and await store.lookup("resp_4") == OWNER


@pytest.mark.anyio
async def test_unreachable_redis_is_a_retryable_error_and_counted(unused_port: int) -> None:
    metrics = GatewayMetrics()
    store = RedisResponseStore(f"redis://127.0.0.1:{unused_port}/0", ResponsesConfig(lookup_timeout=0.2), metrics)
    await store.start()
    try:
        with pytest.raises(ResponseStoreUnavailable) as failed:
            await store.lookup("resp_x")
        assert failed.value.status == 503 and failed.value.headers["retry-after"] == "1"
        store.record("resp_x", OWNER)  # within `retry_after` of that failure: dropped, Redis not tried
        await store.flush()
    finally:
        await store.stop()
    assert redis_errors(metrics, "response_lookup") == 1 and redis_errors(metrics, "response_write") == 0
    assert metrics.registry.get_sample_value("kimi_gateway_affinity_writes_dropped_total") == 1

def redis_errors(metrics: GatewayMetrics, op: str) -> float:
    return metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": op}) or 0


async def wait_available(store: RedisResponseStore, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.available:
        assert time.monotonic() < deadline, "the breaker did not close"
        await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_a_dead_redis_is_skipped_after_its_first_failure(own_redis: OwnRedis) -> None:
    """The circuit breaker the affinity store has: after a failed call, lookups answer 503 at once
    (Redis is not even tried: no more errors counted) for `retry_after` seconds, then try again."""
    metrics = GatewayMetrics()
    store = RedisResponseStore(own_redis.url, ResponsesConfig(lookup_timeout=0.3, retry_after=0.5), metrics)
    await store.start()
    try:
        store.record("resp_a", OWNER)
        await store.flush()
        assert await store.lookup("resp_a") == OWNER
        for stop in ("killed", "stopped"):  # refused connections, then a Redis that hangs (SIGSTOP)
            if stop == "killed":
                own_redis.kill()
            else:
                assert own_redis.proc is not None
                own_redis.proc.send_signal(signal.SIGSTOP)
            before = redis_errors(metrics, "response_lookup")
            with pytest.raises(ResponseStoreUnavailable):
                await store.lookup("resp_a")
            assert redis_errors(metrics, "response_lookup") == before + 1
            assert not store.available
            for _ in range(20):  # skipped: no call to Redis, so no wait and no error counted
                with pytest.raises(ResponseStoreUnavailable) as skipped:
                    await store.lookup("resp_a")
                assert skipped.value.headers["retry-after"] == "1"
            assert redis_errors(metrics, "response_lookup") == before + 1
            store.record("resp_dropped", OWNER)  # a write while the breaker is open is dropped, not sent
            await store.flush()
            assert redis_errors(metrics, "response_write") == 0
            if stop == "killed":
                own_redis.start()
            else:
                assert own_redis.proc is not None
                own_redis.proc.send_signal(signal.SIGCONT)
            await wait_available(store)
            store.record("resp_b", OWNER)
            await store.flush()
            assert await store.lookup("resp_b") == OWNER
    finally:
        await store.stop()
    assert (metrics.registry.get_sample_value("kimi_gateway_affinity_writes_dropped_total") or 0) >= 2


@pytest.mark.anyio
async def test_the_owning_key_is_stored_with_the_worker(store: ResponseStore) -> None:
    owned = ResponseOwner("pool-a", "http://10.0.0.1:8000", "alice")
    store.record("resp_owned", owned)
    store.record("resp_open", OWNER)  # auth off: no owner
    await store.flush()
    assert await store.lookup("resp_owned") == owned
    assert (await store.lookup("resp_open")) == OWNER and OWNER.principal is None


@pytest.mark.anyio
async def test_a_responses_context_tokens_are_kept_and_replaced_by_the_engines_count(store: ResponseStore) -> None:
    """What a follow-up's prompt holds of a stored response: the estimate recorded with its owner,
    the engine's count once noted; a second owner's record keeps the first's; an unknown or
    forgotten id gets none; a record written before these were kept has none."""
    store.record("resp_ctx", ResponseOwner("pool-a", "http://10.0.0.1:8000", "alice", 5000))
    store.record("resp_ctx", ResponseOwner("pool-b", "http://10.0.0.2:8000", "bob", 7))  # kept: the first
    store.note_context("resp_none", 9)  # never recorded
    await store.flush()
    first = await store.lookup("resp_ctx")
    assert first == ResponseOwner("pool-a", "http://10.0.0.1:8000", "alice") and first.context_tokens == 5000
    store.note_context("resp_ctx", 2047)
    await store.flush()
    noted = await store.lookup("resp_ctx")
    assert noted is not None and noted.context_tokens == 2047
    assert await store.lookup("resp_none") is None
    store.forget("resp_ctx")
    store.note_context("resp_ctx", 3)
    store.record("resp_old", OWNER)  # no count known
    await store.flush()
    assert await store.lookup("resp_ctx") is None
    old = await store.lookup("resp_old")
    assert old == OWNER and old.context_tokens is None
    if isinstance(store, RedisResponseStore):  # nothing left behind by the forgotten id
        assert await store.redis.exists(store.key("resp_ctx"), store.context_key("resp_ctx")) == 0


def test_owner_encoding_and_who_may_use_it() -> None:
    assert ResponseOwner.decode(ResponseOwner("p", "http://w:1", "alice").encode()) == ResponseOwner(
        "p", "http://w:1", "alice")
    # A value written before owners were recorded reads as unowned.
    assert ResponseOwner.decode("p\nhttp://w:1") == ResponseOwner("p", "http://w:1", None)
    assert ResponseOwner.decode("garbage") is None
    alice = Principal("alice", frozenset({"user"}))
    bob = Principal("bob", frozenset({"user"}))
    ops = Principal("ops", frozenset({"user", "admin"}))
    owned, unowned = ResponseOwner("p", "u", "alice"), ResponseOwner("p", "u", None)
    assert may_use(alice, owned) and may_use(ops, owned) and may_use(None, owned)
    assert not may_use(bob, owned)
    assert may_use(ops, unowned) and may_use(None, unowned) and not may_use(alice, unowned)
