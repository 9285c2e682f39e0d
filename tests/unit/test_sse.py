"""The relay's SSE tap: events, [DONE], usage, across arbitrary chunk splits."""

from __future__ import annotations

import json

import orjson
import pytest

from gateway.protocol.sse import SSETap, event_end, sse_error_event

STREAM = (
    b": ping\n\n"
    b'data: {"choices":[{"delta":{"content":"caf\xc3\xa9"}}],"usage":null}\n\n'
    b'data: {"choices":[{"delta":{"content":"!"}}],"usage":null}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(STREAM)])
def test_tap_sees_the_same_whatever_the_splits(size: int) -> None:
    tap = SSETap()
    for i in range(0, len(STREAM), size):
        tap.feed(STREAM[i:i + size])
    assert tap.events == 4
    assert tap.done
    assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


@pytest.mark.parametrize(("data", "end"), [
    (b"", 0),
    (b"data: x", 0),
    (b"data: x\n", 0),
    (b"data: x\n\n", 9),
    (b"data: x\n\ndata: y", 9),
    (b"data: x\r\n\r\ndata: y", 11),
    (b": ping\n\ndata: x\n\n", 17),
])
def test_event_end(data: bytes, end: int) -> None:
    assert event_end(data) == end


def test_error_event_is_an_openai_error_object() -> None:
    event = sse_error_event("boom")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:])["error"] == {"message": "boom", "type": "server_error", "param": None,
                                                "code": "upstream_error"}


@pytest.mark.parametrize("size", [1, 5, 13, 1000])
def test_done_and_usage_are_seen_only_where_they_really_are(size: int) -> None:
    lookalike = b'data: {"choices":[{"delta":{"content":"data: [DONE] \\n\\ndata: [DONE]"}}]}\n\n'
    spaced_usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
    stream = lookalike + spaced_usage + b"data:[DONE]\n\n"
    tap = SSETap()
    for i in range(0, len(stream), size):
        tap.feed(stream[i:i + size])
        if i + size < len(stream) - len(b"data:[DONE]\n\n"):
            assert not tap.done  # the look-alike inside a JSON string is no end of stream
    assert tap.done and tap.events == 3
    assert tap.usage == {"prompt_tokens": 3, "completion_tokens": 1}


def test_end_reads_a_last_line_without_a_newline() -> None:
    tap = SSETap()
    tap.feed(b'data: {"choices":[]}\n\ndata: [DO')
    tap.feed(b"NE]")
    assert not tap.done and tap.events == 1
    tap.end()
    assert tap.done and tap.events == 2
    tap.end()  # idempotent
    assert tap.events == 2


@pytest.mark.parametrize(("chunks", "failed"), [
    ([b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'], True),
    ([b"event:error\r\n", b'data: {"type":"error"}\r\n\r\n'], True),  # no space, CRLF, split over reads
    ([b'data: {"text":"an event: error inside text"}\n\n'], False),
    ([b"event: errors\ndata: {}\n\n"], False),
])
def test_tap_sees_an_engines_error_event(chunks: list[bytes], failed: bool) -> None:
    tap = SSETap("messages")
    for chunk in chunks:
        tap.feed(chunk)
    assert tap.failed is failed


def test_the_gateways_error_event_takes_each_apis_shape() -> None:
    chat = sse_error_event("cut", api="chat")
    assert chat.startswith(b"data: ") and json.loads(chat[6:])["error"]["code"] == "upstream_error"
    name, data = sse_error_event("cut", code="shutting_down", api="responses").split(b"\n")[:2]
    typed = json.loads(data.removeprefix(b"data: "))
    assert name == b"event: error" and typed["type"] == "error" and typed["code"] == "shutting_down"
    assert typed["error"] == {"message": "cut", "type": "server_error", "param": None, "code": "shutting_down"}
    name, data = sse_error_event("cut", code="shutting_down", api="messages").split(b"\n")[:2]
    assert name == b"event: error" and json.loads(data[6:])["error"]["type"] == "overloaded_error"
