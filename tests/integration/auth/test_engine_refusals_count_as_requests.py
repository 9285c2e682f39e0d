"""A key's request limit holds for requests an engine refuses (found by the attack review): the
request counted on arrival is given back only when no engine worked on it (an outage), not when an
engine read and refused it, or a tenant could send engines any number of bodies they tokenize and
refuse (prompts past their context, sampling values they reject), past `requests_per_minute`."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HEADERS = {"authorization": f"Bearer {ALICE_KEY}"}


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_engine_refusals_count_against_the_request_limit(start_sim: StartSim, start_gateway: StartGateway,
                                                         limiter: str, key_prefix: str) -> None:
    sim = start_sim("vllm", max_context_tokens=4096, bytes_per_token=1.0)  # counts 1 token a byte: too long
    gw = start_gateway([pool("p", "vllm", [sim.url], 4096)],
                       auth=auth_section({"requests_per_minute": 3, "tokens_per_minute": 100000},
                                         key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False},
                       **({"redis_url": REDIS_URL} if limiter == "redis" else {}))
    start_a_window_now(gw)
    long_prompt = [{"role": "user", "content": "word " * 1000}]  # fits the gateway's estimate, not the engine
    statuses = []
    for _ in range(5):
        response = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS,
                              json={"model": "kimi-k3", "messages": long_prompt, "max_tokens": 50})
        statuses.append(response.status_code)
    assert statuses[:3] == [400, 400, 400]
    assert statuses[3:] == [429, 429], statuses  # the engine read each of them: each was a request
