"""Per-key limits through real gateways: 429s the OpenAI SDK understands, token limits, limits shared by
two replicas through a real Redis, and a Redis that dies under fail-open and fail-closed gateways."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.auth.keys import hash_key
from tests.integration.auth.conftest import (
    ALICE_KEY,
    OPS_KEY,
    REDIS_URL,
    auth_section,
    start_a_window_now,
    wait_clear_of_window_edge,
)
from tests.support import OwnRedis, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def sim(start_sim: StartSim) -> RunningSim:
    return start_sim("vllm")


def gateway(start_gateway: StartGateway, sim: RunningSim, alice: dict[str, Any], auth: dict[str, Any] | None = None,
            **settings: Any) -> RunningGateway:
    settings.setdefault("affinity", {"enabled": False})  # keep the shared Redis free of affinity keys
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth_section(alice, **(auth or {})),
                         load={"enabled": False}, **settings)


def chat(gw: RunningGateway, key: str = ALICE_KEY, max_retries: int = 0, **params: Any) -> Any:
    sdk = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=max_retries)
    params.setdefault("max_tokens", 3)
    return sdk.chat.completions.create(model="kimi-k3", messages=HI, **params)


def test_request_rate_limit_gives_429_with_retry_after(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim, {"requests_per_minute": 2})
    start_a_window_now(gw)
    chat(gw)
    chat(gw)
    with pytest.raises(openai.RateLimitError) as info:
        chat(gw)
    exc = info.value
    assert (exc.status_code, exc.code, exc.type) == (429, "rate_limit_exceeded", "requests")
    assert 1 <= int(exc.response.headers["retry-after"]) <= 120
    assert "on requests per min (RPM): Limit 2, Used 2, Requested 1" in exc.message
    assert len(sim.engine.records) == 2
    chat(gw, key=OPS_KEY)  # another key (no limits) is not affected
    # The open /metrics labels the key by its id (the start of its sha256), never by its holder's name.
    assert gw.metric(f'kimi_gateway_rate_limited_total{{key="{hash_key(ALICE_KEY)[:12]}",limit="requests"}}') == 1
    assert "alice" not in httpx.get(gw.url + "/metrics").text


def test_token_rate_limit(sim: RunningSim, start_gateway: StartGateway) -> None:
    # "Hi" is estimated at 41 prompt tokens (32 per request + 8 per message + 1): 441 with max_tokens=400.
    # Each is settled against the engine's usage once answered: 5 prompt + 400 completion tokens.
    gw = gateway(start_gateway, sim, {"tokens_per_minute": 1000}, auth={"metric_key_names": True})
    start_a_window_now(gw)
    chat(gw, max_tokens=400)
    chat(gw, max_tokens=400)
    with pytest.raises(openai.RateLimitError) as info:
        chat(gw, max_tokens=400)
    assert info.value.type == "tokens"
    assert "on tokens per min (TPM): Limit 1000, Used 810, Requested 441" in info.value.message
    chat(gw, max_tokens=100)  # 141 more still fit: the refused request cost nothing

    # Larger than the whole limit: "Request too large", and the SDK does not retry (x-should-retry: false).
    with pytest.raises(openai.RateLimitError) as too_large:
        chat(gw, max_retries=2, max_tokens=2000)
    assert "Request too large for API key alice on tokens per min (TPM): Limit 1000, Requested 2041" in (
        too_large.value.message)
    assert "retry-after" not in too_large.value.response.headers
    assert gw.metric('kimi_gateway_rate_limited_total{key="alice",limit="tokens"}') == 2
    assert len(sim.engine.records) == 3


def test_token_limit_charges_every_completion_asked_for(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim, {"tokens_per_minute": 1000})
    start_a_window_now(gw)
    chat(gw, max_tokens=300, n=3)  # 41 prompt tokens + 3 x 300 output tokens = 941: fits
    with pytest.raises(openai.RateLimitError) as info:
        chat(gw, max_tokens=320, n=3)  # 41 + 3 x 320 = 1001: larger than the whole limit
    assert "Limit 1000, Requested 1001" in info.value.message
    # A completions batch: each prompt and each of its outputs (2 prompts x n=2 x 200 tokens), on
    # top of the first request's use (settled to the simulator's usage: one choice, 5 + 300 tokens).
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError) as batch:
        sdk.completions.create(model="kimi-k3", prompt=[[1, 2, 3], [4, 5]], max_tokens=200, n=2)
    assert "Used 305, Requested 805" in batch.value.message


def test_limits_are_shared_by_replicas_through_redis(sim: RunningSim, start_gateway: StartGateway,
                                                     key_prefix: str) -> None:
    replicas = [gateway(start_gateway, sim, {"requests_per_minute": 3}, {"key_prefix": key_prefix},
                        redis_url=REDIS_URL) for _ in range(2)]
    # Redis' TIME (this machine's clock) decides the window: five requests need well under 5 s.
    wait_clear_of_window_edge(time.time, need_s=5.0)
    chat(replicas[0])
    chat(replicas[1])
    chat(replicas[0])
    for gw in replicas:
        with pytest.raises(openai.RateLimitError):
            chat(gw)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    assert client.hget(f"{key_prefix}:alice", "r") == "3"
    assert [k for k in client.scan_iter(f"{key_prefix}:*")] == [f"{key_prefix}:alice"]  # limited keys only
    client.close()


def test_redis_down_fail_open_serves_and_fail_closed_refuses(sim: RunningSim, start_gateway: StartGateway,
                                                             own_redis: OwnRedis) -> None:
    auth = {"redis_timeout": 0.2, "redis_retry_after": 0.3}
    fail_open, fail_closed = (
        gateway(start_gateway, sim, {"requests_per_minute": 100}, {**auth, "fail_mode": mode},
                redis_url=own_redis.url) for mode in ("open", "closed"))
    chat(fail_open)
    chat(fail_closed)

    own_redis.kill()
    for _ in range(3):
        chat(fail_open)
    refused = httpx.post(fail_closed.v1 + "/chat/completions", headers={"authorization": f"Bearer {ALICE_KEY}"},
                         json={"model": "kimi-k3", "messages": HI, "max_tokens": 3})
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
    assert refused.json()["error"]["code"] == "rate_limit_unavailable"
    with pytest.raises(openai.InternalServerError):
        chat(fail_closed)
    assert fail_open.metric('kimi_gateway_rate_limit_unavailable_total{action="allowed"}') == 3
    assert fail_closed.metric('kimi_gateway_rate_limit_unavailable_total{action="refused"}') == 2
    assert fail_closed.metric('kimi_gateway_redis_errors_total{op="rate_limit"}') >= 1

    own_redis.start()  # back (empty): the breaker lets the next check through after redis_retry_after
    limiter = fail_closed.server.app.state.gateway.auth.limiter
    deadline = time.monotonic() + 5
    while not limiter.available:
        assert time.monotonic() < deadline, "the rate-limit breaker did not close"
        time.sleep(0.02)
    chat(fail_closed)
