"""The same contract for both affinity stores: in-process and a real Redis (127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.affinity.redis_store import RedisAffinityStore
from gateway.affinity.store import AffinityStore, MemoryAffinityStore
from gateway.config import AffinityConfig
from gateway.metrics import GatewayMetrics
from tests.support import OwnRedis

REDIS_URL = "redis://127.0.0.1:6379/0"


async def settle(store: AffinityStore) -> None:
    """Wait until background writes are applied (Redis writes are asynchronous)."""
    if isinstance(store, RedisAffinityStore):
        for _ in range(100):
            if store._queue.empty():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AffinityStore]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    config = AffinityConfig(key_prefix=prefix, ttl_seconds=2, lookup_timeout=0.5)
    s: AffinityStore
    if request.param == "memory":
        s = MemoryAffinityStore(config.ttl_seconds, max_entries=1000)
    else:
        s = RedisAffinityStore(REDIS_URL, config, GatewayMetrics())
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
async def test_unknown_hashes_have_no_owner(store: AffinityStore) -> None:
    assert await store.lookup("pool", [1, 2, 3]) == [None, None, None]
    assert await store.lookup("pool", []) == []


@pytest.mark.anyio
async def test_recorded_hashes_are_found_per_pool(store: AffinityStore) -> None:
    store.record("pool", [1, 2], "http://w1:8000")
    await settle(store)
    assert await store.lookup("pool", [1, 2, 3]) == ["http://w1:8000", "http://w1:8000", None]
    assert await store.lookup("other-pool", [1, 2]) == [None, None]


@pytest.mark.anyio
async def test_a_new_owner_replaces_the_old(store: AffinityStore) -> None:
    store.record("pool", [7], "http://w1:8000")
    await settle(store)
    store.record("pool", [7], "http://w2:8000")
    await settle(store)
    assert await store.lookup("pool", [7]) == ["http://w2:8000"]


@pytest.mark.anyio
async def test_entries_expire_after_the_ttl_unless_refreshed(store: AffinityStore) -> None:
    store.record("pool", [10, 11], "http://w1:8000")
    await settle(store)
    await asyncio.sleep(1.2)
    store.record("pool", [11], "http://w1:8000")  # reuse refreshes
    await settle(store)
    await asyncio.sleep(1.2)
    assert await store.lookup("pool", [10, 11]) == [None, "http://w1:8000"]


@pytest.mark.anyio
async def test_large_hashes_round_trip(store: AffinityStore) -> None:
    hashes = [2**64 - 1, 0, 2**63]
    store.record("pool", hashes, "http://w3:8000")
    await settle(store)
    assert await store.lookup("pool", hashes) == ["http://w3:8000"] * 3


@pytest.mark.anyio
async def test_memory_store_is_bounded() -> None:
    store = MemoryAffinityStore(ttl_seconds=60, max_entries=100)
    for i in range(50):
        store.record("pool", [i * 10 + j for j in range(10)], "http://w:1")
    assert len(store) == 100
    assert (await store.lookup("pool", [0, 499])) == [None, "http://w:1"]


@pytest.mark.anyio
async def test_unreachable_redis_fails_open_fast(unused_port: int) -> None:
    metrics = GatewayMetrics()
    store = RedisAffinityStore(f"redis://127.0.0.1:{unused_port}/0", AffinityConfig(retry_after=0.2), metrics)
    await store.start()
    try:
        assert await store.lookup("pool", [1, 2]) is None
        assert await store.lookup("pool", [1, 2]) is None  # skipped by the breaker, no new connect
        assert metrics.affinity_lookups.labels("pool", "error")._value.get() == 1
        assert metrics.affinity_lookups.labels("pool", "skipped")._value.get() == 1
        store.record("pool", [1], "http://w:1")  # never raises
    finally:
        await store.stop()


@pytest.mark.anyio
async def test_failed_writes_give_their_connections_back(own_redis: OwnRedis) -> None:
    """A pipelined write that fails (Redis killed) or is cut by its timeout (Redis hung) must return
    its connection to the pool; before the fix each one leaked a connection until the pool ran dry."""
    metrics = GatewayMetrics()
    store = RedisAffinityStore(own_redis.url, AffinityConfig(lookup_timeout=0.05, retry_after=0.1), metrics)
    await store.start()
    try:
        store.record("pool", [1], "http://w:1")
        await settle(store)
        own_redis.kill()
        store.record("pool", [2], "http://w:1")
        await asyncio.sleep(0.3)
        own_redis.start()
        await asyncio.sleep(0.2)
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)  # hung: the write's 0.5 s timeout cuts it
        store.record("pool", [3], "http://w:1")
        await asyncio.sleep(0.8)
        own_redis.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.2)
        assert metrics.redis_errors.labels("write")._value.get() == 2
        assert not store.redis.connection_pool._in_use_connections
        store.record("pool", [9], "http://w:1")  # and writes work again
        await settle(store)
        assert await store.lookup("pool", [9]) is not None
    finally:
        if own_redis.proc is not None:
            own_redis.proc.send_signal(signal.SIGCONT)
        await store.stop()
