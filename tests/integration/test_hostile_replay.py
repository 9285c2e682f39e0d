"""The stored-response routes (`GET /v1/responses/{id}`, `?stream=true` replays) in front of a hostile
engine on loopback (issue 37 §7): the chat relay's bounds hold there too. A compressed answer the
gateway asked not to get is decoded incrementally and at most `max_decoded_bytes` of it (a gzip bomb
is neither relayed whole nor decoded into memory at once), a coding it cannot decode is refused, and
a replay's event that never ends is held at most `max_body_bytes`."""

from __future__ import annotations

import asyncio
import gzip
import threading
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator

import httpx
import orjson
import pytest

from tests.integration.test_engine_http_framing import ScriptedEngine, read_at_most
from tests.support import RunningGateway, pool

StartGateway = Callable[..., RunningGateway]
Replay = Callable[[asyncio.StreamWriter], Awaitable[None]]
RID = "resp_hostile0001"
CREATED = orjson.dumps({"id": RID, "object": "response", "created_at": 1, "status": "completed", "model": "kimi-k3",
                        "output": [], "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}})
LINE = b'data: {"x": "'  # a line that never ends
EVENT = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":1,'
         b'"item_id":"m","output_index":0,"content_index":0,"delta":"hello"}\n\n')


class ReplayingEngine:
    """A vLLM-like engine that creates `RID` on any POST (a stored Responses answer) and answers
    `GET /v1/responses/RID` with `replay(writer)`; `ended` is set once the gateway hung up on that GET."""

    def __init__(self, replay: Replay) -> None:
        self.ended = threading.Event()

        async def created(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(CREATED), CREATED))

        async def get(head: bytes, writer: asyncio.StreamWriter) -> bool:
            if not head.startswith(b"GET /v1/responses/" + RID.encode()):
                return False
            try:
                await replay(writer)
                await writer.drain()
            except ConnectionError:
                self.ended.set()
                raise
            return True

        self.engine = ScriptedEngine(created, get)


@pytest.fixture
def replaying() -> Iterator[Callable[[Replay], ReplayingEngine]]:
    started: list[ReplayingEngine] = []

    def start(replay: Replay) -> ReplayingEngine:
        started.append(ReplayingEngine(replay))
        return started[-1]

    yield start
    for engine in started:
        engine.engine.stop()


def stored(start_gateway: StartGateway, engine: ReplayingEngine, **settings: object) -> RunningGateway:
    """A gateway in front of `engine` that has recorded `RID` as stored there."""
    gw = start_gateway([pool("p", "vllm", [engine.engine.url], 131072)], health={"interval": 60},
                       load={"enabled": False}, **settings)
    created = httpx.post(gw.v1 + "/responses", json={"model": "kimi-k3", "input": "hi"}, timeout=10)
    assert created.status_code == 200 and created.json()["id"] == RID, created.text
    return gw


def head(content_type: bytes, coding: bytes | None, length: int | None = None) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n"
            + (b"content-encoding: " + coding + b"\r\n" if coding else b"")
            + (b"content-length: %d\r\n\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n\r\n"))


def test_a_gzip_bomb_replay_stops_at_max_decoded_bytes(start_gateway: StartGateway, replaying) -> None:
    """~50 KiB of gzip that decode to 50 MiB of valid replay events: the client gets at most
    `max_decoded_bytes` (1 MiB) of them, then one Responses error event saying why."""
    bomb = gzip.compress(EVENT * (50 * 1024 * 1024 // len(EVENT)))

    async def replay(writer: asyncio.StreamWriter) -> None:
        writer.write(head(b"text/event-stream", b"gzip", len(bomb)) + bomb)

    engine = replaying(replay)
    gw = stored(start_gateway, engine, max_decoded_bytes=1 << 20)
    with httpx.stream("GET", f"{gw.v1}/responses/{RID}", params={"stream": "true"}, timeout=30) as response:
        assert response.status_code == 200 and "content-encoding" not in response.headers
        body = read_at_most(response, 2 << 20)
    last = body.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ") and b"decodes to more than 1048576 bytes" in last
    assert body.count(b"response.output_text.delta") > 1000  # the events before the bound were relayed


def test_a_replay_line_without_end_ends_with_one_error_event(start_gateway: StartGateway, replaying) -> None:
    """A replay event, then a `data:` line that never ends (32 MiB in 64 KiB writes, then nothing): the
    client gets the event, then one error event once the line passes `max_body_bytes` (2 MiB), never
    the unfinished line; the engine's connection is closed."""
    async def replay(writer: asyncio.StreamWriter) -> None:
        writer.write(head(b"text/event-stream", None) + b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
        writer.write(b"%x\r\n%s\r\n" % (len(LINE), LINE))
        piece = b"a" * 65536
        for _ in range(512):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        await asyncio.sleep(30)  # silent, the line unfinished: only the gateway's bound ends it

    engine = replaying(replay)
    gw = stored(start_gateway, engine, max_body_bytes=2 << 20)
    with httpx.stream("GET", f"{gw.v1}/responses/{RID}", params={"stream": "true"}, timeout=20) as response:
        assert response.status_code == 200
        body = read_at_most(response, 64 * 1024)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == EVENT and len(events) == 2, body[:500]
    assert events[1].startswith(b"event: error\ndata: ") and b"event of over 2097152 bytes" in events[1]
    assert b"aaaa" not in body
    assert engine.ended.wait(5)


def test_a_gzip_bomb_as_a_stored_response_is_refused_within_bounded_memory(start_gateway: StartGateway,
                                                                            replaying) -> None:
    """A stored response (JSON) of ~50 KiB gzip that decode to 50 MiB: a 502 saying the answer is
    larger than the gateway relays, and the gateway never held more than a few MiB of it (decoded
    in 64 KiB steps and given up at `max_body_bytes`, never a whole read decoded at once)."""
    bomb = gzip.compress(CREATED[:-1] + b" " * (50 * 1024 * 1024) + b"}")

    async def replay(writer: asyncio.StreamWriter) -> None:
        writer.write(head(b"application/json", b"gzip", len(bomb)) + bomb)

    engine = replaying(replay)
    gw = stored(start_gateway, engine, max_body_bytes=1 << 20)
    tracemalloc.start()
    try:
        answer = httpx.get(f"{gw.v1}/responses/{RID}", timeout=30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert answer.status_code == 502 and "content-encoding" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "upstream_error" and "larger than this gateway relays" in error["message"]
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB traced while refusing the bomb"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_in_a_coding_the_gateway_cannot_decode_is_a_502(start_gateway: StartGateway, replaying,
                                                                          stream: bool) -> None:
    """`Content-Encoding: br` (no decoder is installed with the gateway): a 502 in OpenAI's shape that
    names the coding, never the engine's bytes as the stored response."""
    garbage = b"\x8b\x07\x80ENCODED\x03"

    async def replay(writer: asyncio.StreamWriter) -> None:
        writer.write(head(b"text/event-stream" if stream else b"application/json", b"br", len(garbage)) + garbage)

    gw = stored(start_gateway, replaying(replay))
    answer = httpx.get(f"{gw.v1}/responses/{RID}", params={"stream": "true"} if stream else {}, timeout=30)
    assert answer.status_code == 502 and b"ENCODED" not in answer.content
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "Content-Encoding: br" in error["message"]
