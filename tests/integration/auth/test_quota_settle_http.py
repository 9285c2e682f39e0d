"""A key's token reservation is settled when its request ends (issue 10 §8): against the engine's
usage, against the prompt estimate when an accepted request failed later, and given back in full
(request included) when no engine worked on it, so SDK retries through an outage do not exhaust a
key. Real gateways, real simulated engines, both limiters (in process and Redis)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from tests.integration.auth.conftest import (
    ALICE_KEY,
    REDIS_URL,
    auth_section,
    start_a_window_now,
)
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HI = [{"role": "user", "content": "Hi"}]  # estimated at 41 prompt tokens (32 + 8 per message + 1)
HEADERS = {"authorization": f"Bearer {ALICE_KEY}"}


def gateway(start_gateway: StartGateway, sims: list[RunningSim], tpm: int, limiter: str, key_prefix: str,
            **settings: Any) -> RunningGateway:
    extra: dict[str, Any] = {"redis_url": REDIS_URL} if limiter == "redis" else {}
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, default_output_tokens=500)],
                       auth=auth_section({"tokens_per_minute": tpm, "requests_per_minute": 1000},
                                         key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False}, **extra, **settings)
    start_a_window_now(gw)
    return gw


def used_now(gw: RunningGateway, probe_tokens: int) -> int:
    """The key's current use, read from the 429 of a probe too large to fit (a refusal costs nothing)."""
    response = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS,
                          json={"model": "kimi-k3", "messages": HI, "max_tokens": probe_tokens - 41})
    assert response.status_code == 429, response.text
    match = re.search(r"Used (\d+), Requested (\d+)", response.json()["error"]["message"])
    assert match is not None and int(match[2]) == probe_tokens
    return int(match[1])


def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_an_outage_does_not_exhaust_the_key(start_sim: StartSim, start_gateway: StartGateway, limiter: str,
                                            key_prefix: str) -> None:
    sims = [start_sim("vllm", faults=SimFaults(fail_status=503)) for _ in range(2)]
    gw = gateway(start_gateway, sims, 20000, limiter, key_prefix,
                 health={"interval": 60, "passive_failures": 100})  # keep the workers in, only the quota counts
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    for _ in range(4):  # 4 x 4041 reserved; before settling, 16164 counted and the next request refused
        with pytest.raises(openai.APIStatusError) as info:
            sdk.chat.completions.create(model="kimi-k3", messages=HI, max_tokens=4000)  # type: ignore[arg-type]
        assert info.value.status_code == 502
    with pytest.raises(openai.APIStatusError):  # the SDK's own retries (2 more, same outage)
        openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=2).chat.completions.create(
            model="kimi-k3", messages=HI, max_tokens=4000)  # type: ignore[arg-type]
    assert sum(len(s.engine.records) for s in sims) == 2 * 7
    for sim in sims:
        httpx.post(sim.url + "/sim/faults", json={})  # the workers recover
    completion = sdk.chat.completions.create(model="kimi-k3", messages=HI, max_tokens=19900)  # type: ignore[arg-type]
    assert completion.usage is not None
    assert used_now(gw, 20000) == completion.usage.total_tokens  # only what the one answer used


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_the_reservation_is_settled_against_the_engines_usage(start_sim: StartSim, start_gateway: StartGateway,
                                                              limiter: str, key_prefix: str) -> None:
    sim = start_sim("vllm", eos_after_tokens=16)
    gw = gateway(start_gateway, [sim], 1000, limiter, key_prefix)
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    # No max_tokens: 41 + the pool's 500 are reserved (and sent as the engine's limit); the engine
    # stops after its own 16.
    first = sdk.chat.completions.create(model="kimi-k3", messages=HI)  # type: ignore[arg-type]
    assert first.usage is not None and first.usage.total_tokens < 100
    assert used_now(gw, 990) == first.usage.total_tokens
    # A stream settles when it ends (the relay's usage patch counts it even unasked).
    stream = sdk.chat.completions.create(model="kimi-k3", messages=HI, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    until(lambda: used_now(gw, 990) == 2 * first.usage.total_tokens)  # type: ignore[union-attr]


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_an_accepted_request_that_broke_counts_its_prompt(start_sim: StartSim, start_gateway: StartGateway,
                                                          limiter: str, key_prefix: str) -> None:
    sim = start_sim("vllm", faults=SimFaults(drop_after_chunks=2))
    gw = gateway(start_gateway, [sim], 1000, limiter, key_prefix)
    body = {"model": "kimi-k3", "messages": HI, "max_tokens": 300, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=HEADERS) as response:
        assert response.status_code == 200
        assert b'"upstream_error"' in response.read()  # cut mid-stream after 2 events
    until(lambda: used_now(gw, 990) == 41)  # the prompt estimate, not the 341 reserved


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_an_engines_refusal_costs_nothing(start_sim: StartSim, start_gateway: StartGateway, limiter: str,
                                          key_prefix: str) -> None:
    sim = start_sim("vllm", max_context_tokens=4096, bytes_per_token=1.0)  # counts 1 token a byte: too long
    gw = start_gateway([pool("p", "vllm", [sim.url], 4096)],
                       auth=auth_section({"tokens_per_minute": 4000}, key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False},
                       **({"redis_url": REDIS_URL} if limiter == "redis" else {}))
    start_a_window_now(gw)
    long_prompt = [{"role": "user", "content": "word " * 1000}]  # ~1,540 estimated, 5,000 for the engine
    for _ in range(3):  # ~1,600 reserved each: kept, the third would get a 429
        response = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS,
                              json={"model": "kimi-k3", "messages": long_prompt, "max_tokens": 50})
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    whole = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS,  # 41 + 3,959: the whole limit is free
                       json={"model": "kimi-k3", "messages": HI, "max_tokens": 3959, "n": 1})
    assert whole.status_code == 200, whole.text
