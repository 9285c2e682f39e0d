"""An engine whose error answer echoes the request's headers (a proxy's "invalid header
Authorization: Bearer ...", a debugging build) never shows the client, or the gateway's logs, the
pool's `api_key` the gateway sent it (gateway/redact.py): in a non-2xx body, an in-stream error
event before the first content or one after it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import httpx
import pytest

from gateway.config import parse_config
from gateway.serving.reload import apply_config
from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
KEY = "sk-backend-Q7f3a9c1e5b"
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ECHO = f"invalid header: authorization: Bearer {KEY} (x-request-id: r1)"
CONTENT_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"kimi-k3","choices":'
                 b'[{"index":0,"delta":{"content":"hello"},"finish_reason":null}]}\n\n')


def error_event(code: int) -> bytes:
    error = {"error": {"message": ECHO, "type": "BadRequestError", "code": code}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


def gateway_for(start_gateway: StartGateway, sim: RunningSim) -> RunningGateway:
    return start_gateway([pool("p", "vllm", [sim.url], 131072, api_key=KEY)], load={"enabled": False})


def access_errors(caplog: pytest.LogCaptureFixture, gw: RunningGateway, count: int) -> list[str]:
    """The `error` of `gw`'s first `count` access log lines (they are written as the answers end)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(r.getMessage()) for r in caplog.records
                 if r.name == "gateway.access" and r.threadName == gw.server.thread_name]
        if len(lines) >= count:
            return [line["error"] or "" for line in lines]
        assert time.monotonic() < deadline, f"{len(lines)} access log lines, expected {count}"
        time.sleep(0.02)


@pytest.mark.parametrize(("path", "stream"), [("/chat/completions", False), ("/chat/completions", True),
                                              ("/messages", False)])
def test_an_engines_4xx_body_echoing_the_backend_key_is_relayed_redacted(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture, path: str,
        stream: bool) -> None:
    caplog.set_level(logging.INFO)
    body = json.dumps({"object": "error", "message": ECHO, "type": "BadRequestError", "param": None, "code": 400})
    sim = start_sim("vllm", api_key=KEY, faults={"fail_status": 400, "fail_body": body})
    gw = gateway_for(start_gateway, sim)
    response = httpx.post(gw.v1 + path, json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 400
    assert KEY not in response.text
    assert response.json()["error"]["message"] == ECHO.replace(KEY, "[redacted]")
    if path == "/messages":
        assert response.json()["type"] == "error"
    access_errors(caplog, gw, 1)
    assert KEY not in caplog.text


@pytest.mark.parametrize("code", [400, 500])
def test_an_error_event_before_content_echoing_the_backend_key_is_redacted(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture, code: int) -> None:
    """400: the engine's answer to the request, passed on; 500: a failed attempt whose detail (the
    event's text) goes into the 502's message and the access log."""
    caplog.set_level(logging.INFO)
    faults = {"raw_stream_chunks": SimFaults.encode_chunks([error_event(code)])}
    sim = start_sim("vllm", api_key=KEY, faults=faults)
    gw = gateway_for(start_gateway, sim)
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert response.status_code == (400 if code == 400 else 502), response.text
    assert KEY not in response.text and "[redacted]" in response.json()["error"]["message"]
    assert "[redacted]" in access_errors(caplog, gw, 1)[0] or code == 400
    assert KEY not in caplog.text


def test_an_error_event_mid_stream_echoing_the_backend_key_is_relayed_redacted(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    faults = {"raw_stream_chunks": SimFaults.encode_chunks([CONTENT_EVENT, error_event(500)])}
    sim = start_sim("vllm", api_key=KEY, faults=faults)
    gw = gateway_for(start_gateway, sim)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        text = response.read().decode()
    assert "hello" in text and KEY not in text
    assert ECHO.replace(KEY, "[redacted]") in text  # the engine's error event, relayed without the key
    access_errors(caplog, gw, 1)
    assert KEY not in caplog.text


def test_a_key_a_reload_brings_is_redacted_too(start_sim: StartSim, start_gateway: StartGateway) -> None:
    new_key = "sk-rotated-Z9k2m4p6r8"
    body = json.dumps({"object": "error", "message": f"bad header: Bearer {new_key}", "code": 400})
    sim = start_sim("vllm", faults={"fail_status": 400, "fail_body": body})
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    new = parse_config({"pools": [pool("p", "vllm", [sim.url], 131072, api_key=new_key)],
                        "health": {"verify_models": False}, "load": {"enabled": False}}, environ={})

    async def apply() -> None:
        apply_config(gw.server.app.state.gateway, new)

    gw.server.call(apply())
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400 and new_key not in response.text
    assert response.json()["error"]["message"] == "bad header: Bearer [redacted]"
