"""The same limiter contract for the in-process and the Redis limiter (the tests' shared Redis,
own key prefix), on a 1-second window so that time-based behaviour runs in real time."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.auth.keys import Principal
from gateway.auth.limits import MemoryRateLimiter, RateLimiter
from gateway.auth.params import AuthConfig
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.observability.metrics import GatewayMetrics
from tests.integration.auth.conftest import REDIS_URL, async_wait_clear_of_window_edge

WINDOW_S = 1.0


def key(rpm: int | None = None, tpm: int | None = None, name: str = "alice") -> Principal:
    return Principal(name, frozenset({"user"}), rpm, tpm)


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[RateLimiter]:
    lim: RateLimiter
    clock = time.monotonic
    if request.param == "memory":
        lim = MemoryRateLimiter(window_s=WINDOW_S)
    else:
        clock = time.time  # Redis' TIME: this machine's clock
        lim = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=key_prefix, redis_timeout=0.5), GatewayMetrics(),
                               window_s=WINDOW_S)
    await lim.start()
    # The tests check exact counts: start them with at least half a window left.
    await async_wait_clear_of_window_edge(clock, WINDOW_S, WINDOW_S / 2)
    yield lim
    await lim.stop()


@pytest.mark.anyio
async def test_request_limit_then_retry_after(limiter: RateLimiter) -> None:
    alice = key(rpm=2)
    for _ in range(2):
        assert (await limiter.acquire(alice, 5)).allowed
    refused = await limiter.acquire(alice, 5)
    assert refused is not None and not refused.allowed
    assert (refused.limit, refused.limit_value, refused.used, refused.requested) == ("requests", 2, 2, 1)
    assert 0 < refused.retry_after <= 2 * WINDOW_S
    await asyncio.sleep(refused.retry_after + 0.01)
    assert (await limiter.acquire(alice, 5)).allowed


@pytest.mark.anyio
async def test_token_limit_refusals_cost_nothing(limiter: RateLimiter) -> None:
    alice, bob = key(tpm=100), key(tpm=100, name="bob")
    assert (await limiter.acquire(alice, 60)).allowed
    refused = await limiter.acquire(alice, 60)
    assert refused is not None and (refused.allowed, refused.limit, refused.used) == (False, "tokens", 60)
    assert (await limiter.acquire(alice, 40)).allowed
    assert (await limiter.acquire(bob, 100)).allowed  # keys are independent
    too_large = await limiter.acquire(alice, 101)
    assert too_large is not None and math.isinf(too_large.retry_after)


@pytest.mark.anyio
async def test_refund_settles_what_was_counted(limiter: RateLimiter) -> None:
    alice = key(rpm=2, tpm=100)
    first = await limiter.acquire(alice, 80)
    assert first is not None and first.allowed and first.window is not None
    refused = await limiter.acquire(alice, 30)
    assert refused is not None and (refused.allowed, refused.used) == (False, 80)
    await limiter.refund(alice, first.window, 0, 60)  # the request used 20 of its 80
    assert (await limiter.acquire(alice, 30)).allowed  # 20 + 30
    refused = await limiter.acquire(alice, 1)
    assert refused is not None and (refused.allowed, refused.limit, refused.used) == (False, "requests", 2)
    await limiter.refund(alice, first.window, 1, 30)  # the second one never reached an engine
    assert (await limiter.acquire(alice, 10)).allowed
    await limiter.refund(alice, first.window, 1, 0)  # (room for one more request: the tokens decide below)
    await limiter.refund(alice, first.window, 0, -60)  # used more than it reserved: charged on top
    refused = await limiter.acquire(alice, 50)
    assert refused is not None and (refused.limit, refused.used) == ("tokens", 90)  # 20 + 10 + 60
    await limiter.refund(alice, first.window, 10, 10**6)  # never below zero
    assert (await limiter.acquire(alice, 100)).allowed
    refused = await limiter.acquire(alice, 1)
    assert refused is not None and (refused.allowed, refused.limit, refused.used) == (False, "tokens", 100)
    assert (await limiter.acquire(key(tpm=100, name="bob"), 100)).allowed  # other keys untouched


@pytest.mark.anyio
async def test_refund_reaches_the_previous_window_only(limiter: RateLimiter) -> None:
    clock = time.monotonic if isinstance(limiter, MemoryRateLimiter) else time.time
    alice = key(tpm=100)
    first = await limiter.acquire(alice, 90)
    assert first is not None and first.window is not None
    await asyncio.sleep(WINDOW_S - clock() % WINDOW_S + 0.02)  # into the next window
    late = await limiter.acquire(alice, 1)  # counted in the new window: the old one is now the previous
    assert late is not None and late.window == first.window + 1
    await limiter.refund(alice, first.window, 0, 80)  # lands on the previous window's count
    assert (await limiter.acquire(alice, 85)).allowed  # 1 + 10 x (share left) + 85 fits; 90 x share would not
    await asyncio.sleep(2 * WINDOW_S)
    await limiter.refund(alice, first.window, 1, 10)  # that window is gone: nothing to take back, no error
    assert (await limiter.acquire(alice, 100)).allowed


@pytest.mark.anyio
@pytest.mark.parametrize("idle", [False, True])
async def test_a_late_debt_is_charged_to_the_current_window(limiter: RateLimiter, idle: bool) -> None:
    """A request that used more than it reserved and settled after its window slid out (a long
    stream, a background response) still pays: the debt lands on the current window, also when the
    key counted nothing since (its stored windows are stale, or gone in Redis), and it refuses
    what would not fit beside it. A late refund stays dropped (issue 25 §3)."""
    clock = time.monotonic if isinstance(limiter, MemoryRateLimiter) else time.time
    alice = key(tpm=100)
    first = await limiter.acquire(alice, 30)
    assert first is not None and first.window is not None
    await asyncio.sleep(2 * WINDOW_S - clock() % WINDOW_S + 0.02)  # two windows later: the first one is gone
    if not idle:
        assert (await limiter.acquire(alice, 1)).allowed
    await async_wait_clear_of_window_edge(clock, WINDOW_S, WINDOW_S / 2)
    await limiter.refund(alice, first.window, 0, -70)  # it used 100 of its 30
    await limiter.refund(alice, first.window, 1, 30)  # a refund of a gone window: nothing comes back
    refused = await limiter.acquire(alice, 40)
    assert refused is not None and not refused.allowed and refused.limit == "tokens"
    assert refused.used >= 70
    assert (await limiter.acquire(alice, 29 if idle else 28)).allowed  # the debt, the 1 and this fill it


@pytest.mark.anyio
async def test_redis_key_layout(key_prefix: str) -> None:
    limiter = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=key_prefix, redis_timeout=0.5), GatewayMetrics())
    try:
        assert (await limiter.acquire(key(rpm=10, tpm=1000), 123)).allowed
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        fields = await client.hgetall(f"{key_prefix}:alice")
        ttl_ms = await client.pttl(f"{key_prefix}:alice")
        now_s, _ = await client.time()
        await client.aclose()
        assert {k: fields[k] for k in ("r", "t", "pr", "pt")} == {"r": "1", "t": "123", "pr": "0", "pt": "0"}
        assert int(fields["w"]) in (now_s // 60, now_s // 60 - 1)
        assert 0 < ttl_ms <= 120_000
    finally:
        await limiter.stop()


@pytest.mark.anyio
async def test_unreachable_redis_answers_none_fast(unused_port: int) -> None:
    metrics = GatewayMetrics()
    limiter = RedisRateLimiter(f"redis://127.0.0.1:{unused_port}/0", AuthConfig(redis_retry_after=5), metrics)
    try:
        started = time.monotonic()
        assert await limiter.acquire(key(rpm=1), 1) is None
        assert await limiter.acquire(key(rpm=1), 1) is None  # the breaker skips Redis: no new connect
        assert time.monotonic() - started < 1
        assert metrics.registry.get_sample_value("kimi_gateway_redis_errors_total", {"op": "rate_limit"}) == 1
    finally:
        await limiter.stop()


@pytest.mark.anyio
async def test_lua_script_equals_the_python_rule(key_prefix: str) -> None:
    """Random traffic on one fake clock through the Lua script and through MemoryRateLimiter:
    every verdict (allowed, limit, used, requested, retry-after to the millisecond) is the same."""
    rng = random.Random(7)
    clock_ms = [1_000_000_000_000]
    memory = MemoryRateLimiter(window_s=60.0, clock=lambda: clock_ms[0] / 1000)
    lua = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=key_prefix, redis_timeout=1.0), GatewayMetrics())
    keys = [key(rpm=5, tpm=2000), key(rpm=None, tpm=500, name="bob"), key(rpm=3, tpm=None, name="carol")]
    try:
        for step in range(400):
            clock_ms[0] += rng.choice([0, 10, 700, 3_000, 9_000, 25_000, 61_000])
            principal = rng.choice(keys)
            tokens = rng.choice([0, 1, 50, 200, 499, 600])
            requests = rng.choice([0, 1, 1])  # 0: tokens only (the request was counted on arrival)
            expected = await memory.acquire(principal, tokens, requests)
            reply = await lua._script(keys=[lua.key(principal.name)], args=[
                60_000, principal.requests_per_minute or -1, principal.tokens_per_minute or -1, tokens, clock_ms[0],
                requests])
            allowed, wait_ms, kind, limit, used, requested = reply[:6]
            assert bool(allowed) == expected.allowed, f"step {step}"
            if not expected.allowed:
                assert (kind.decode(), limit, used, requested) == (
                    expected.limit, expected.limit_value, expected.used, expected.requested), f"step {step}"
                if math.isinf(expected.retry_after):
                    assert wait_ms == -1
                else:
                    # Lua works in whole milliseconds, Python in float seconds (~1e-7 s rounding here).
                    assert abs(wait_ms - expected.retry_after * 1000) <= 1, f"step {step}"
    finally:
        await lua.stop()


@pytest.mark.anyio
async def test_a_redis_limiter_given_a_clock_counts_in_that_clocks_windows(key_prefix: str) -> None:
    """The tests' seam (tests/integration/auth/conftest.py `start_a_window_now`): with a clock the
    script takes its time instead of Redis' TIME, so windows start where the clock says."""
    now = [59.5]
    lim = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=key_prefix), GatewayMetrics(), clock=lambda: now[0])
    try:
        alice = key(rpm=1)
        first = await lim.acquire(alice, 1)
        assert first is not None and first.allowed and first.window == 0
        refused = await lim.acquire(alice, 1)
        assert refused is not None and not refused.allowed
        assert 0 < refused.retry_after <= 60.5  # the rest of window 0, then window 1 weighs window 0's use
        now[0] = 120.5  # window 2: windows 0 and 1 no longer count
        later = await lim.acquire(alice, 1)
        assert later is not None and later.allowed and later.window == 2
    finally:
        await lim.stop()


@pytest.mark.anyio
async def test_concurrent_refunds_go_out_together_and_each_lands(key_prefix: str) -> None:
    """Refunds of requests ending at once are pipelined (fewer Redis round trips than refunds), and
    every one of them is settled once its `refund` returns: 40 keys, each charged 100 tokens and
    refunded 60 concurrently, then holding exactly 40."""
    metrics = GatewayMetrics()
    limiter = RedisRateLimiter(REDIS_URL, AuthConfig(key_prefix=key_prefix, redis_timeout=0.5), metrics)
    keys = [key(tpm=1000, name=f"k{i}") for i in range(40)]
    await async_wait_clear_of_window_edge(time.time, 60.0, 5.0)  # all in one minute's window
    try:
        windows = [await limiter.acquire(k, 100, 0) for k in keys]
        assert all(w is not None and w.allowed and w.window is not None for w in windows)
        calls = metrics.registry.get_sample_value("kimi_gateway_redis_seconds_count", {"op": "rate_limit"}) or 0
        await asyncio.gather(*(limiter.refund(k, w.window, 0, 60) for k, w in zip(keys, windows, strict=True)
                               if w is not None and w.window is not None))
        refund_calls = (metrics.registry.get_sample_value("kimi_gateway_redis_seconds_count",
                                                          {"op": "rate_limit"}) or 0) - calls
        assert 1 <= refund_calls < len(keys) / 4
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            held = [await client.hget(f"{key_prefix}:{k.name}", "t") for k in keys]
        finally:
            await client.aclose()
        assert held == ["40"] * len(keys)
    finally:
        await limiter.stop()


@pytest.mark.anyio
async def test_each_decision_reports_the_keys_counts(limiter: RateLimiter) -> None:
    """What the rate-limit headers are read from (`Verdict.counts`, `auth/standing.py`): the use after
    an allowed charge, before a refused one, in the window the decision saw."""
    alice = key(rpm=2, tpm=100)
    allowed = await limiter.acquire(alice, 30)
    assert allowed is not None and allowed.counts is not None
    assert (allowed.counts.requests, allowed.counts.tokens, allowed.counts.window) == (1, 30, WINDOW_S)
    assert 0 <= allowed.counts.elapsed < WINDOW_S
    tokens_only = await limiter.acquire(alice, 50, 0)
    assert tokens_only is not None and tokens_only.counts is not None
    assert (tokens_only.counts.requests, tokens_only.counts.tokens) == (1, 80)
    refused = await limiter.acquire(alice, 30)  # 110 tokens would be over 100: refused, nothing counted
    assert refused is not None and not refused.allowed and refused.counts is not None
    assert (refused.counts.requests, refused.counts.tokens) == (1, 80)
