"""A key's limits on one model (issue 22 §1, `auth.keys[].model_limits`) on the real Redis (the
tests' shared one, own key prefix, deleted afterwards) and on the in-process limiter: both the
key's and the model's limits apply, each model's counts live under their own Redis key
(`{prefix}:{key}/model/{model}`), and a refusal by the model's limits gives the key's tokens back."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.auth.access import model_names
from gateway.auth.guard import AuthGuard
from gateway.auth.keys import KeyRing, Principal, hash_key
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.params import ApiKeyConfig, AuthConfig
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.config import parse_config
from gateway.errors import RateLimited
from gateway.observability.metrics import GatewayMetrics
from tests.integration.auth.conftest import REDIS_URL

KEY = "sk-alice-" + "m" * 32
ALICE = ApiKeyConfig(name="alice", sha256=hash_key(KEY), requests_per_minute=5, tokens_per_minute=1000,
                     models=["Kimi-K3", "sql-lora"],
                     model_limits={"moonshotai/Kimi-K3": {"requests_per_minute": 3, "tokens_per_minute": 300},
                                   "sql-lora": {"requests_per_minute": 1}})
CONFIG = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                  "workers": ["http://a:1"], "lora_adapters": ["sql-lora"]}]}, environ={})


@pytest.fixture(params=["memory", "redis"])
async def guard(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[AuthGuard]:
    """A guard for ALICE whose limiter's one-minute window starts now (its clock reads seconds
    since the fixture started), so exact counts never straddle a window edge."""
    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    config = AuthConfig(enabled=True, keys=[ALICE], key_prefix=key_prefix, redis_timeout=0.5)
    metrics = GatewayMetrics()
    limiter = (MemoryRateLimiter(clock=clock) if request.param == "memory"
               else RedisRateLimiter(REDIS_URL, config, metrics, clock=clock))
    g = AuthGuard(config, KeyRing([ALICE], model_names(CONFIG)), limiter, metrics)
    await g.start()
    yield g
    await g.stop()


def alice_of(g: AuthGuard) -> Principal:
    principal = g.keys.lookup(KEY)
    assert principal is not None
    return principal


async def send(g: AuthGuard, model: str, tokens: int) -> None:
    """One request as the request path charges it: counted on arrival, then its tokens and model."""
    alice = alice_of(g)
    counted = await g.count_request(alice)
    await g.check_quota(alice, tokens, requests=0, counted=counted, model=model)


@pytest.mark.anyio
async def test_the_keys_and_the_models_limits_both_apply(guard: AuthGuard, key_prefix: str) -> None:
    for _ in range(3):
        await send(guard, "kimi-k3", 10)
    with pytest.raises(RateLimited) as model_rpm:
        await send(guard, "kimi-k3", 10)
    assert "for kimi-k3 for API key alice on requests per min (RPM): Limit 3, Used 3" in model_rpm.value.message
    await send(guard, "sql-lora", 10)  # the key's 5th request of the minute, the adapter's 1st
    with pytest.raises(RateLimited) as key_rpm:  # the key's own limit, whatever the model
        await send(guard, "sql-lora", 10)
    assert key_rpm.value.message.startswith("Rate limit reached for API key alice on requests per min (RPM): "
                                            "Limit 5, Used 5")
    labels = {"key": guard.metric_labels["alice"], "limit": "requests"}
    assert guard.metrics.registry.get_sample_value("kimi_gateway_model_rate_limited_total",
                                                   {**labels, "model": "kimi-k3"}) == 1
    assert guard.metrics.registry.get_sample_value("kimi_gateway_rate_limited_total", labels) == 2
    if isinstance(guard.limiter, RedisRateLimiter):
        client = redis.Redis.from_url(REDIS_URL)
        try:
            assert sorted(k.decode() for k in client.scan_iter(f"{key_prefix}:*")) == [
                f"{key_prefix}:alice", f"{key_prefix}:alice/model/kimi-k3", f"{key_prefix}:alice/model/sql-lora"]
            model = client.hgetall(f"{key_prefix}:alice/model/kimi-k3")
            assert (model[b"r"], model[b"t"]) == (b"3", b"30")  # the refused 4th is not counted
            assert client.hgetall(f"{key_prefix}:alice/model/sql-lora")[b"t"] == b"0"  # no token limit there
            assert 0 < client.pttl(f"{key_prefix}:alice/model/kimi-k3") <= 120_000
        finally:
            client.close()


@pytest.mark.anyio
async def test_the_models_token_limit_refuses_and_gives_the_keys_tokens_back(guard: AuthGuard) -> None:
    alice = alice_of(guard)
    first = await guard.check_quota(alice, 250, requests=1, model="kimi-k3")
    assert first is not None and first.model is not None
    with pytest.raises(RateLimited) as refused:
        await guard.check_quota(alice, 100, requests=1, model="kimi-k3")  # 350 > the model's 300
    assert refused.value.message.startswith("Rate limit reached for kimi-k3 for API key alice on tokens per min")
    # the key holds 250 of its 1000 (the refused 100 were given back): 750 fit on the adapter
    assert await guard.check_quota(alice, 750, requests=1, model="sql-lora") is not None
    await guard.settle(first, None)  # no engine worked on it: the key's and the model's parts come back
    assert await guard.check_quota(alice, 250, requests=0, model="kimi-k3") is not None
