"""The same contract for both stored-response owner stores: in-process and a real Redis (127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.affinity.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseOwner,
    ResponseStore,
    ResponseStoreUnavailable,
)
from gateway.config import ResponsesConfig
from gateway.metrics import GatewayMetrics

REDIS_URL = "redis://127.0.0.1:6379/0"
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
        store.record("resp_x", OWNER)
        await store.flush()
        with pytest.raises(ResponseStoreUnavailable) as failed:
            await store.lookup("resp_x")
        assert failed.value.status == 503 and failed.value.headers["retry-after"] == "1"
    finally:
        await store.stop()
    for op in ("response_lookup", "response_write"):
        assert (metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": op}) or 0) >= 1
