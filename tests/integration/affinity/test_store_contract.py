"""The same contract for both affinity stores: in-process and the tests' shared Redis."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from gateway.affinity.params import AffinityConfig
from gateway.affinity.redis_store import RedisAffinityStore
from gateway.affinity.store import AffinityStore, MemoryAffinityStore
from gateway.observability.metrics import GatewayMetrics
from tests.support import OwnRedis, shared_redis_url

REDIS_URL = shared_redis_url()


TTL_S = 0.5


async def poll(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Wait until `check()` is true, polling every 10 ms; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    """A counter's value through the registry's public API (0 when the child does not exist yet)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AffinityStore]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    config = AffinityConfig(key_prefix=prefix, ttl_seconds=TTL_S, lookup_timeout=0.5)
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
    await store.flush()
    assert await store.lookup("pool", [1, 2, 3]) == ["http://w1:8000", "http://w1:8000", None]
    assert await store.lookup("other-pool", [1, 2]) == [None, None]


@pytest.mark.anyio
async def test_a_new_owner_replaces_the_old(store: AffinityStore) -> None:
    store.record("pool", [7], "http://w1:8000")
    await store.flush()
    store.record("pool", [7], "http://w2:8000")
    await store.flush()
    assert await store.lookup("pool", [7]) == ["http://w2:8000"]


@pytest.mark.anyio
async def test_entries_expire_after_the_ttl_unless_refreshed(store: AffinityStore) -> None:
    store.record("pool", [10, 11], "http://w1:8000")
    await store.flush()
    written = time.monotonic()
    await asyncio.sleep(TTL_S / 2)  # the TTL's length is what is under test: half of it passes
    assert await store.lookup("pool", [10, 11]) == ["http://w1:8000"] * 2  # not expired early
    store.record("pool", [11], "http://w1:8000")  # reuse refreshes
    await store.flush()

    async def gone() -> bool:
        return (await store.lookup("pool", [10]))[0] is None  # type: ignore[index]

    await poll(gone)
    assert time.monotonic() - written >= TTL_S - 0.05  # Redis' expiry is exact to ~1 ms
    assert await store.lookup("pool", [11]) == ["http://w1:8000"]  # refreshed half a TTL later: still there


@pytest.mark.anyio
async def test_large_hashes_round_trip(store: AffinityStore) -> None:
    hashes = [2**64 - 1, 0, 2**63]
    store.record("pool", hashes, "http://w3:8000")
    await store.flush()
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
        lookups = "kimi_gateway_affinity_lookups_total"
        assert sample(metrics, lookups, pool="pool", result="error") == 1
        assert sample(metrics, lookups, pool="pool", result="skipped") == 1
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
        await store.flush()
        own_redis.kill()
        store.record("pool", [2], "http://w:1")
        await store.flush()  # the write failed (connection refused)
        assert sample(metrics, "kimi_gateway_redis_errors_total", op="write") == 1
        own_redis.start()  # returns once Redis answers PING

        async def breaker_closed() -> bool:
            return store.available

        await poll(breaker_closed)
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)  # hung: the write's 0.5 s timeout cuts it
        store.record("pool", [3], "http://w:1")
        await store.flush()
        own_redis.proc.send_signal(signal.SIGCONT)
        assert sample(metrics, "kimi_gateway_redis_errors_total", op="write") == 2
        assert not store.redis.connection_pool._in_use_connections  # redis-py has no public count (8.1)
        await poll(breaker_closed)
        store.record("pool", [9], "http://w:1")  # and writes work again
        await store.flush()
        assert await store.lookup("pool", [9]) is not None
    finally:
        if own_redis.proc is not None:
            own_redis.proc.send_signal(signal.SIGCONT)
        await store.stop()


@pytest.mark.anyio
async def test_flush_waits_for_a_slow_redis(own_redis: OwnRedis) -> None:
    """`flush()` is a barrier, not a guess: with Redis stalled for 0.3 s (a fixed 50 ms sleep would
    have looked too early), the write is visible as soon as flush returns."""
    store = RedisAffinityStore(own_redis.url, AffinityConfig(lookup_timeout=0.2), GatewayMetrics())
    await store.start()
    assert own_redis.proc is not None
    proc = own_redis.proc
    try:
        assert await store.lookup("pool", [1]) == [None]  # connected
        proc.send_signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.3, proc.send_signal, signal.SIGCONT)
        started = time.monotonic()
        for h in range(5):
            store.record("pool", [h], f"http://w{h}:1")
        await store.flush()
        assert time.monotonic() - started >= 0.25
        assert await store.lookup("pool", list(range(5))) == [f"http://w{h}:1" for h in range(5)]
    finally:
        proc.send_signal(signal.SIGCONT)
        await store.stop()
