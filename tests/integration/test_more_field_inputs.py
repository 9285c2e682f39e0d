"""Issue 10 and 15: more inputs of the kinds the issues name, beyond their own examples (the
filers keep some back): Retry-After as an HTTP date or an absurd number, engine failures that
differ only in ids, and streams that send a flood of content-less events before failing."""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate

import httpx

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_retry_after_as_an_http_date_is_honoured(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # RFC 9110 §10.2.3: Retry-After is delay-seconds or an HTTP-date; proxies in front of engines send dates.
    soon = formatdate(time.time() + 8, usegmt=True)
    later = formatdate(time.time() + 20, usegmt=True)
    a = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": later}))
    b = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": soon}))
    gw = start_gateway([pool("p", "vllm", [a.url, b.url], 131072, policy="round_robin")])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_overloaded"
    assert response.headers["retry-after"] in ("7", "8"), response.headers
    again = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)  # both sit out their wait
    assert again.status_code == 503 and again.headers["retry-after"] in ("6", "7", "8"), again.headers
    assert len(a.engine.records) == 1 and len(b.engine.records) == 1


def test_absurd_retry_after_values_are_bounded_not_a_crash(start_sim: StartSim, start_gateway: StartGateway) -> None:
    for value in ("inf", "nan", "1e400", "-5", "soon"):
        sim = start_sim("vllm", faults=SimFaults(fail_status=429, fail_count=1, fail_headers={"retry-after": value}))
        gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503, (value, response.status_code, response.text)
        wait = int(response.headers["retry-after"])
        assert 1 <= wait <= 3600, (value, wait)

