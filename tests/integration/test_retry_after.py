"""An engine's Retry-After (issues 10 and 15) as an HTTP date (honoured: the client is told the
sooner of two workers' waits) or as an absurd number (bounded, never a crash)."""

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
    written = time.time()
    soon = formatdate(written + 8, usegmt=True)
    later = formatdate(written + 20, usegmt=True)
    a = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": later}))
    b = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": soon}))
    gw = start_gateway([pool("p", "vllm", [a.url, b.url], 131072, policy="round_robin")])

    def left_to_soon() -> float:
        """Seconds from now to `soon` (a date has whole seconds: up to 1 s less; a loaded machine may
        take seconds to start the servers, so the expected value is taken from the clock, not fixed)."""
        return written + 8 - time.time()

    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_overloaded"
    assert left_to_soon() - 2 <= int(response.headers["retry-after"]) <= 8, response.headers  # soon, not later
    again = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)  # both sit out their wait
    assert again.status_code == 503 and left_to_soon() - 2 <= int(again.headers["retry-after"]) <= 8, again.headers
    assert len(a.engine.records) == 1 and len(b.engine.records) == 1


def test_absurd_retry_after_values_are_bounded_not_a_crash(start_sim: StartSim, start_gateway: StartGateway) -> None:
    for value in ("inf", "nan", "1e400", "-5", "soon"):
        sim = start_sim("vllm", faults=SimFaults(fail_status=429, fail_count=1, fail_headers={"retry-after": value}))
        gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503, (value, response.status_code, response.text)
        wait = int(response.headers["retry-after"])
        assert 1 <= wait <= 3600, (value, wait)
