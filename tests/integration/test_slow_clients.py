"""Clients that hold a connection without using it (issue 15): a reader that stops reading, a body
trickled byte by byte, request heads over the size limit. Real sockets against a real gateway."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}
EVENT = b'data: {"id":"a","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
BIG_COMMENT = b": " + b"x" * (256 * 1024 - 4) + b"\n\n"  # an SSE comment of 256 KiB


def _post_head(body_length: int, stream_path: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n" % (stream_path.encode(), body_length, extra))


def _connect(gw: RunningGateway, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window is small from the handshake on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", gw.server.port))
    return sock


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything until the gateway closes the connection (or `timeout` seconds without a byte)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_stops_reading_is_cut_and_the_engine_request_aborted(
        start_sim: StartSim, start_gateway: StartGateway, path: str) -> None:
    # 40 MiB over ~3 s (the sim pauses 20 ms between writes): the engine is still sending when
    # the gateway gives up on the client (about 1 s after the ~4 MB of socket buffers toward it filled).
    chunks = [EVENT, *[BIG_COMMENT] * 160, b"data: [DONE]\n\n"]
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)))
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"send_stall": 1.0})
    request = {**CHAT, "stream": True} if path.endswith("chat/completions") else {
        "model": "kimi-k3", "prompt": "hi", "stream": True}
    body = json.dumps(request).encode()
    sock = _connect(gw, rcvbuf=4096)
    sock.sendall(_post_head(len(body), path) + body)  # and then never read
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=20)
    assert not record.completed
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_client_send_stalls_total{pool="p"}') == 1
    assert gw.metric('kimi_gateway_client_disconnects_total{pool="p",stage="send_stalled"}') == 1
    received = _read_all(sock, timeout=5)  # the gateway ended the connection: what was buffered, then the end
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    sock.close()
    # A client that reads gets the whole answer (10 MiB): writing pauses and resumes all along, never stalls.
    # (Its ~14 MB request, the answer's base64, takes a while to encode, relay and decode on a busy CPU.)
    faults = {"raw_stream_chunks": SimFaults.encode_chunks([EVENT, *[BIG_COMMENT] * 40, b"data: [DONE]\n\n"])}
    with httpx.stream("POST", gw.url + path, json={**request, "x_sim_faults": faults}, timeout=30) as response:
        assert sum(len(chunk) for chunk in response.iter_raw()) > 40 * len(BIG_COMMENT)
    assert gw.metric("kimi_gateway_client_send_stalls_total") == 1


@pytest.mark.parametrize(("first", "rate"), [
    (0, 64 * 1024),  # one byte at a time from the start: cut after body_deadline
    (200_000, 1024 * 1024),  # a quick start earns ~0.2 s more, then the trickle is cut
])
def test_a_body_trickled_a_byte_at_a_time_gets_408_at_its_deadline(
        start_sim: StartSim, start_gateway: StartGateway, first: int, rate: int) -> None:
    sim = start_sim("vllm")
    # body_idle (under the deadline) well above the 0.3 s gaps: a busy CPU stretches a gap (the sleep,
    # then this thread's turn), and one past body_idle is the other 408 ("stalled"), not the deadline's.
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"body_idle": 0.9, "body_deadline": 1.0, "body_min_rate": rate})
    body = json.dumps({**CHAT, "user": "u" * first}).encode()
    sock = _connect(gw)
    started = time.monotonic()
    sock.sendall(_post_head(len(body)) + body[:first + 1])
    sock.setblocking(False)
    answer = b""
    for byte in body[first + 1:first + 13]:  # 12 bytes 0.3 s apart (3.6 s), each gap under body_idle
        time.sleep(0.3)
        try:
            answer += sock.recv(65536)
            break
        except BlockingIOError:
            sock.send(bytes([byte]))
    cut_after = time.monotonic() - started
    answer += _read_all(sock, timeout=5)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"arrived too slowly" in answer
    assert cut_after < 1.0 + first / rate + 1.0
    assert not sim.engine.records


def _head_answers(gw: RunningGateway, data: bytes) -> list[bytes]:
    """The status lines the gateway answers `data` (sent in one write) with, until it closes."""
    sock = _connect(gw)
    sock.sendall(data)
    received = _read_all(sock, timeout=5)
    sock.close()
    return re.findall(rb"HTTP/1\.1 \d{3} [^\r]*", received)


@pytest.mark.parametrize("fields", [
    [b"x-big: " + b"a" * 100_000],  # one large field
    [b"x-f%d: %s" % (i, b"b" * 40) for i in range(2_000)],  # many small ones (~100 KB)
    [b"x-big: " + b"a" * (64 * 1024 - 200)],  # just over, with the request line and the other fields
])
def test_a_whole_request_head_over_the_limit_in_one_read_gets_431(start_sim: StartSim, start_gateway: StartGateway,
                                                                 fields: list[bytes]) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = json.dumps(CHAT).encode()
    head = _post_head(len(body), extra=b"".join(field + b"\r\n" for field in fields))
    if len(head) < 64 * 1024:  # the third case: pad to just past the limit
        head = head[:-2] + b"x-pad: " + b"p" * (64 * 1024 + 8 - len(head) - 9) + b"\r\n\r\n"
    assert len(head) > 64 * 1024
    assert _head_answers(gw, head + body) == [b"HTTP/1.1 431 Request Header Fields Too Large"]
    assert not sim.engine.records
    # Pipelined behind a request that is served: that one is answered, the big one refused.
    small = _post_head(len(body)) + body
    assert _head_answers(gw, small + head + body) == [b"HTTP/1.1 200 OK",
                                                      b"HTTP/1.1 431 Request Header Fields Too Large"]
    # A head a little under the limit is served.
    under = head[:-2 - (len(head) - 64 * 1024) - 64].replace(b"\r\n", b"\r\nconnection: close\r\n", 1) + b"\r\n\r\n"
    assert len(under) < 64 * 1024
    assert _head_answers(gw, under + body) == [b"HTTP/1.1 200 OK"]


def test_an_unfinished_head_over_the_limit_in_its_first_read_gets_431_at_once(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw = start_gateway([pool("p", "vllm", [start_sim("vllm").url], 131072)], timeouts={"header": 30})
    sock = _connect(gw)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 150_000)  # never ends
    started = time.monotonic()
    answer = _read_all(sock, timeout=10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431 ") and time.monotonic() - started < 5
