"""The usage patch (backends/patches.py): ask the engine for usage, hide that chunk from the client."""

from __future__ import annotations

import orjson
import pytest

from gateway.backends.patches import ask_for_usage, drop_usage_events
from gateway.protocol.sse import SSETap


def _event(payload: object, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(payload) + sep


TOKEN = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
USAGE = {"id": "c1", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}


def test_ask_for_usage_keeps_the_clients_other_stream_options() -> None:
    payload = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True, "x": 1}}
    patched = ask_for_usage(payload)
    # continuous_usage_stats is dropped: with usage on, it would put usage on every chunk.
    assert patched["stream_options"] == {"x": 1, "include_usage": True}
    assert payload["stream_options"] == {"continuous_usage_stats": True, "x": 1}  # the original is untouched
    assert ask_for_usage({"stream": True})["stream_options"] == {"include_usage": True}
    assert ask_for_usage({"stream_options": None})["stream_options"] == {"include_usage": True}


def test_only_the_usage_chunk_and_null_usage_members_are_dropped() -> None:
    with_null = {**TOKEN, "usage": None}  # engines following OpenAI add "usage": null once usage is asked for
    stream = _event(TOKEN) + _event(with_null) + _event(USAGE) + b"data: [DONE]\n\n"
    assert drop_usage_events(stream) == _event(TOKEN) * 2 + b"data: [DONE]\n\n"
    spaced = b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": null}\n\n'
    assert drop_usage_events(spaced) == spaced.replace(b', "usage": null', b"")
    quoted = {**TOKEN, "choices": [{"index": 0, "delta": {"content": ',"usage":null'}}]}  # text, escaped
    assert drop_usage_events(_event(quoted)) == _event(quoted)
    first = b'data: {"usage": null, "id":"c1","choices":[]}\n\n'  # first member, other spacings
    assert drop_usage_events(first) == b'data: {"id":"c1","choices":[]}\n\n'
    odd = b'data: {"id":"c1" ,"usage":  null }\n\n'
    assert drop_usage_events(odd) == b'data: {"id":"c1" }\n\n'


def test_spaced_json_and_crlf_separators() -> None:
    spaced = b"data: " + orjson.dumps(USAGE).replace(b'":', b'": ').replace(b",", b", ") + b"\r\n\r\n"
    token = _event(TOKEN, b"\r\n\r\n")
    assert drop_usage_events(token + spaced + b"data: [DONE]\r\n\r\n") == token + b"data: [DONE]\r\n\r\n"


def test_events_that_only_look_like_usage_pass() -> None:
    no_usage = {"id": "c1", "choices": []}  # an empty-choices chunk without usage is not ours to drop
    text = {**TOKEN, "choices": [{"index": 0, "delta": {"content": '"choices":[]'}}]}
    comment = b': "choices":[] keep-alive\n\n'
    data = _event(no_usage) + _event(text) + comment
    assert drop_usage_events(data) is not None and drop_usage_events(data) == data
    plain = _event(TOKEN) * 3
    assert drop_usage_events(plain) is plain  # the usual case costs a substring test


def test_the_tap_still_sees_the_usage_it_hides() -> None:
    stream = _event(TOKEN) + _event(USAGE) + b"data: [DONE]\n\n"
    tap = SSETap()
    tap.feed(stream)
    assert tap.usage == USAGE["usage"] and tap.done
    assert b'"usage"' not in drop_usage_events(stream)


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_a_usage_chunk_at_the_very_start_of_a_read_is_dropped(sep: bytes) -> None:
    """The engine's usage event can be the first bytes of a read (a regression: it leaked)."""
    assert drop_usage_events(_event(USAGE, sep) + b"data: [DONE]" + sep) == b"data: [DONE]" + sep
    assert drop_usage_events(_event(USAGE, sep)) == b""
    twice = _event(TOKEN, sep) + _event(USAGE, sep) + _event(USAGE, sep) + b"data: [DONE]" + sep
    assert drop_usage_events(twice) == _event(TOKEN, sep) + b"data: [DONE]" + sep
