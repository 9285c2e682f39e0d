"""CORS for browser clients: preflights answered without a key, headers on every answer, streams unbuffered."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.auth.conftest import ALICE_KEY, auth_section
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
ORIGIN = "https://chat.example.com"


@pytest.fixture
def gw(start_sim: StartSim, start_gateway: StartGateway) -> RunningGateway:
    sim = start_sim("vllm", tpot_s=0.05)
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth_section(), load={"enabled": False},
                         cors={"enabled": True, "allow_origins": [ORIGIN]})


def test_preflight_needs_no_key(gw: RunningGateway) -> None:
    requested = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
    answer = httpx.options(gw.v1 + "/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST", "access-control-request-headers": requested})
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert answer.headers["access-control-allow-headers"] == requested
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-max-age"] == "600"
    assert "Origin" in answer.headers["vary"]

    other = httpx.options(gw.v1 + "/chat/completions", headers={
        "origin": "https://evil.example.com", "access-control-request-method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_errors_carry_cors_headers(gw: RunningGateway) -> None:
    answer = httpx.post(gw.v1 + "/chat/completions", headers={"origin": ORIGIN}, json={})
    assert answer.status_code == 401
    assert answer.headers["access-control-allow-origin"] == ORIGIN  # the browser may read the error


def test_a_stream_with_cors_is_relayed_as_it_is_generated(gw: RunningGateway) -> None:
    body = {"model": "kimi-k3", "stream": True, "max_tokens": 12, "messages": [{"role": "user", "content": "Count."}]}
    headers = {"origin": ORIGIN, "authorization": f"Bearer {ALICE_KEY}"}
    started = time.monotonic()
    arrivals: list[float] = []
    chunks: list[bytes] = []
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=headers) as answer:
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        exposed = answer.headers["access-control-expose-headers"]
        assert "x-request-id" in exposed and "x-kimi-gateway-pool" in exposed
        for chunk in answer.iter_raw():
            arrivals.append(time.monotonic() - started)
            chunks.append(chunk)
    text = b"".join(chunks).decode()
    assert text.count("data: {") == 13 and text.rstrip().endswith("data: [DONE]")
    # 12 tokens 50 ms apart: the first bytes arrive long before the last (nothing buffers the stream).
    assert arrivals[-1] - arrivals[0] >= 0.3
