"""The gateway's own event-loop stalls are not a Redis outage (issue 15 §1): a rate-limit check or an
affinity lookup whose reply waited in the socket while the loop was held gets its answer, and the
circuit breaker stays closed. Real Redis, the tests' shared one (own key prefixes, cleaned up)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from gateway.affinity.params import AffinityConfig
from gateway.affinity.redis_store import RedisAffinityStore
from gateway.auth.keys import Principal
from gateway.auth.params import AuthConfig
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.looplag import StoreTimeout
from gateway.observability.metrics import GatewayMetrics
from tests.support import shared_redis_url

REDIS_URL = shared_redis_url()
HOLD_S = 0.12  # how long the loop is held, seconds: longer than the stores' timeouts
HOPS = range(6)
T = TypeVar("T")


async def while_the_loop_is_held(call: Callable[[], Awaitable[T]], after_hops: int, hold_s: float = HOLD_S) -> T:
    """Run `call()` as a task and hold the event loop for `hold_s` seconds with a blocking sleep (as
    a CPU-heavy request would) `after_hops` loop iterations later. redis-py sends a command a few
    steps into the call, so trying each of `HOPS` puts one hold between a command and its reply."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(call())

    def hold(hops: int) -> None:
        if hops:
            loop.call_soon(hold, hops - 1)
        else:
            time.sleep(hold_s)

    loop.call_soon(hold, after_hops)
    return await task


async def delete_prefix(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_rate_limit_check_survives_a_held_loop(fail_mode: str) -> None:
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    metrics = GatewayMetrics()
    limiter = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=prefix, redis_timeout=0.05, fail_mode=fail_mode),
                               metrics)
    alice = Principal("alice", frozenset({"user"}), 1000, None)
    try:
        assert (await limiter.acquire(alice, 1)) is not None  # connection made, script loaded
        for hops in HOPS:
            verdict = await while_the_loop_is_held(lambda: limiter.acquire(alice, 1), hops)
            assert verdict is not None and verdict.allowed, f"the held loop was taken for a Redis failure ({hops})"
        assert limiter.available
        assert (metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": "rate_limit"}) or 0) == 0
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        counts = await client.hmget(f"{prefix}:alice", "r", "pr")  # pr: a minute may have rolled over meanwhile
        assert sum(int(c or 0) for c in counts) == 1 + len(HOPS)  # every check was counted
        await client.aclose()
    finally:
        await limiter.stop()
        await delete_prefix(prefix)


@pytest.mark.anyio
async def test_rate_limit_check_survives_a_loop_held_past_a_second() -> None:
    """Held longer than redis-py's own socket timeout was (1 s, now `looplag.SOCKET_BACKSTOP_S`): that
    timer fired with the late StoreTimeout and dropped the reply waiting in the socket, opening the
    breaker (issue 15's 1.3 s stall; seen again as 503s in the heavy-bodies test on a busy CPU)."""
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    metrics = GatewayMetrics()
    limiter = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=prefix, redis_timeout=0.05, fail_mode="closed"),
                               metrics)
    alice = Principal("alice", frozenset({"user"}), 1000, None)
    try:
        assert (await limiter.acquire(alice, 1)) is not None
        for hops in HOPS:
            verdict = await while_the_loop_is_held(lambda: limiter.acquire(alice, 1), hops, 1.1)
            assert verdict is not None and verdict.allowed, f"the held loop was taken for a Redis failure ({hops})"
        assert (metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": "rate_limit"}) or 0) == 0
    finally:
        await limiter.stop()
        await delete_prefix(prefix)


@pytest.mark.anyio
async def test_a_store_stops_when_the_loop_is_held_through_its_redis_close(caplog: pytest.LogCaptureFixture) -> None:
    """redis-py waits for its sockets' close under `socket_connect_timeout` (the store's Redis budget,
    at least 0.25 s) and raised a TimeoutError when the loop was held through that wait, although the
    sockets were closing: the store's stop() raised and AppState.stop skipped what came after it
    (seen as a TimeoutError from the rate limiter's stop() with the CPU oversubscribed). Holds at
    successive `HOPS` until one falls inside the close: every stop() returns, the slow close is logged."""
    caplog.set_level(logging.WARNING, "gateway.redis")
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    alice = Principal("alice", frozenset({"user"}), 1000, None)
    slow_close = "closing the rate-limit store's Redis client: TimeoutError"
    try:
        for hops in HOPS:
            limiter = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=prefix, redis_timeout=1.0), GatewayMetrics())
            assert (await limiter.acquire(alice, 1)) is not None  # a connection to close
            await while_the_loop_is_held(limiter.stop, hops, 1.2)  # past the 1 s close budget
            if slow_close in caplog.text:
                break
        else:
            pytest.fail(f"no hold fell inside the Redis close: {caplog.text}")
    finally:
        await delete_prefix(prefix)


@pytest.mark.anyio
async def test_affinity_lookup_survives_a_held_loop() -> None:
    prefix = f"test-lag-{uuid.uuid4().hex[:10]}"
    metrics = GatewayMetrics()
    store = RedisAffinityStore(REDIS_URL, AffinityConfig(key_prefix=prefix, lookup_timeout=0.02), metrics)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(store.key("p", 7), "http://w1")
        assert await store.lookup("p", [7, 8]) == ["http://w1", None]
        for hops in HOPS:
            assert await while_the_loop_is_held(lambda: store.lookup("p", [7, 8]), hops) == ["http://w1", None], hops
        assert store.available
        assert (metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": "lookup"}) or 0) == 0
    finally:
        await client.aclose()
        await store.stop()
        await delete_prefix(prefix)


def hold_iterations(count: int, hold_s: float) -> None:
    """Hold each of the next `count` event-loop iterations for `hold_s` seconds (a loop that keeps
    lagging): a timer due meanwhile always runs at least about `hold_s` late."""
    loop = asyncio.get_running_loop()

    def hold(left: int) -> None:
        time.sleep(hold_s)
        if left > 1:
            loop.call_soon(hold, left - 1)

    loop.call_soon(hold, count)


@pytest.mark.anyio
async def test_store_timeout_still_expires_when_the_store_is_slow() -> None:
    # Nothing answers: it expires (a busy machine may delay its timer: then it had extensions).
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with StoreTimeout(0.05):
            await asyncio.sleep(5)
    assert 0.04 < time.monotonic() - started < 2.0

    # Held across the deadline: a fresh budget after the hold, then it expires all the same.
    started = time.monotonic()
    timer = StoreTimeout(0.05)
    with pytest.raises(TimeoutError):
        async with timer:
            await while_the_loop_is_held(lambda: asyncio.sleep(5), 0, 0.2)
    assert 0.24 < time.monotonic() - started < 2.0
    assert timer.extensions >= 1


@pytest.mark.anyio
async def test_store_timeout_gives_up_on_a_loop_that_keeps_lagging() -> None:
    # Every deadline runs ~50 ms late: at most max_extensions fresh budgets, then it expires, marked late.
    timer = StoreTimeout(0.01, max_extensions=2)
    hold_iterations(8, 0.05)
    with pytest.raises(TimeoutError):
        async with timer:
            await asyncio.sleep(5)
    assert (timer.extensions, timer.expired_late) == (2, True)


@pytest.mark.anyio
async def test_a_call_that_finishes_is_not_cut() -> None:
    async with StoreTimeout(0.05) as timer:
        await asyncio.sleep(0.01)
    assert (timer.extensions, timer.expired_late) == (0, False)
