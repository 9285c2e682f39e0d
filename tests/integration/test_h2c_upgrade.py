"""An `Upgrade: h2c` offer is ignored and the request served over HTTP/1.1.

Java's HttpClient (HTTP_2 preferred, plain http) and `curl --http2` send every request with
`Connection: Upgrade, HTTP2-Settings`, `Upgrade: h2c` and an `HTTP2-Settings` header. A server that
does not switch protocols answers the request as HTTP/1.1 (RFC 9110 §7.8: "A server MAY ignore a
received Upgrade header field"), as the engines' own servers (uvicorn + h11) and nginx do. A
websocket offer on a POST is no handshake (RFC 6455 §4.1: a GET) and is ignored the same way; a
GET handshake is refused (403: the gateway serves no websocket endpoint)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.integration.test_client_http_framing import raw_exchange, request_bytes
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"


@pytest.fixture
def gateway(start_sim: StartSim, start_gateway: StartGateway) -> RunningGateway:
    sim = start_sim("vllm")
    return start_gateway([pool("p", "vllm", [sim.url], 131072)])


def test_a_post_with_an_h2c_offer_is_served_over_http11(gateway: RunningGateway) -> None:
    body = json.dumps(CHAT).encode()
    # Twice on one connection: the offer leaves the connection HTTP/1.1 and kept alive.
    (status, headers, answer), (status2, _, answer2) = raw_exchange(
        gateway, request_bytes(body, H2C) * 2, responses=2)
    assert (status, status2) == (200, 200), (answer, answer2)
    assert len(json.loads(answer)["choices"][0]["message"]["content"].split()) == 3
    assert json.loads(answer2)["object"] == "chat.completion"
    assert "upgrade" not in headers  # no 101, no switch offered back


def test_an_h2c_offers_body_that_comes_in_later_reads(gateway: RunningGateway) -> None:
    """The head alone, then the body in two writes: the request waits for all of it."""
    body = json.dumps(CHAT).encode()
    data = request_bytes(body, H2C)
    head = data[:data.index(b"\r\n\r\n") + 4]
    with socket.create_connection((gateway.server.host, gateway.server.port), timeout=10) as sock:
        for part in (head, body[:10], body[10:]):
            sock.sendall(part)
            time.sleep(0.05)
        received = b""
        while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 "), received[:300]
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["object"] == "chat.completion"


def test_a_streamed_post_with_an_h2c_offer_and_a_chunked_body(gateway: RunningGateway) -> None:
    body = json.dumps({**CHAT, "stream": True}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + H2C
            + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    [(status, headers, answer)] = raw_exchange(gateway, data)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), answer
    assert answer.endswith(b"data: [DONE]\n\n")


def test_a_get_with_an_h2c_offer_is_answered_as_http11(gateway: RunningGateway) -> None:
    data = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + H2C + b"\r\n"
    (status, _, answer), (status2, _, _) = raw_exchange(gateway, data * 2, responses=2)
    assert (status, status2) == (200, 200), answer
    assert any(m["id"] == "kimi-k3" for m in json.loads(answer)["data"])


def test_a_websocket_handshake_is_refused(gateway: RunningGateway) -> None:
    """A real handshake (a GET): the gateway serves no websocket endpoint, so it is refused (403, an
    OpenAI error object, the connection closed) at once, and the gateway goes on serving."""
    data = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    [(status, _, answer)] = raw_exchange(gateway, data, timeout=5)
    assert status == 403 and json.loads(answer)["error"]["code"] == "websocket_not_supported"
    [(status, _, _)] = raw_exchange(gateway, request_bytes(json.dumps(CHAT).encode(), H2C))
    assert status == 200


def test_a_post_with_a_websocket_offer_is_served_not_switched(gateway: RunningGateway) -> None:
    offer = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: eA==\r\n"
    [(status, _, answer)] = raw_exchange(gateway, request_bytes(json.dumps(CHAT).encode(), offer))
    assert status == 200, answer
    assert json.loads(answer)["object"] == "chat.completion"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_http2_over_plain_http(gateway: RunningGateway) -> None:
    """`curl --http2` on an http:// URL offers h2c on the first request (curl's Upgrade request)."""
    done = subprocess.run(
        ["curl", "--http2", "-sS", "--max-time", "20", "-o", "-", "-w", "\n%{http_code} %{http_version}",
         "-H", "content-type: application/json", "--data-binary", json.dumps(CHAT), gateway.v1 + "/chat/completions"],
        capture_output=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    answer, _, status = done.stdout.rpartition(b"\n")
    assert status == b"200 1.1", (status, answer, done.stderr)
    assert json.loads(answer)["object"] == "chat.completion"
