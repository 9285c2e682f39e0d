"""Bodies parsed in a parse process (gateway/parsing.py) are routed, estimated, refused and forwarded
exactly as bodies parsed on the event loop: two real gateways on loopback ports, one sending every
body to its parse processes (`parse_offload_bytes: 0`), one none, in front of the same simulator."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.serving.server import ThreadedServer
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
ESTIMATE = "x-kimi-gateway-estimated-prompt-tokens"


def png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def data_uri(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height)).decode()


@pytest.fixture
def image_server() -> Any:
    async def image(request: Request) -> Response:
        return Response(png(1000, 700), media_type="image/png")

    server = ThreadedServer(Starlette(routes=[Route("/img.png", image)])).start()
    yield server
    server.stop()


@pytest.fixture
def gateways(start_sim: StartSim, start_gateway: StartGateway,
             image_server: ThreadedServer) -> tuple[RunningSim, RunningGateway, RunningGateway]:
    sim = start_sim("vllm", max_context_tokens=200_000)
    settings: dict[str, Any] = {"load": {"enabled": False},
                                "image_fetch": {"enabled": True, "allow_networks": ["127.0.0.1/32"]}}
    pools = [pool("small", "vllm", [sim.url], 8192), pool("large", "vllm", [sim.url], 200_000)]
    offloaded = start_gateway(pools, parse_offload_bytes=0, parse_offload_items=0, **settings)
    inline = start_gateway(pools, parse_offload_bytes=1 << 30, parse_offload_items=1 << 30, **settings)
    return sim, offloaded, inline


def bodies(image_url: str) -> list[tuple[str, dict[str, Any]]]:
    long_text = "The quick brown fox jumps over the lazy dog. " * 8_000  # ~360 KB: the large pool
    return [
        ("chat", {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                  "top_k": 4, "seed": 18446744073709551615, "stream": True}),
        ("chat", {"model": "KIMI-K3", "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": long_text}], "max_tokens": 3,
                  "stream": True, "stream_options": {"continuous_usage_stats": True}}),
        ("chat", {"model": "kimi-k3", "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what are these?"},
            *[{"type": "image_url", "image_url": {"url": data_uri(300 + i % 3, 200)}} for i in range(40)],
            {"type": "image_url", "image_url": {"url": image_url}}]}]}),
        ("completions", {"model": "kimi-k3", "prompt": [5] * 30_000, "max_tokens": 3, "echo": False, "stream": True,
                         "stream_options": {"include_usage": True}}),
        ("completions", {"model": "kimi-k3", "prompt": [[1, 2, 3], [4] * 9_000], "max_tokens": 3}),
        # Refused: the answers must be the same too.
        ("chat", {"model": "kimi-k3", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("chat", {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}),
        ("chat", {"model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 400_000}]}),
        ("chat", {"model": "kimi-k3", "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(1, 1)}}] * 4_000}]}),
        ("completions", {"model": "kimi-k3", "prompt": [1, 2, "x"]}),
        ("completions", {"model": "kimi-k3", "prompt": [9] * 250_000}),
    ]


def test_offloaded_parsing_routes_and_forwards_as_inline_parsing(
        gateways: tuple[RunningSim, RunningGateway, RunningGateway], image_server: ThreadedServer) -> None:
    sim, offloaded, inline = gateways
    statuses: list[int] = []
    with httpx.Client(timeout=60) as client:
        for api, body in bodies(image_server.url + "/img.png"):
            path = "/chat/completions" if api == "chat" else "/completions"
            answers = []
            for gw in (offloaded, inline):
                before = len(sim.engine.records)
                response = client.post(gw.v1 + path, json=body)
                received = [r.body for r in sim.engine.records[before:]]
                answers.append((response.status_code, response.headers.get(ESTIMATE),
                                response.headers.get("x-kimi-gateway-pool"),
                                response.json() if response.status_code != 200 else None, received))
            assert answers[0] == answers[1], (body if len(str(body)) < 300 else str(body)[:300])
            status, estimate, _, error, received = answers[0]
            statuses.append(status)
            if status == 200:
                assert len(received) == 1 and estimate is not None
            else:
                assert status == 400 or (status == 404 and error["error"]["code"] == "model_not_found")
    assert statuses.count(200) == 5, statuses
    assert offloaded.metric("kimi_gateway_image_fetches_total") == inline.metric("kimi_gateway_image_fetches_total")
    assert offloaded.metric("kimi_gateway_image_fetches_total") >= 1
