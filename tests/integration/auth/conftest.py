"""Keys, config builders and a private redis-server for the auth tests."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from gateway.auth.keys import hash_key
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.redis_limits import RedisRateLimiter
from tests.support import RunningGateway, shared_redis_url

REDIS_URL = shared_redis_url()
ALICE_KEY = "sk-alice-" + uuid.uuid4().hex + uuid.uuid4().hex
OPS_KEY = "sk-ops-" + uuid.uuid4().hex + uuid.uuid4().hex
ENGINE_KEY = "engine-secret-" + uuid.uuid4().hex


def auth_section(alice: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """An enabled `auth` config: `alice` (user scope, extra fields from `alice`) and `ops` (user + admin)."""
    return {"enabled": True, **settings, "keys": [
        {"name": "alice", "sha256": hash_key(ALICE_KEY), **(alice or {})},
        {"name": "ops", "sha256": hash_key(OPS_KEY), "scopes": ["user", "admin"]},
    ]}


def left_in_window(clock: Callable[[], float], window_s: float) -> float:
    """Seconds left in the limiter window `clock` is in now (windows are floor(clock() / window_s))."""
    return window_s - clock() % window_s


def start_a_window_now(gw: RunningGateway) -> None:
    """Give a gateway's limiter a clock whose window starts now, reading `time.monotonic()` seconds
    since this call: a real MemoryRateLimiter, or a real RedisRateLimiter on the gateway's Redis
    (the script then takes that time instead of Redis' `TIME`; the test's key prefix is its own, so
    no other window shares its keys). A test checking exact counts then runs a whole minute clear
    of a window edge, without sleeping to the next edge (up to 15 s). Call it before the test's
    first request (the replaced limiter's counts are dropped). Redis' own clock keeps its tests:
    the limiter contract's and `test_limits_are_shared_by_replicas_through_redis`."""
    guard = gw.server.app.state.gateway.auth
    assert guard is not None, "auth is on"
    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    old = guard.limiter
    if isinstance(old, RedisRateLimiter):
        assert gw.config.redis_url is not None
        guard.limiter = RedisRateLimiter(gw.config.redis_url, old.config, old.metrics, clock=clock)
        gw.server.call(old.stop())
    else:
        assert isinstance(old, MemoryRateLimiter), "an in-process or Redis limiter"
        guard.limiter = MemoryRateLimiter(clock=clock)


def wait_clear_of_window_edge(clock: Callable[[], float], window_s: float = 60.0, need_s: float = 15.0) -> None:
    """Sleep into the next window when fewer than `need_s` seconds are left in this one.

    The limits count in fixed windows weighted by the one before, so a test that checks exact counts
    must not straddle a window edge. The in-process limiter's clock is `time.monotonic`; the Redis
    limiter's is Redis' `TIME`, which for the Redis on this machine is `time.time`.
    """
    left = left_in_window(clock, window_s)
    if left < need_s:
        time.sleep(left + 0.01)


async def async_wait_clear_of_window_edge(clock: Callable[[], float], window_s: float, need_s: float) -> None:
    """`wait_clear_of_window_edge` for tests running in an event loop."""
    left = left_in_window(clock, window_s)
    if left < need_s:
        await asyncio.sleep(left + 0.01)


@pytest.fixture
def key_prefix() -> Iterator[str]:
    """A fresh Redis key prefix; its keys are deleted from the shared Redis afterwards."""
    prefix = f"test-rl-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
