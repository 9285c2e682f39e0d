"""The relay's SSE tap: events, [DONE], usage, across arbitrary chunk splits."""

from __future__ import annotations

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
