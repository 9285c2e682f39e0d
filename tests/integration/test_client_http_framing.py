"""What a client may send over HTTP/1.1 and how it is framed: bodies of 500 images or 10 MB of text
(routed or refused by size), chunked bodies over the limit, compressed bodies, 64-bit integers,
stalled uploads, header injection over raw sockets (refused, never reflected), pipelining, request
heads bounded in size and time, and unparsable HTTP (a JSON 400, the gateway serving on). The
engine's side of the wire: test_engine_http_framing.py."""

from __future__ import annotations

import base64
import gzip
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h11
import httpx
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def three_pools(start_sim: StartSim, start_gateway: StartGateway) -> tuple[RunningGateway, dict[str, RunningSim]]:
    sims = {
        "vllm-128k": start_sim("vllm", max_context_tokens=131072),
        "sglang-512k": start_sim("sglang", max_context_tokens=524288),
        "nvl72-1m": start_sim("vllm", max_context_tokens=1048576),
    }
    gw = start_gateway([pool("vllm-128k", "vllm", [sims["vllm-128k"].url], 131072),
                        pool("sglang-512k", "sglang", [sims["sglang-512k"].url], 524288),
                        pool("nvl72-1m", "vllm", [sims["nvl72-1m"].url], 1048576)])
    return gw, sims


def assert_openai_error(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text[:1000]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code


# --- many images, huge strings, oversize chunked bodies ------------------------------------------


def test_500_images_in_one_message(three_pools: tuple[RunningGateway, dict[str, RunningSim]],
                                   shared_data: Path) -> None:
    gw, sims = three_pools
    small = sorted((shared_data / "images").glob("*_48.png")) + sorted((shared_data / "images").glob("*_64.*"))
    assert small, "small images expected in the shared data"
    uris = [f"data:image/{p.suffix[1:].replace('jpg', 'jpeg')};base64," + base64.b64encode(p.read_bytes()).decode()
            for p in small]
    parts: list[dict[str, object]] = [{"type": "text", "text": "Describe every picture."}]
    for i in range(500):
        url = f"https://images.example.com/{i}.png" if i % 2 else uris[i % len(uris)]
        parts.append({"type": "image_url", "image_url": {"url": url}})
    body = {"model": "kimi-k3", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
    response = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text[:1000]
    # 250 URLs at the configured 1,280 tokens each alone are 320K tokens: more than 128K, under 512K.
    estimate = int(response.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
    assert 250 * 1280 + 250 * 64 <= estimate < 524288
    assert response.headers["x-kimi-gateway-pool"] == "sglang-512k"
    received = sims["sglang-512k"].engine.records[-1].body
    assert received["messages"][0]["content"] == parts  # forwarded unchanged, all 501 parts


def test_10mb_string_is_context_length_exceeded(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = three_pools
    text = "lorem ipsum " * (10 * 1024 * 1024 // 12)  # ~10 MB: ~3M estimated tokens, more than the 1M pool
    for path, body in (("/chat/completions", {"model": "kimi-k3", "messages": [{"role": "user", "content": text}]}),
                       ("/completions", {"model": "kimi-k3", "prompt": text})):
        response = httpx.post(gw.v1 + path, json=body, timeout=30)
        assert_openai_error(response, 400, "context_length_exceeded")
        assert "1048576" in response.json()["error"]["message"]
    assert all(not s.engine.records for s in sims.values())
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT).status_code == 200


def test_chunked_body_over_the_limit_is_413(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_body_bytes=10_000)

    def chunks() -> object:
        yield b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"a" * 1000
        yield b'"}]}'

    response = httpx.post(gw.v1 + "/chat/completions", content=chunks(),  # type: ignore[arg-type]
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413, "request_too_large")
    assert not sim.engine.records
    # A chunked body under the limit is fine.
    small = httpx.post(gw.v1 + "/chat/completions", content=iter([json.dumps(CHAT).encode()]),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text


# --- raw sockets ---------------------------------------------------------------------------------


Exchange = tuple[int, dict[str, str], bytes]


def raw_exchange(gw: RunningGateway, data: bytes, responses: int = 1, timeout: float = 10.0) -> list[Exchange]:
    """Send raw bytes on one connection; parse `responses` HTTP responses in order with h11."""
    conn = h11.Connection(our_role=h11.CLIENT)
    results: list[Exchange] = []
    with socket.create_connection((gw.server.host, gw.server.port), timeout=timeout) as sock:
        sock.sendall(data)
        for index in range(responses):
            if index:
                conn.start_next_cycle()
            # h11 must believe it sent a request to parse a response: feed it a dummy one (not sent).
            conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            status, headers, body = 0, {}, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    chunk = sock.recv(65536)
                    conn.receive_data(chunk)
                    if not chunk:
                        raise AssertionError(f"connection closed after {len(results)} responses")
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            results.append((status, headers, body))
    return results


def request_bytes(body: bytes, extra_headers: bytes = b"", path: bytes = b"/v1/chat/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra_headers
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@pytest.mark.parametrize("value", [
    b"abc\nX-Injected: yes",          # a bare LF inside a value
    b"abc\rX-Injected: yes",          # a bare CR inside a value
    b"abc\r\n X-Injected: yes",        # obsolete line folding
    b"abc\x00X-Injected: yes",        # NUL
])
def test_header_injection_attempts_are_refused_and_never_reflected(start_sim: StartSim, start_gateway: StartGateway,
                                                                   value: bytes) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    data = request_bytes(json.dumps(CHAT).encode(), b"X-Request-ID: " + value + b"\r\n")
    with socket.create_connection((gw.server.host, gw.server.port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 "), received[:200]
    assert b"x-injected" not in head
    status = int(head.split()[1])
    if status == 200:  # the server accepted the value: then it must not have reached the engine as a header
        for record in sim.engine.records:
            assert "x-injected" not in record.headers
            assert "\n" not in record.headers.get("x-request-id", "") and "\r" not in record.headers.get(
                "x-request-id", "")
    else:
        assert 400 <= status < 500
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT).status_code == 200


def test_request_id_with_an_encoded_crlf_is_kept_verbatim_not_decoded(start_sim: StartSim,
                                                                        start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    [(status, headers, _)] = raw_exchange(gw, request_bytes(json.dumps(CHAT).encode(),
                                                            b"X-Request-ID: a%0d%0aX-Injected:%20yes\r\n"))
    assert status == 200
    assert headers["x-request-id"] == "a%0d%0aX-Injected:%20yes"
    assert "x-injected" not in headers
    assert re.fullmatch("[0-9a-f]{32}-1", sim.engine.records[-1].headers["x-request-id"])  # the engine: the gateway's
    # obs-text (latin-1 bytes) is legal on the wire but is not kept as an id: replaced by a fresh one.
    [(status, headers, _)] = raw_exchange(gw, request_bytes(json.dumps(CHAT).encode(), b"X-Request-ID: caf\xe9\r\n"))
    assert status == 200 and len(headers["x-request-id"]) == 32


def test_http11_pipelining_two_requests_on_one_socket(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.01)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    first = request_bytes(json.dumps({**CHAT, "max_tokens": 5, "stream": True}).encode(), b"X-Request-ID: one\r\n")
    second = request_bytes(json.dumps({**CHAT, "max_tokens": 3}).encode(), b"X-Request-ID: two\r\n")
    third = request_bytes(json.dumps({"model": "kimi-k3", "prompt": "x", "max_tokens": 1}).encode(),
                          b"X-Request-ID: three\r\n", path=b"/v1/completions")
    results = raw_exchange(gw, first + second + third, responses=3)
    assert [(status, headers["x-request-id"]) for status, headers, _ in results] == [
        (200, "one"), (200, "two"), (200, "three")]
    stream_body = results[0][2]
    assert stream_body.rstrip().endswith(b"data: [DONE]")
    assert json.loads(results[1][2])["usage"]["completion_tokens"] == 3
    assert json.loads(results[2][2])["object"] == "text_completion"
    assert [r.path for r in sim.engine.records] == ["/v1/chat/completions"] * 2 + ["/v1/completions"]
    assert len({r.headers["x-request-id"] for r in sim.engine.records}) == 3  # the gateway's engine ids


def test_pipelined_request_after_a_bad_one_is_still_answered(start_sim: StartSim,
                                                             start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    bad = request_bytes(b"{not json", b"X-Request-ID: bad\r\n")
    good = request_bytes(json.dumps(CHAT).encode(), b"X-Request-ID: good\r\n")
    results = raw_exchange(gw, bad + good, responses=2)
    assert [(status, headers["x-request-id"]) for status, headers, _ in results] == [(400, "bad"), (200, "good")]
    assert json.loads(results[0][2])["error"]["code"] == "invalid_json"


def test_unread_oversize_body_is_never_parsed_as_a_pipelined_request(start_sim: StartSim,
                                                                      start_gateway: StartGateway) -> None:
    """A 413 is answered before the body is read; the body must not then be taken for a new request."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_body_bytes=1000)
    smuggled = request_bytes(json.dumps(CHAT).encode(), b"X-Request-ID: smuggled\r\n")
    oversize = request_bytes(smuggled + b" " * (1100 - len(smuggled)), b"X-Request-ID: big\r\n")
    follower = request_bytes(json.dumps(CHAT).encode(), b"X-Request-ID: follower\r\n")
    received = b""
    with socket.create_connection((gw.server.host, gw.server.port), timeout=5) as sock:
        sock.sendall(oversize + follower)
        deadline = time.monotonic() + 5
        while received.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    statuses = [line.split()[1] for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses[0] == b"413"
    assert statuses[1:] in ([], [b"200"]), received  # the follower is answered, or the connection closed
    ids = [line.split(b":", 1)[1].strip() for line in received.split(b"\r\n")
           if line.lower().startswith(b"x-request-id")]
    assert b"smuggled" not in ids
    assert all(r.headers.get("x-request-id") != "smuggled" for r in sim.engine.records)


def test_compressed_bodies_get_415_and_identity_is_served(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    raw = json.dumps(CHAT).encode()
    for encoding, body in (("gzip", gzip.compress(raw)), ("gzip", raw), ("br", raw), ("GZIP, identity", raw)):
        answer = httpx.post(gw.v1 + "/chat/completions", content=body,
                            headers={"content-type": "application/json", "content-encoding": encoding})
        assert_openai_error(answer, 415, "unsupported_media_type")
        assert "send the JSON body uncompressed" in answer.json()["error"]["message"]
    assert not sim.engine.records
    served = httpx.post(gw.v1 + "/chat/completions", content=raw,
                        headers={"content-type": "application/json", "content-encoding": "identity"})
    assert served.status_code == 200 and len(sim.engine.records) == 1


def test_64_bit_integers_reach_the_engine_exactly_and_larger_ones_are_400(start_sim: StartSim,
                                                                          start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    head = json.dumps(CHAT)[:-1].encode()
    over = httpx.post(gw.v1 + "/chat/completions", content=head + b', "seed": 18446744073709551616}')
    assert_openai_error(over, 400, "integer_out_of_range")
    assert over.json()["error"]["param"] == "seed"
    assert not sim.engine.records
    edge = httpx.post(gw.v1 + "/chat/completions", content=head + b', "seed": 18446744073709551615}')
    assert edge.status_code == 200
    assert sim.engine.records[0].body["seed"] == 18446744073709551615


def test_a_stalled_upload_gets_408_and_a_slow_live_one_is_served(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    # body_idle well above the trickle's 0.2 s gaps below, which a busy CPU stretches (the sleep, then
    # this thread's turn): one past body_idle would be a stall too.
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"body_idle": 1.0})
    body = json.dumps(CHAT).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body[:10])  # then nothing more
        started = time.monotonic()
        answer = conn.recv(65536)
        assert time.monotonic() - started < 3
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer.replace(b" ", b"")
    assert b"no byte of it for 1 seconds (10 bytes received)" in answer

    def trickle() -> Iterator[bytes]:  # 8 pieces 0.2 s apart: 1.6 s in all, never idle for 1 s
        step = len(body) // 8 + 1
        for i in range(0, len(body), step):
            time.sleep(0.2)
            yield body[i:i + step]

    served = httpx.post(gw.v1 + "/chat/completions", content=trickle(), timeout=10,
                        headers={"content-type": "application/json"})
    assert served.status_code == 200 and len(sim.engine.records) == 1


def _raw(gw: RunningGateway, data: bytes, wait: float = 5.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; everything the gateway answers until it closes, and when."""
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as conn:
        started = time.monotonic()
        if data:
            conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return received, time.monotonic() - started


def test_request_heads_are_bounded_in_size_and_time(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_header_bytes=4096,
                       timeouts={"header": 0.5})
    line = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
    big, _ = _raw(gw, line + b"x-big: " + b"a" * 200_000)  # a header that never ends
    assert big.startswith(b"HTTP/1.1 431 ") and b'"code":"request_header_fields_too_large"' in big
    slow, took = _raw(gw, line + b"x-half: ")  # half a head, then nothing
    assert slow.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in slow and 0.4 < took < 3
    silent, took = _raw(gw, b"")  # connected, sent nothing
    assert silent == b"" and 0.4 < took < 3
    assert not sim.engine.records
    # Ordinary requests, and a kept-alive connection used again after more than the head timeout.
    with httpx.Client(base_url=gw.v1) as client:
        for _ in range(2):
            assert client.post("/chat/completions", json=CHAT).status_code == 200
            time.sleep(0.7)
    assert len(sim.engine.records) == 2


def test_a_head_refusal_never_lands_inside_the_response_before_it(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.0, tpot_s=0.05)  # 30 tokens: a 1.5 s stream
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"header": 0.5})
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 30}).encode()
    stream_then_half_head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body) + b"GET /health HTTP/1.1\r\nHo")
    received, _ = _raw(gw, stream_then_half_head)
    first, _, after = received.partition(b"\r\n0\r\n\r\n")  # the end of the stream's chunked body
    assert b"data: [DONE]" in first and b"HTTP/1.1 408" not in first  # the stream came whole ...
    assert after.startswith(b"HTTP/1.1 408 ")  # ... and the refusal of the half head after it
    assert sim.engine.records[0].completion_tokens_sent == 30


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",  # no request line
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # broken chunked framing mid-request
], ids=["request-line", "content-length-text", "content-length-twice", "chunk-size"])
def test_unparsable_http_gets_a_json_400_and_the_gateway_serves_on(start_sim: StartSim, start_gateway: StartGateway,
                                                                   data: bytes) -> None:
    """httptools refuses the request: uvicorn's 400 answers with an OpenAI error object, not text."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    answer, _ = _raw(gw, data)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert "not valid HTTP/1.1" in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert not sim.engine.records
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "garbage-mid-stream"])
def test_unparsable_http_behind_a_stream_is_refused_after_it(start_sim: StartSim, start_gateway: StartGateway,
                                                             split: bool) -> None:
    """Garbage pipelined behind a good streamed request (in the same write, or while its answer
    streams): the stream is answered whole and accounted once as ok, the 400 follows it."""
    sim = start_sim("vllm", ttft_s=0.0, tpot_s=0.05)  # 30 tokens: a 1.5 s stream
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 30}).encode()
    stream = request_bytes(body)
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(stream if split else stream + b"GARBAGE\r\n\r\n")
        received = b""
        if split:
            while b"data: " not in received:  # the stream has begun
                received += conn.recv(65536)
            conn.sendall(b"GARBAGE\r\n\r\n")
        while chunk := conn.recv(65536):
            received += chunk
    first, _, after = received.partition(b"\r\n0\r\n\r\n")  # the end of the stream's chunked body
    assert first.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in first and b"HTTP/1.1 400" not in first
    assert after.startswith(b"HTTP/1.1 400 ") and b'"code":"invalid_http_request"' in after
    assert sim.engine.records[0].completion_tokens_sent == 30
    gw.wait_for_metric('kimi_gateway_requests_total{api="chat",pool="p",status_class="2xx"}', lambda v: v == 1)
    assert gw.metric("kimi_gateway_requests_total{") == 1
    gw.wait_until_idle()


def test_an_oversize_head_followed_by_garbage_gets_its_431(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A whole head over the limit and garbage in one write: the 431 answers the head (its answer
    closes the connection), not a 400 for what came after it."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_header_bytes=1024)
    answer, _ = _raw(gw, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5000
                     + b"\r\ncontent-length: 0\r\n\r\nGARBAGE\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ") and b"invalid_http_request" not in answer
    assert not sim.engine.records
