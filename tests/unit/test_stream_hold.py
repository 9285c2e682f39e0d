"""What the relay holds before a stream's first content (issue 10 §3): `classify_event` on the
shapes engines send, and timeout defaults that keep a load balancer from cutting a long prefill."""

from __future__ import annotations

import json

import pytest

from gateway.dispatch.params import TimeoutConfig
from gateway.streaming import LONG_EVENT, EventTooLarge, Held, _grow, classify_event


def event(choices: list[dict[str, object]] | None = None, **extra: object) -> bytes:
    payload = {"id": "c", "object": "chat.completion.chunk", "choices": choices if choices is not None else [],
               **extra}
    return b"data: " + json.dumps(payload).encode()


def delta(d: dict[str, object], finish: str | None = None) -> bytes:
    return event([{"index": 0, "delta": d, "finish_reason": finish}])


@pytest.mark.parametrize("raw", [
    b": keep-alive",
    b": ping - 2026-01-01",
    delta({"role": "assistant", "content": ""}),
    delta({"role": "assistant"}),
    delta({}),
    delta({"content": None}),
    delta({"content": "", "reasoning_content": None, "tool_calls": []}),
    delta({"reasoning": ""}),
    delta({"role": "assistant", "content": None, "function_call": None, "audio": None}),
    event([{"index": 0, "text": "", "finish_reason": None}]),  # completions
    event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
           {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),  # n=2
    event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], usage=None),
])
def test_events_without_content_are_held(raw: bytes) -> None:
    assert classify_event(raw)[0] is Held.EMPTY


@pytest.mark.parametrize("raw", [
    delta({"content": "Hi"}),
    delta({"role": "assistant", "content": " "}),  # a space is content
    delta({"reasoning_content": "Let me think"}),
    delta({"reasoning": "Let me think"}),
    delta({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}),
    delta({"content": ""}, finish="stop"),  # an empty answer is an answer
    delta({"audio": {"id": "a"}}),  # a field we do not model: never held back
    event([{"index": 0, "text": "Hello", "finish_reason": None}]),
    event([], usage={"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}),
    b"data: [DONE]",
    b"data:[DONE]",
    b"data: not json",
    b"data: [1, 2]",
    b"event: message\ndata: " + json.dumps({"choices": [{"delta": {"content": "x"}}]}).encode(),
])
def test_events_with_content_commit(raw: bytes) -> None:
    assert classify_event(raw)[0] is Held.CONTENT


def test_error_events_are_recognised_with_their_payload() -> None:
    verdict, data = classify_event(b'data: {"error": {"message": "boom", "code": 500}}')
    assert verdict is Held.ERROR and json.loads(data)["error"]["message"] == "boom"


def test_defaults_keep_a_load_balancers_idle_timeout_from_cutting_a_prefill() -> None:
    timeouts = TimeoutConfig()
    # AWS ALB, GCP and most proxies cut a connection idle for 60 s: headers held longer, or
    # keep-alives further apart, would let them cut a 1M-token prefill.
    assert timeouts.hold_headers is not None and timeouts.hold_headers < 60
    assert timeouts.keepalive_interval is not None and timeouts.keepalive_interval < 60


def test_a_long_unfinished_event_is_held_until_its_end_even_across_a_split_blank_line() -> None:
    """`_grow` (the relay's buffer for an event over 64 KiB): nothing to relay until the event ends,
    its `\\r\\n\\r\\n` found when split between two reads, the rest after it carried; past the limit
    EventTooLarge."""
    long = bytearray(b"data: " + b"x" * LONG_EVENT)
    held, carry, events = _grow(long, b"y" * 10 + b"\r\n", 1 << 20)
    assert held is not None and (carry, events) == (b"", b"")
    held, carry, events = _grow(held, b"\r\ndata: next", 1 << 20)
    assert held is None and events == b"data: " + b"x" * LONG_EVENT + b"y" * 10 + b"\r\n\r\n"
    assert carry == b"data: next"
    with pytest.raises(EventTooLarge):
        _grow(bytearray(b"data: " + b"x" * LONG_EVENT), b"z" * 100, LONG_EVENT + 50)
