"""`POST /v1/messages/count_tokens` is limited by requests, on its own, and takes no token quota
(issue 25 §9): Anthropic does not bill token counting and limits it by requests per minute apart
from message creation. A key with only a token limit could count without bound before. Real
gateway, real simulated engine, both limiters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from gateway.auth.params import DEFAULT_COUNT_TOKENS_PER_MINUTE
from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HEADERS = {"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01"}
COUNT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "How many tokens is this? " * 200}]}
TPM = 2000


def gateway(start_sim: StartSim, start_gateway: StartGateway, limiter: str, key_prefix: str,
            **alice: Any) -> tuple[RunningGateway, RunningSim]:
    sim = start_sim("vllm")
    extra: dict[str, Any] = {"redis_url": REDIS_URL} if limiter == "redis" else {}
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, default_output_tokens=100)],
                       auth=auth_section({"tokens_per_minute": TPM, **alice}, key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False}, **extra)
    start_a_window_now(gw)
    return gw, sim


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_count_tokens_has_its_own_request_limit_and_costs_no_tokens(
        start_sim: StartSim, start_gateway: StartGateway, limiter: str, key_prefix: str) -> None:
    gw, sim = gateway(start_sim, start_gateway, limiter, key_prefix, count_tokens_per_minute=3)
    with httpx.Client(base_url=gw.url, headers=HEADERS) as client:
        for _ in range(3):  # each counts ~1,200 prompt tokens: three of them are more than the token limit
            counted = client.post("/v1/messages/count_tokens", json=COUNT)
            assert counted.status_code == 200, counted.text
            assert counted.json()["input_tokens"] > TPM / 3
        refused = client.post("/v1/messages/count_tokens", json=COUNT)
    assert refused.status_code == 429
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    assert "count_tokens" in refused.json()["error"]["message"] and int(refused.headers["retry-after"]) >= 1
    assert len(sim.engine.records) == 3  # the refused one reached no engine
    # The token limit is whole: a Messages request reserving nearly all of it still fits.
    sdk = anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0)
    answer = sdk.messages.create(model="kimi-k3", max_tokens=TPM - 100, messages=[{"role": "user", "content": "Hi"}])
    assert answer.usage.output_tokens == TPM - 100


def test_a_limited_key_counts_tokens_at_the_default_rate(start_sim: StartSim, start_gateway: StartGateway,
                                                          key_prefix: str) -> None:
    """A key with only a token limit gets DEFAULT_COUNT_TOKENS_PER_MINUTE count_tokens requests a minute."""
    gw, sim = gateway(start_sim, start_gateway, "memory", key_prefix)
    small = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hi"}]}
    statuses = []
    with httpx.Client(base_url=gw.url, headers=HEADERS) as client:
        for _ in range(DEFAULT_COUNT_TOKENS_PER_MINUTE + 1):
            statuses.append(client.post("/v1/messages/count_tokens", json=small).status_code)
    assert statuses == [200] * DEFAULT_COUNT_TOKENS_PER_MINUTE + [429]
    assert len(sim.engine.records) == DEFAULT_COUNT_TOKENS_PER_MINUTE
