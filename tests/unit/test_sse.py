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


def _events(*payloads: dict[str, object], typed: bool = True) -> bytes:
    """SSE events as the engines write them (`event:` lines on the typed APIs)."""
    out = b""
    for payload in payloads:
        head = b"event: " + str(payload.get("type")).encode() + b"\n" if typed and "type" in payload else b""
        out += head + b"data: " + orjson.dumps(payload) + b"\n\n"
    return out


def _message_stream(start: dict[str, int], delta: dict[str, int] | None, stop: dict[str, int] | None) -> bytes:
    events: list[dict[str, object]] = [
        {"type": "message_start", "message": {"id": "m", "content": [], "usage": start}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "usage"}},
        {"type": "content_block_stop", "index": 0}]
    if delta is not None:
        events.append({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta})
    events.append({"type": "message_stop", **({"message": {"id": "m", "usage": stop}} if stop else {})})
    return _events(*events)


# Where each engine's Messages layer puts its usage (gateway/sim/anthropic.py has the sources): the
# whole prompt is 40 tokens (15 of them cached), the output 9.
@pytest.mark.parametrize(("stream", "cache_in_input", "prompt"), [
    (_message_stream({"input_tokens": 40, "output_tokens": 0}, {"input_tokens": 40, "output_tokens": 9}, None),
     False, 40),  # vLLM without prompt token details
    (_message_stream({"input_tokens": 40, "output_tokens": 0},
                     {"input_tokens": 9, "output_tokens": 9, "cache_read_input_tokens": 15,
                      "cache_creation_input_tokens": 16}, None),
     False, 40),  # vLLM 0.32: the whole prompt at the start, Anthropic's split at the end (not 40 + 15 + 16)
    (_message_stream({"input_tokens": 32, "output_tokens": 0},
                     {"input_tokens": 0, "output_tokens": 9, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 32}, None),
     False, 32),  # vLLM 0.32, a prompt of whole blocks: the split's zero input_tokens stands
    (_message_stream({"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0},
                     {"input_tokens": 40, "output_tokens": 9, "cache_read_input_tokens": 15}, None),
     True, 40),  # SGLang: the cached part inside input_tokens, not on top
    (_message_stream({"input_tokens": 0, "output_tokens": 0}, None, {"input_tokens": 40, "output_tokens": 9}),
     False, 40),  # SGLang's earlier layer: zeros at the start, all in message_stop
    (_message_stream({"input_tokens": 40, "output_tokens": 0}, {"output_tokens": 9}, None),
     False, 40),  # llama.cpp, and Anthropic: the prompt only at the start
    (_message_stream({"input_tokens": 40, "output_tokens": 1}, {"input_tokens": 0, "output_tokens": 9}, None),
     False, 40),  # a zero later on does not hide the count reported before
    (_message_stream({"input_tokens": 25, "cache_read_input_tokens": 15, "output_tokens": 0},
                     {"output_tokens": 9}, None), False, 40),  # Anthropic's split: cached apart from input
])
@pytest.mark.parametrize("size", [5, 64, 100_000])
def test_messages_usage_is_read_wherever_the_engine_puts_it(stream: bytes, cache_in_input: bool, prompt: int,
                                                             size: int) -> None:
    tap = SSETap("messages", cache_in_input)
    for i in range(0, len(stream), size):
        tap.feed(stream[i:i + size])
    assert tap.done
    assert tap.usage is not None
    assert (tap.usage["prompt_tokens"], tap.usage["completion_tokens"]) == (prompt, 9)


CHUNK = {"id": "c", "object": "chat.completion.chunk"}


@pytest.mark.parametrize(("api", "stream"), [
    ("chat", _events({**CHUNK, "choices": [{"delta": {"content": "a"}}]},
                     {**CHUNK, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 9}},
                     typed=False) + b"data: [DONE]\n\n"),  # include_usage's last chunk (vLLM, SGLang, llama.cpp)
    ("chat", _events({**CHUNK, "choices": [{"delta": {"content": "a"}}]},
                     {**CHUNK, "choices": [{"delta": {}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 40, "completion_tokens": 9}},
                     typed=False) + b"data: [DONE]\n\n"),  # usage on the last content chunk
    ("chat", _events({**CHUNK, "choices": [{"delta": {"content": "a"}}],
                      "usage": {"prompt_tokens": 40, "completion_tokens": 1}},
                     {**CHUNK, "choices": [{"delta": {"content": "b"}}],
                      "usage": {"prompt_tokens": 40, "completion_tokens": 9}},
                     typed=False) + b"data: [DONE]\n\n"),  # vLLM's continuous_usage_stats: the last one counts
    ("responses", _events({"type": "response.created", "response": {"id": "r", "usage": None}},
                          {"type": "response.completed", "response": {
                              "id": "r", "usage": {"input_tokens": 40, "output_tokens": 9,
                                                   "input_tokens_details": {"cached_tokens": 3}}}})),
    ("responses", _events({"type": "response.incomplete", "response": {
        "id": "r", "usage": {"input_tokens": 40, "output_tokens": 9}}})),
])
def test_chat_and_responses_usage_shapes(api: str, stream: bytes) -> None:
    tap = SSETap(api)
    tap.feed(stream)
    assert tap.done
    assert tap.usage is not None
    assert (tap.usage["prompt_tokens"], tap.usage["completion_tokens"]) == (40, 9)


@pytest.mark.parametrize(("api", "chunks", "done", "failed"), [
    ("responses", [b'event: response.completed\ndata: {"type": "response.completed"}\n\n'], True, False),
    ("responses", [b'data: {"response": {"status": "completed"}, "type" : "response.completed"}\r\n\r\n'], True, False),
    ("responses", [b"event:response.incomplete\r\n", b'data: {"type":"response.incomplete"}\r\n\r\n'], True, False),
    ("responses", [b'data: {"type": "response.output_text.delta", "delta": "response.completed"}\n\n'], False, False),
    ("responses", [b'data: {"type": "t", "delta": "\\"response.failed\\""}\n\n'], False, False),
    ("responses", [b'data: {"type": "x", "item": {"type": "response.completed"}}\n\n'], False, False),  # nested
    ("responses", [b'data: {"type": "error", "code": "server_error", "message": "x"}\n\n'], False, True),
    ("responses", [b'data: {"type": "response.created", "response": {"error": null}}\n\n'], False, False),
    ("responses", [b"event: response.completed \ndata: {}\n\n"], False, False),  # the value is "response.completed "
    ("messages", [b'event:message_stop\r\ndata: {"type": "message_stop"}\r\n\r\n'], True, False),
    ("messages", [b'data: {"type": "content_block_delta", "delta": {"text": "message_stop"}}\n\n'], False, False),
    ("messages", [b'event: error\r\ndata: {"type": "error", "error": {"type": "api_error"}}\r\n\r\n'], False, True),
    ("messages", [b'data: {"type": "error"}\n\n'], False, False),  # the anthropic SDK raises on `event: error` only
])
def test_typed_streams_end_and_fail_by_their_parsed_event_type(api: str, chunks: list[bytes], done: bool,
                                                               failed: bool) -> None:
    tap = SSETap(api)
    for chunk in chunks:
        tap.feed(chunk)
    assert (tap.done, tap.failed) == (done, failed)


def test_a_line_over_a_mib_has_only_its_usage_and_type_read() -> None:
    """A token-level event (a role chunk with a prompt's token ids, a Responses final event with its
    logprobs) over MAX_CARRY_BYTES, arriving whole: its usage object is parsed alone (the line's
    arrays never become objects), its `type` found without a parse."""
    ids = b",".join(b"%d" % (100_000 + i) for i in range(300_000))
    chat = SSETap()
    chat.feed(b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
              b'"prompt_token_ids":[' + ids + b'],"usage":{"prompt_tokens":300000,"completion_tokens":0,'
              b'"total_tokens":300000,"prompt_tokens_details":{"cached_tokens":12}}}\n\n')
    assert chat.events == 1 and chat.usage is not None
    assert (chat.usage["prompt_tokens"], chat.usage["prompt_tokens_details"]) == (300000, {"cached_tokens": 12})
    responses = SSETap("responses")
    responses.feed(b'data: {"response":{"id":"r","output":[{"logprobs":[' + ids
                   + b']}],"usage":{"input_tokens":5,"output_tokens":300000,"total_tokens":300005}},'
                   b'"sequence_number":9,"type":"response.completed"}\n\n')
    assert responses.done and responses.usage is not None and responses.usage["completion_tokens"] == 300000
