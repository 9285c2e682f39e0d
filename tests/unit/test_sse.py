"""The relay's SSE tap: events, [DONE], usage, across arbitrary chunk splits."""

from __future__ import annotations

import orjson
import pytest

from gateway.protocol.sse import SSETap, sse_error_event

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
    assert tap.at_boundary


def test_tap_knows_when_a_stream_stopped_mid_event() -> None:
    tap = SSETap()
    tap.feed(b'data: {"choices":[]}\n\ndata: {"cho')
    assert not tap.at_boundary and not tap.done


def test_error_event_is_an_openai_error_object() -> None:
    event = sse_error_event("boom")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:])["error"] == {"message": "boom", "type": "server_error", "param": None,
                                                "code": "upstream_error"}
