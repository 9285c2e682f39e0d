"""HTTP/1.1 pipelining with a request the gateway refuses early (before its body is read, or before
its turn): every request before it is answered, it is answered in its turn, and every request
after it is answered or the connection closes, within a bound. Never a hang, never an answer lost
because a later request was refused first.

The refusals: the auth middleware's 401 (no key), a body the gateway cannot parse (400), a declared
body over `max_body_bytes` (413, connection closed), a content coding it does not decode (415), a
head over `max_header_bytes` (431, the guarded protocol's), and a websocket handshake (403: the
gateway serves no websocket endpoint; uvicorn used to switch protocols at once, before the
requests pipelined ahead of it were answered)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import h11
import pytest

from gateway.auth.keys import hash_key
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

KEY = "sk-pipelined"
BOUND_S = 30.0  # generous: a loaded 2-core box; a hang is what fails, not a slow answer
MAX_BODY = 4000
MAX_HEAD = 4000
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
STREAM = {**CHAT, "max_tokens": 8, "stream": True}  # still streaming when the next requests arrive
WEBSOCKET = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
             b"X-Request-ID: refused\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")

Answer = tuple[int, dict[str, str], bytes]


def post(body: bytes, request_id: str, extra: bytes = b"", key: bool = True, length: int | None = None) -> bytes:
    """One pipelined chat request's bytes (`length`: a declared Content-Length other than the body's)."""
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if key else b""
    declared = len(body) if length is None else length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
            + b"X-Request-ID: " + request_id.encode() + b"\r\n" + extra
            + b"Content-Length: " + str(declared).encode() + b"\r\n\r\n" + body)


def good(request_id: str, stream: bool = False) -> bytes:
    return post(json.dumps(STREAM if stream else CHAT).encode(), request_id)


REFUSED: dict[str, tuple[bytes, int]] = {
    "no key": (post(json.dumps(CHAT).encode(), "refused", key=False), 401),
    "unparsable body": (post(b"{not json", "refused"), 400),
    "declared body too large": (post(json.dumps({**CHAT, "pad": "x" * MAX_BODY}).encode(), "refused"), 413),
    "content coding": (post(json.dumps(CHAT).encode(), "refused", b"Content-Encoding: gzip\r\n"), 415),
    "head too large": (post(json.dumps(CHAT).encode(), "refused", b"X-Big: " + b"y" * MAX_HEAD + b"\r\n"), 431),
    "websocket handshake": (WEBSOCKET, 403),
}


def pipelined(gw: RunningGateway, data: bytes, expected: int) -> tuple[list[Answer], bool]:
    """Send `data` in one write on one connection; read the answers in order until `expected` are
    complete or the gateway closes the connection: (the answers, whether it closed). Fails when
    neither happens within BOUND_S seconds (a hang)."""
    conn = h11.Connection(our_role=h11.CLIENT)
    answers: list[Answer] = []
    deadline = time.monotonic() + BOUND_S
    with socket.create_connection((gw.server.host, gw.server.port), timeout=1.0) as sock:
        sock.sendall(data)
        status, headers, body = 0, {}, b""
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
        conn.send(h11.EndOfMessage())  # h11 parses an answer only to a request it believes it sent
        while len(answers) < expected:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                assert time.monotonic() < deadline, f"no answer or close within {BOUND_S} s after {answers}"
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    return answers, True
                if not chunk:
                    return answers, True
                conn.receive_data(chunk)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                answers.append((status, headers, body))
                status, headers, body = 0, {}, b""
                if conn.their_state is h11.MUST_CLOSE:  # `connection: close`: the end must follow
                    return answers, _closes(sock, deadline)
                if len(answers) < expected:
                    conn.start_next_cycle()
                    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
                    conn.send(h11.EndOfMessage())
    return answers, False


def _closes(sock: socket.socket, deadline: float) -> bool:
    """True once the peer closes `sock` (EOF or reset), any bytes before that dropped; False at `deadline`."""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
        if not chunk:
            return True
        raise AssertionError(f"bytes after an answer that closes the connection: {chunk[:200]!r}")
    return False


@pytest.fixture
def gateway(start_sim: StartSim, start_gateway: StartGateway) -> RunningGateway:
    sim = start_sim("vllm", tpot_s=0.05)
    auth = {"enabled": True, "keys": [{"name": "k", "sha256": hash_key(KEY)}]}
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], max_body_bytes=MAX_BODY,
                         max_header_bytes=MAX_HEAD, auth=auth)


def test_requests_pipelined_before_a_websocket_handshake_are_answered_first(gateway: RunningGateway) -> None:
    """A stream, then a websocket handshake, then a chat request, in one write: the stream is
    answered whole, then the handshake gets its 403 (OpenAI error object) and the connection closes.
    uvicorn switched to its websocket protocol on parsing the handshake: the stream before it was
    cut unanswered (its writes failed on the closed transport)."""
    answers, closed = pipelined(gateway, good("first", stream=True) + WEBSOCKET + good("after"), 3)
    assert [status for status, _, _ in answers[:2]] == [200, 403], answers
    first, refusal = answers[0], answers[1]
    assert first[1]["x-request-id"] == "first" and first[2].endswith(b"data: [DONE]\n\n")
    assert json.loads(refusal[2])["error"]["code"] == "websocket_not_supported"
    assert closed and len(answers) == 2  # the connection ends with the refusal


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("refusal", list(REFUSED))
def test_every_pipelined_request_is_answered_in_order_or_the_connection_closes(
        gateway: RunningGateway, refusal: str, position: int) -> None:
    data, status = REFUSED[refusal]
    requests = [good("one", stream=True), good("two")]
    requests.insert(position, data)
    answers, closed = pipelined(gateway, b"".join(requests), 3)
    statuses = [s for s, _, _ in answers]
    expected = [200, 200]
    expected.insert(position, status)
    # Everything up to the refused request is answered, in order; after it, answered or closed.
    assert statuses[:position + 1] == expected[:position + 1], (statuses, closed)
    assert statuses == expected[:len(statuses)], statuses
    assert len(statuses) == 3 or closed, statuses
    if status in (413, 431, 403):  # refusals that end the connection
        assert closed and len(statuses) == position + 1, statuses
    ids = [headers.get("x-request-id") for s, headers, _ in answers if s == 200]
    assert ids == [rid for rid in ("one", "two")][:len(ids)]
