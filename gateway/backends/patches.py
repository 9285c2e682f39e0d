"""Named engine patches: the only edits the gateway makes to request or response bodies (design §7.3).

`ask_for_usage` + `drop_usage_events` (one patch, two halves): a streaming client that did not set
`stream_options.include_usage` still gets its tokens counted. The gateway asks the engine for the
final usage chunk (vLLM, SGLang and llama.cpp send it as OpenAI documents: a last chunk with
`"choices": []` and a `usage` object, https://platform.openai.com/docs/api-reference/chat-streaming)
and removes that chunk before it reaches the client, who receives exactly the stream it asked for.
Applied only to engines whose `EngineSpec.supports_include_usage` is true.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_EMPTY_CHOICES = b'"choices":[]'
_EMPTY_CHOICES_SPACED = b'"choices": []'
_EVENT_END = re.compile(rb"(\r?\n\r?\n)")


def ask_for_usage(payload: dict[str, Any]) -> dict[str, Any]:
    """A copy of a streaming request body with `stream_options.include_usage: true` (the client's
    other `stream_options` kept)."""
    options = payload.get("stream_options")
    merged = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    return {**payload, "stream_options": merged}


def drop_usage_events(data: bytes) -> bytes:
    """`data` (whole SSE events) without the usage-only chunk(s) `ask_for_usage` asked for.

    Cheap when there is none (a substring test); other events, comments and `[DONE]` pass
    unchanged, byte for byte.
    """
    if _EMPTY_CHOICES not in data and _EMPTY_CHOICES_SPACED not in data:  # runs for every relayed chunk
        return data
    pieces = _EVENT_END.split(data)  # event, separator, event, separator, ..., tail
    kept: list[bytes] = []
    for i in range(0, len(pieces), 2):
        event = pieces[i]
        separator = pieces[i + 1] if i + 1 < len(pieces) else b""
        if not _is_usage_only(event):
            kept.append(event + separator)
    return b"".join(kept)


def _is_usage_only(event: bytes) -> bool:
    if not event.startswith(b"data:") or (_EMPTY_CHOICES not in event and _EMPTY_CHOICES_SPACED not in event):
        return False
    try:
        chunk = orjson.loads(event[5:].strip())
    except orjson.JSONDecodeError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)
