"""What a browser page or a hostile engine could make the gateway's origin serve (issue 15 §4):
engine content types, `nosniff`, simple cross-site requests, DNS rebinding against the admin API."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.serving.server import ThreadedServer
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SCRIPT = b"<html><script>fetch('/admin/status')</script></html>"


class HostileEngine:
    """An engine that answers every generation request 200 with `content_type` (raw header bytes)
    and `body`, and every GET (health probes, /metrics) with an empty 200."""

    def __init__(self, content_type: bytes, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        self.posts = 0
        self._headers = [(b"content-type", content_type), *(extra or [])]
        self._body = body
        self.server = ThreadedServer(self._app, lifespan="off", interface="asgi3")

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = scope["method"] == "POST"
        while more:
            more = (await receive()).get("more_body", False)
        if scope["method"] == "POST":
            self.posts += 1
            headers, body = self._headers, self._body
        else:
            headers, body = [(b"content-type", b"text/plain")], b""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize(("content_type", "extra", "stream"), [
    (b"text/html; charset=utf-8", [], False),
    (b"text/html", [], True),
    (b"application/json\xe2\x98\x83", [], False),  # not Latin-1: was a 500
    (b"text/event-stream\xe2\x98\x83", [], True),
    (b"application/javascript", [], False),
    (b"application/json", [(b"content-encoding", b"gzip\xe2\x98\x83")], False),
])
def test_an_engine_answer_of_another_content_type_is_an_upstream_error_tried_elsewhere(
        start_sim: StartSim, start_gateway: StartGateway, content_type: bytes, extra: list[tuple[bytes, bytes]],
        stream: bool) -> None:
    hostile = HostileEngine(content_type, SCRIPT, extra)
    with hostile.server:
        good = start_sim("vllm")
        gw = start_gateway([pool("p", "vllm", [hostile.server.url, good.url], 131072, policy="round_robin")])
        for _ in range(4):
            response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream})
            assert response.status_code == 200, response.text
            assert response.headers["x-kimi-gateway-worker"] == "p/1"
            expected = "text/event-stream" if stream else "application/json"
            assert response.headers["content-type"].split(";")[0] == expected
            assert response.headers["x-content-type-options"] == "nosniff"
            assert b"<script>" not in response.content
        assert hostile.posts >= 1
        assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="protocol_error",pool="p",worker="p/0"}') \
            == hostile.posts
        # With only the hostile engine: an upstream error (502), never its page and never a 500.
        alone = start_gateway([pool("p", "vllm", [hostile.server.url], 131072)])
        response = httpx.post(alone.v1 + "/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error", response.text
        assert "content" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", "/nowhere", "/dashboard",
                                  "/v1/chat/completions"])
def test_every_answer_says_nosniff(start_sim: StartSim, start_gateway: StartGateway, path: str) -> None:
    gw = start_gateway([pool("p", "vllm", [start_sim("vllm").url], 131072)])
    response = httpx.get(gw.url + path)
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers.get_list("x-content-type-options") == ["nosniff"]


@pytest.mark.parametrize(("headers", "content"), [
    ({"content-type": "text/plain", "origin": "https://evil.example"}, b'{"model": "kimi-k3"}'),
    ({"content-type": "text/plain;charset=UTF-8"}, b'{"model": "kimi-k3"}'),
    ({"content-type": "application/x-www-form-urlencoded"}, b'{"model": "kimi-k3"}'),
    ({"content-type": "multipart/form-data; boundary=x"}, b'--x\r\n\r\n{}\r\n--x--'),
    ({"origin": "https://evil.example"}, b'{"model": "kimi-k3"}'),  # a Blob body: no content type at all
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_with_auth_off_a_body_a_page_can_post_cross_site_is_refused_415(
        start_sim: StartSim, start_gateway: StartGateway, headers: dict[str, str], content: bytes, path: str) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    request = {**CHAT, "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {
        "model": "kimi-k3", "prompt": "hi", "max_tokens": 2}
    body = content.replace(b'{"model": "kimi-k3"}', json.dumps(request).encode())
    refused = httpx.post(gw.url + path, content=body, headers=headers)
    assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_media_type", refused.text
    assert not sim.engine.records
    for allowed in ({"content-type": "application/json"}, {"content-type": "application/json; charset=utf-8"},
                    {}):  # no Origin and no type: a script, not a page
        assert httpx.post(gw.url + path, content=json.dumps(request).encode(), headers=allowed).status_code == 200
