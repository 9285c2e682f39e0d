"""The sliding-window rule and the in-process limiter, on a fake clock (seconds)."""

from __future__ import annotations

import math

import pytest

from gateway.auth.keys import Principal
from gateway.auth.limits import MemoryRateLimiter, Verdict, wait_seconds


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(rpm: int | None = None, tpm: int | None = None, name: str = "alice") -> Principal:
    return Principal(name, frozenset({"user"}), rpm, tpm)


@pytest.mark.parametrize(("args", "wait"), [
    ((None, 100, 100, 1, 0, 60), 0.0),           # no limit
    ((10, 0, 0, 11, 0, 60), math.inf),           # larger than the limit: never
    ((10, 0, 9, 1, 0, 60), 0.0),                 # fits exactly
    ((10, 16, 2, 1, 30, 60), 3.75),              # 16 * (60 - t) / 60 + 3 <= 10 from t = 33.75
    ((3, 0, 3, 1, 10, 60), 50 + 20),             # next window, once 3 * (60 - u) / 60 + 1 <= 3: u = 20
    ((3, 3, 3, 3, 59, 60), 1 + 60),              # next window, once the whole current one slid out
])
def test_wait_seconds(args: tuple[int | None, float, float, int, float, float], wait: float) -> None:
    assert wait_seconds(*args) == pytest.approx(wait)


@pytest.mark.anyio
async def test_request_limit_refuses_and_retry_after_is_exact() -> None:
    clock = Clock(120.0 + 10)  # 10 s into a window
    limiter = MemoryRateLimiter(clock=clock)
    alice = key(rpm=3)
    for _ in range(3):
        assert (await limiter.acquire(alice, 100)).allowed
    refused = await limiter.acquire(alice, 100)
    assert refused == Verdict(False, "requests", 3, 3, 1, pytest.approx(70.0))
    clock.now += refused.retry_after - 0.01
    assert not (await limiter.acquire(alice, 100)).allowed
    clock.now += 0.01
    assert (await limiter.acquire(alice, 100)).allowed


@pytest.mark.anyio
async def test_no_burst_across_a_window_edge() -> None:
    clock = Clock(59.9)
    limiter = MemoryRateLimiter(clock=clock)
    alice = key(rpm=3)
    for _ in range(3):
        assert (await limiter.acquire(alice, 1)).allowed
    clock.now = 60.1  # a fixed window would allow 3 more now
    assert not (await limiter.acquire(alice, 1)).allowed
    clock.now = 60 + 20  # 3 * 40/60 = 2 still count: one more fits
    assert (await limiter.acquire(alice, 1)).allowed
    assert not (await limiter.acquire(alice, 1)).allowed


@pytest.mark.anyio
async def test_token_limit_and_refused_requests_cost_nothing() -> None:
    clock = Clock(0.0)
    limiter = MemoryRateLimiter(clock=clock)
    alice = key(rpm=2, tpm=1000)
    assert (await limiter.acquire(alice, 600)).allowed
    refused = await limiter.acquire(alice, 600)
    assert (refused.limit, refused.limit_value, refused.used, refused.requested) == ("tokens", 1000, 600, 600)
    assert refused.retry_after == pytest.approx(60 + 60 * (1 - 400 / 600))
    assert (await limiter.acquire(alice, 400)).allowed  # the refused request counted neither limit
    assert (await limiter.acquire(alice, 0)).limit == "requests"


@pytest.mark.anyio
async def test_a_request_larger_than_the_limit_never_fits() -> None:
    limiter = MemoryRateLimiter(clock=Clock())
    verdict = await limiter.acquire(key(tpm=1000), 1001)
    assert (verdict.allowed, verdict.limit, verdict.retry_after) == (False, "tokens", math.inf)


@pytest.mark.anyio
async def test_the_longer_wait_is_reported_when_both_limits_refuse() -> None:
    limiter = MemoryRateLimiter(clock=Clock(0.0))
    alice = key(rpm=2, tpm=100)
    for _ in range(2):
        assert (await limiter.acquire(alice, 10)).allowed
    # Both wait for the next window. Requests: 2 * (60 - u) / 60 + 1 <= 2 from u = 30 (90 s);
    # 100 tokens: 20 * (60 - u) / 60 + 100 <= 100 only once the window slid out (120 s);
    # 85 tokens: from u = 15 (75 s).
    assert (await limiter.acquire(alice, 100)) == Verdict(False, "tokens", 100, 20, 100, pytest.approx(120.0))
    assert (await limiter.acquire(alice, 85)) == Verdict(False, "requests", 2, 2, 1, pytest.approx(90.0))


@pytest.mark.anyio
async def test_keys_are_independent_and_idle_keys_reset() -> None:
    clock = Clock(0.0)
    limiter = MemoryRateLimiter(clock=clock)
    alice, bob = key(rpm=1), key(rpm=1, name="bob")
    assert (await limiter.acquire(alice, 1)).allowed
    assert (await limiter.acquire(bob, 1)).allowed
    assert not (await limiter.acquire(alice, 1)).allowed
    clock.now = 125.0  # two windows later: nothing of the old use is left
    assert (await limiter.acquire(alice, 1)).allowed


@pytest.mark.anyio
async def test_unlimited_key_always_passes() -> None:
    limiter = MemoryRateLimiter(clock=Clock())
    for _ in range(100):
        assert (await limiter.acquire(key(), 10**9)).allowed
