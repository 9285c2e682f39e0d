"""The stored-response replay's relayed stream (`gateway.api.stored_responses.ReplayStream`) without a
socket: the engine's bytes pass as whole events, and a replay that ends before its last event or
breaks gets one Responses `error` event and is recorded broken."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from gateway.api.stored_responses import ReplayStream
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.dispatch.ledger import Ledger
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestOutcome


def event(kind: str, n: int) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": n}) + b"\n\n"


WHOLE = [event("response.created", 0), event("response.in_progress", 1), event("response.completed", 2)]


class Chunks(httpx.AsyncByteStream):
    """The engine's body: `chunks` in order, then `error` raised (None: a clean end)."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self._chunks, self._error = chunks, error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk
        if self._error is not None:
            raise self._error


def ledger() -> Ledger:
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"]}]}, environ={})
    return Ledger("responses_get", "r1", None, GatewayMetrics(), WorkerRegistry(config))


def relayed(chunks: list[bytes], error: Exception | None = None) -> tuple[str | None, bytes, Ledger]:
    async def run() -> tuple[str | None, bytes, Ledger]:
        book = ledger()
        stream = ReplayStream(httpx.Response(200, stream=Chunks(chunks, error)), book, 1 << 26, 1 << 26)
        failure = await stream.opening(5.0)
        if failure is not None:
            return failure, b"", book
        return None, b"".join([part async for part in stream.body()]), book
    return asyncio.run(run())


@pytest.mark.parametrize("size", [7, 1000])
def test_a_whole_replay_passes_unchanged(size: int) -> None:
    body = b"".join(WHOLE)
    failure, out, book = relayed([body[i:i + size] for i in range(0, len(body), size)])
    assert failure is None and out == body and book.record.outcome is RequestOutcome.OK


def test_a_whole_replay_whose_last_event_lacks_its_blank_line_passes() -> None:
    body = b"".join(WHOLE)[:-2]
    assert relayed([body])[1] == body


@pytest.mark.parametrize("error", [None, httpx.RemoteProtocolError("incomplete chunked read")])
def test_a_replay_cut_before_its_last_event_ends_with_an_error_event(error: Exception | None) -> None:
    cut = WHOLE[0] + WHOLE[1] + WHOLE[2][:20]  # ends (or breaks) inside the terminal event
    failure, out, book = relayed([cut], error)
    assert failure is None and out.startswith(WHOLE[0] + WHOLE[1])
    tail = out[len(WHOLE[0] + WHOLE[1]):]
    assert tail.startswith(b"event: error\ndata: ") and b"response.completed" not in tail
    data = orjson.loads(tail.split(b"\n")[1][6:])
    assert data["type"] == "error" and data["error"]["type"] == "server_error"
    assert book.record.outcome is RequestOutcome.UPSTREAM_ERROR and "replay" in (book.record.error or "")


def test_the_engines_own_error_event_gets_no_second_one() -> None:
    engine_error = b'event: error\ndata: {"type":"error","code":"x","message":"boom","param":null}\n\n'
    failure, out, book = relayed([WHOLE[0], engine_error])
    assert failure is None
    assert out == WHOLE[0] + engine_error
    assert book.record.outcome is RequestOutcome.UPSTREAM_ERROR


@pytest.mark.parametrize("error", [None, httpx.ReadError("reset")])
def test_a_replay_that_fails_before_any_byte_says_so_before_the_answer(error: Exception | None) -> None:
    failure, out, _ = relayed([], error)
    assert failure is not None and "replay" in failure and out == b""
