"""Named engine patches: the only edits the gateway makes to request or response bodies (design §7.3).

`ask_for_usage` + `drop_usage_events` (one patch, two halves): a streaming client that did not set
`stream_options.include_usage` still gets its tokens counted. The gateway asks the engine for the
final usage chunk (vLLM, SGLang and llama.cpp send it as OpenAI documents: a last chunk with
`"choices": []` and a `usage` object, https://platform.openai.com/docs/api-reference/chat-streaming)
and removes that chunk before it reaches the client, together with the `"usage": null` that engines
following OpenAI put on every other chunk once usage is asked for, so the client receives the
stream it asked for.
Applied only to engines whose `EngineSpec.supports_include_usage` is true.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.protocol.sse import event_end

_EMPTY_CHOICES = b'"choices":[]'
_EMPTY_CHOICES_SPACED = b'"choices": []'
# Inside a JSON string a quote is escaped, so `"usage"` can only be a key: with a null value, after
# another member or first with one after it, in any spacing.
_NULL_USAGE = re.compile(rb'\s*,\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')


def ask_for_usage(payload: dict[str, Any]) -> dict[str, Any]:
    """A copy of a streaming request body with `stream_options.include_usage: true` (the client's
    other `stream_options` kept, but for `continuous_usage_stats`, which only acts with usage on)."""
    options = payload.get("stream_options")
    merged = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    # vLLM's continuous_usage_stats only acts with include_usage; the client did not ask for usage,
    # so leaving it in would put usage on every chunk that reaches the client.
    merged.pop("continuous_usage_stats", None)
    return {**payload, "stream_options": merged}


def drop_usage_events(data: bytes) -> bytes:
    """`data` (whole SSE events) without the usage-only chunk(s) `ask_for_usage` asked for, and
    without the `"usage": null` members of the other chunks.

    Cheap when there is none (substring tests), and otherwise only the event holding the marker
    is parsed; other bytes, comments and `[DONE]` pass unchanged.
    """
    if b'"usage"' in data:
        data = _NULL_USAGE.sub(b"", data)
    at = _find_marker(data, 0)
    while at >= 0:
        start = event_end(data, at)
        end = _event_end(data, at)
        if _is_usage_only(data[start:end]):
            data = data[:start] + data[end:]
            at = _find_marker(data, start)
        else:
            at = _find_marker(data, end)
    return data


def _find_marker(data: bytes, start: int) -> int:
    """Index of the next empty-`choices` marker at or after `start`, -1 when none (runs on every chunk)."""
    compact, spaced = data.find(_EMPTY_CHOICES, start), data.find(_EMPTY_CHOICES_SPACED, start)
    return compact if spaced < 0 or 0 <= compact < spaced else spaced


def _event_end(data: bytes, at: int) -> int:
    """Index just past the separator of the event holding index `at` (the end of `data` if none)."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := data.find(sep, at)) >= 0]
    return min(ends) if ends else len(data)


def _is_usage_only(event: bytes) -> bool:
    if not event.startswith(b"data:") or (_EMPTY_CHOICES not in event and _EMPTY_CHOICES_SPACED not in event):
        return False
    try:
        chunk = orjson.loads(event[5:].strip())
    except orjson.JSONDecodeError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)
