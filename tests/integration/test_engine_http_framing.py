"""The real gateway in front of scripted engines that speak odd or hostile HTTP/1.1 on loopback:
interim answers, bytes after an answer's end, compressed answers (decoded, bounded, or refused), a
slow-loris head, a client that leaves mid-stream. (The client itself, alone: tests/integration/test_h1_client.py.)"""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from collections.abc import Awaitable, Callable, Iterator

import httpx
import orjson
import pytest

from tests.support import RunningGateway, pool

StartGateway = Callable[..., RunningGateway]
Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
GetAnswer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SSE = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"kimi-k3","choices":[{"index":0,'
       b'"delta":{"content":"hello"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')
JSON = (b'{"id":"c","object":"chat.completion","created":1,"model":"kimi-k3","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
        b'"completion_tokens":1,"total_tokens":2}}')


class ScriptedEngine:
    """An engine on a loopback port, on its own thread and loop: GETs (probes, scrapes) get `{}`,
    but those `get(request head, writer)` answers itself (it returns True); each POST on a
    connection is answered by `answer(reader, writer, connection index)` after its body was read.
    `connections` counts connections, `post_connections` holds the indexes of those that carried a
    POST, `ended` is set when the gateway closed one of those. A `POST /tokenize` (a migration
    counting the text it keeps) is answered 404, as by an engine without one, and counts as no POST."""

    def __init__(self, answer: Answer, get: GetAnswer | None = None) -> None:
        self.answer = answer
        self.get = get
        self.connections = 0
        self.post_connections: set[int] = set()
        self.ended = threading.Event()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._on_connect, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        ready.set()
        try:
            self.loop.run_forever()
        finally:  # stop() ended it: close it here, on its thread (else an unclosed-loop ResourceWarning)
            self.loop.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    if self.get is not None and await self.get(head, writer):
                        continue
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                if head.startswith(b"POST /tokenize "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                                 b"content-length: 2\r\n\r\n{}")
                    continue
                self.post_connections.add(index)
                await self.answer(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            if index in self.post_connections:  # (a probe's idle connection ending says nothing)
                self.ended.set()
        except asyncio.CancelledError:  # stop(): a task that ends quietly (asyncio logs a cancelled one)
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _stop(self) -> None:
        self.server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def engines() -> Iterator[Callable[[Answer], ScriptedEngine]]:
    started: list[ScriptedEngine] = []

    def start(answer: Answer) -> ScriptedEngine:
        started.append(ScriptedEngine(answer))
        return started[-1]

    yield start
    for engine in started:
        engine.stop()


def gateway_for(start_gateway: StartGateway, engine: ScriptedEngine, **settings: object) -> RunningGateway:
    return start_gateway([pool("p", "vllm", [engine.url], 131072)], health={"interval": 60},
                         load={"enabled": False}, **settings)


def chunked(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


@pytest.mark.parametrize("stream", [False, True])
def test_interim_answers_before_the_engines_answer(start_gateway: StartGateway, engines, stream: bool) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        for interim in (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"):
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.01)  # each in its own read
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         + chunked(SSE))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(JSON), JSON))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    assert "hello" in response.text and response.headers["x-kimi-gateway-attempts"] == "1"
    assert "link" not in response.headers


def test_bytes_after_an_answers_end_reach_no_client(start_gateway: StartGateway, engines) -> None:
    evil = b'{"choices":[{"message":{"content":"EVIL"}}]}'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        body = JSON.replace(b"hello", b"conn%d" % index)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body, len(evil), evil))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    texts = []
    for _ in range(2):
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["message"]["content"])
    assert texts[0].startswith("conn") and texts[1].startswith("conn")  # never the unasked answer
    assert texts[0] != texts[1]  # the connection that carried bytes after its answer was not reused


def test_a_client_that_leaves_mid_stream_closes_the_engines_connection(start_gateway: StartGateway,
                                                                      engines) -> None:
    posts = [0]
    event = SSE.split(b"\n\n")[0] + b"\n\n"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        posts[0] += 1
        if posts[0] > 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(JSON), JSON))
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):  # 10 s of decoding unless the gateway hangs up
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        assert any("hello" in line for line in response.iter_lines())
    assert engine.ended.wait(3)  # the engine saw the gateway leave (and would abort the request)
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hello"
    assert len(engine.post_connections) == 2  # the cut stream's connection never went back to the pool


def gzip_flushed(*parts: bytes) -> list[bytes]:
    """`parts` gzip-encoded as one gzip stream, each part flushed into its own piece (as a server
    that compresses an SSE stream flushes per event)."""
    encoder = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    pieces = [encoder.compress(part) + encoder.flush(zlib.Z_SYNC_FLUSH) for part in parts]
    pieces[-1] += encoder.flush()
    return pieces


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_compressed_answer_is_decoded_for_the_client(start_gateway: StartGateway, engines, coding: str) -> None:
    """The gateway asks for identity; an engine that compresses anyway has its answer decoded: the
    client gets identity bytes (no content-encoding) and the gateway reads its usage."""
    body = gzip.compress(JSON) if coding == "gzip" else zlib.compress(JSON)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: %s\r\n"
                     b"content-length: %d\r\n\r\n%s" % (coding.encode(), len(body), body))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    with httpx.Client(timeout=10) as client:
        response = client.post(gw.v1 + "/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert "content-encoding" not in response.headers and response.content == JSON
    gw.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="p"}', lambda n: n == 1)  # usage read


def test_a_gzip_stream_is_decoded_event_by_event(start_gateway: StartGateway, engines) -> None:
    """A gzip-encoded SSE stream reaches the client decoded as the engine flushes: its first event
    before the engine sends the rest (it waits for the client to have read it)."""
    first, rest = SSE.split(b"\n\n", 1)
    pieces = gzip_flushed(first + b"\n\n", rest)
    client_has_first = threading.Event()
    waited: list[bool] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(pieces[0]), pieces[0]))
        await writer.drain()
        waited.append(await asyncio.to_thread(client_has_first.wait, 5))
        if waited[-1]:  # else the stream stays cut: the client never got its first event on its own
            writer.write(chunked(pieces[1]))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    lines = []
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200 and "content-encoding" not in response.headers
        for line in response.iter_lines():
            lines.append(line)
            if "hello" in line:
                client_has_first.set()
    assert waited == [True] and [line for line in lines if line][-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True])
def test_a_compressed_answer_that_decodes_past_the_limit_is_refused(start_gateway: StartGateway, engines,
                                                                    stream: bool) -> None:
    """A gzip bomb (about 50 KiB that decode to 50 MiB) is decoded only up to `max_decoded_bytes`:
    a non-streaming answer is a 502 saying so, a stream ends with an error event saying so."""
    if stream:
        event = SSE.split(b"\n\n")[0] + b"\n\n"
        bomb = gzip.compress(event * (50 * 1024 * 1024 // len(event)))
    else:
        bomb = gzip.compress(JSON[:-1] + b" " * (50 * 1024 * 1024))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n%s"
                     % (b"text/event-stream" if stream else b"application/json", len(bomb), bomb))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine, max_decoded_bytes=1 << 20)
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert "content-encoding" not in response.headers
    if stream:
        assert response.status_code == 200 and len(response.content) < 2 << 20
        last = response.text.strip().split("\n\n")[-1]
        assert "decodes to more than 1048576 bytes" in last and "[DONE]" not in response.text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"
        assert "decodes to more than 1048576 bytes" in response.json()["error"]["message"]


@pytest.mark.parametrize(("stream", "api"), [(False, "chat"), (True, "chat"), (True, "messages")])
@pytest.mark.parametrize("coding", ["br", "zstd", "compress"])
def test_an_encoding_the_gateway_cannot_decode_is_refused_before_content(
        start_gateway: StartGateway, engines, stream: bool, api: str, coding: str) -> None:
    """No decoder for it (brotli and zstandard are not installed with the gateway): the attempt fails
    at the engine's headers, before any body byte, and the client gets an error in its API's shape
    naming the encoding, never the engine's bytes."""
    garbage = b"\x8b\x07\x80ENCODED\x03"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: %s\r\n"
                     b"content-length: %d\r\n\r\n%s"
                     % (b"text/event-stream" if stream else b"application/json", coding.encode(), len(garbage),
                        garbage))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    path = "/messages" if api == "messages" else "/chat/completions"
    response = httpx.post(gw.v1 + path, json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 502 and "content-encoding" not in response.headers
    assert b"ENCODED" not in response.content
    body = response.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    else:
        assert body["error"]["code"] == "upstream_error"
    assert f"Content-Encoding: {coding} although the gateway asked for identity" in body["error"]["message"]


def test_a_compressed_error_answer_is_relayed_decoded(start_gateway: StartGateway, engines) -> None:
    body = gzip.compress(b'{"object":"error","message":"max_tokens must be at least 1","type":"BadRequestError",'
                         b'"param":null,"code":400}')

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400 and "content-encoding" not in response.headers
    assert response.json()["error"]["message"] == "max_tokens must be at least 1"


def test_a_client_that_leaves_before_the_answers_head_closes_the_engines_connection(
        start_gateway: StartGateway, engines) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await reader.read(1)  # a long prefill: nothing until the gateway hangs up (b"" then)
        raise ConnectionResetError

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=0.5)
    assert engine.ended.wait(3)  # cancelled upstream request: its connection closed, not pooled


ENDLESS_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ENDLESS_LINE = b'data: {"x": "'


def endless_line(first: bytes = b"") -> Answer:
    """An engine that sends `first` (whole events), then one SSE line that never ends: `data: {"x":
    "aaaa...` in 64 KiB writes, as fast as the gateway reads, until the gateway hangs up (issue 25 §8)."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(ENDLESS_HEAD + (b"%x\r\n%s\r\n" % (len(first), first) if first else b""))
        writer.write(b"%x\r\n%s\r\n" % (len(ENDLESS_LINE), ENDLESS_LINE))
        piece = b"a" * 65536
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
    return answer


def read_at_most(response: httpx.Response, limit: int) -> bytes:
    """The response body, failing the test once more than `limit` bytes came (a relay without end)."""
    body = b""
    for chunk in response.iter_bytes():
        body += chunk
        assert len(body) <= limit, f"over {limit} bytes relayed: {body[:200]!r}"
    return body


def test_a_line_without_end_before_any_content_is_an_error_not_a_relay(start_gateway: StartGateway,
                                                                         engines) -> None:
    """`data: {"x": "aaaa...` forever and no content before it: the gateway holds the event up to the
    relay's bound (`max_body_bytes`), then refuses the request once: a 502 JSON error, not a 200 (nor
    a retry elsewhere: the engine answered), and hangs up on the engine."""
    engine = engines(endless_line())
    gw = gateway_for(start_gateway, engine, max_body_bytes=2 << 20)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        body = read_at_most(response, 64 * 1024)
    assert response.status_code == 502, body[:300]
    assert orjson.loads(body)["error"]["code"] == "upstream_error"
    assert response.headers["x-should-retry"] == "false"
    assert engine.ended.wait(3)  # the engine's connection was closed (it would abort the request)


def test_a_line_without_end_after_content_ends_the_stream_with_one_error(start_gateway: StartGateway,
                                                                          engines) -> None:
    """First content, then a line that never ends: the client has the content and one SSE error event
    (the unfinished event held back, never relayed), the engine's connection is closed."""
    engine = engines(endless_line(SSE.split(b"\n\n")[0] + b"\n\n"))
    gw = gateway_for(start_gateway, engine, max_body_bytes=2 << 20)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        body = read_at_most(response, 64 * 1024)
    events = [e for e in body.split(b"\n\n") if e]
    assert b'"hello"' in events[0] and len(events) == 2, body[:600]
    assert orjson.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert b"aaaa" not in body and b"[DONE]" not in body
    assert engine.ended.wait(3)


def test_a_long_event_that_ends_is_relayed_whole(start_gateway: StartGateway, engines) -> None:
    """A 300 KiB event (past the relay's 64 KiB held in place) in 4 KiB writes, its blank line split
    between two writes, then [DONE]: the client gets the engine's bytes exactly, no error event."""
    big = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"kimi-k3","choices":[{"index":0,'
           b'"delta":{"content":"' + b"b" * (300 * 1024) + b'"},"finish_reason":null}]}\n')
    body = SSE.split(b"\n\n")[0] + b"\n\n" + big + b"\n" + b"data: [DONE]\n\n"
    cut = len(SSE.split(b"\n\n")[0]) + 2 + len(big)  # the event's second newline starts the last write
    pieces = [body[i:min(i + 4096, cut)] for i in range(0, cut, 4096)] + [body[cut:]]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(ENDLESS_HEAD)
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    engine = engines(answer)
    gw = gateway_for(start_gateway, engine)
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert response.status_code == 200
    assert response.content == body
