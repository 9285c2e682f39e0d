"""An incremental SSE observer for the relay: counts events, sees the stream's end, keeps the usage object.

It never changes bytes; it reads a copy of each chunk. Lines split across chunks are joined from a
small carry buffer; JSON is parsed only for `data:` lines that carry a non-null `usage`
(OpenAI's `stream_options.include_usage` chunk, https://platform.openai.com/docs/api-reference/chat-streaming;
Anthropic's `message_start` and `message_delta` events, https://docs.claude.com/en/docs/build-with-claude/streaming,
and wherever else an engine puts it: `SSETap._usage_line`).
A stream ends with `data: [DONE]` (OpenAI chat and completions), an event of type `message_stop`
(Anthropic) or one of the Responses API's `response.completed`, `response.incomplete`, `response.failed`:
a typed event is known by its parsed type (its `event:` line, its JSON `type`), not by exact bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.dialects.names import CHAT
from gateway.dialects.registry import dialect_for
from gateway.protocol.anthropic import merge_stream_usage, openai_usage
from gateway.protocol.responses import chat_usage, response_id_of

# A line longer than this is not tracked when it arrives in pieces, nor parsed whole when it arrives in
# one read: only its usage object is (`_usage_object`); it bounds memory.
MAX_CARRY_BYTES = 1 << 20


class SSETap:
    """Feed it every relayed chunk, in order. Attributes after the stream ends:

    `events` (data events seen), `done` (`data: [DONE]` or `event: message_stop` seen, or a Responses
    API stream's last event: `response.completed`, `response.incomplete`, `response.failed`; that API
    sends no `[DONE]`), `usage` (the last usage dict or None; an Anthropic stream's usage merged from
    its events (`gateway.protocol.anthropic.merge_stream_usage`), in OpenAI's names:
    `gateway.protocol.anthropic.openai_usage`; a Responses usage, nested in its final event's
    `response`, with the chat names added: `gateway.protocol.responses.chat_usage`).
    `on_response_id`, when set, is called once with the id of a Responses stream's `response.created`.
    `failed`: the engine sent an `event: error` (Anthropic's, the Responses API's): it ended the
    stream with its own reason, which the relay passes on instead of adding one.

    `api` (the request's, a `dialects.names.Api`) picks the scans a chunk gets, from its dialect once
    here: a chat stream is searched for `[DONE]` and usage only; the typed streams (Messages,
    Responses: `Dialect.stream_end_events`) also for their end event and `event: error`.
    `cache_in_input`: the engine's Messages usage counts its cached prompt inside `input_tokens`
    (`EngineSpec.messages_cache_in_input`).
    """

    __slots__ = ("_anthropic", "_cache_in_input", "_carry", "_ends", "_json_error", "done", "events", "failed",
                 "on_response_id", "usage")

    def __init__(self, api: str = CHAT, cache_in_input: bool = False) -> None:
        dialect = dialect_for(api)
        self._ends = dialect.stream_end_events  # empty: `data: [DONE]` ends the stream
        self._json_error = dialect.json_error_type
        self._cache_in_input = cache_in_input
        self.events = 0
        self.done = False
        self.failed = False
        self.usage: dict[str, Any] | None = None
        self.on_response_id: Callable[[str], None] | None = None
        self._carry = b""
        self._anthropic: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        """Observe the next relayed bytes. Works on whole lines (a partial last line waits in a
        small carry) with substring searches: no per-line work unless a usage object is there.
        Exact because a raw newline cannot occur inside a JSON string (JSON escapes it), so
        `\ndata:` only ever starts a line."""
        data = self._carry + chunk if self._carry else chunk
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        self._carry = carry if len(carry) <= MAX_CARRY_BYTES else b""
        if not cut:
            return
        lines = data[:cut] if cut < len(data) else data
        starts_with_data = lines.startswith(b"data:")
        self.events += lines.count(b"\ndata:") + starts_with_data
        if not self.done and (b"\ndata: [DONE]" in lines or b"\ndata:[DONE]" in lines
                              or lines.startswith((b"data: [DONE]", b"data:[DONE]"))):
            self.done = True
        if self._ends:
            self._typed_events(lines)
        if self.on_response_id is not None and b'"response.created"' in lines:
            self._response_created(lines)
        if b'"usage":{' in lines or b'"usage": {' in lines:
            self._usage_lines(lines)

    def end(self) -> None:
        """The stream ended cleanly: read a last line that had no newline (`data: [DONE]` at EOF)."""
        if self._carry:
            carry, self._carry = self._carry, b""
            self.feed(carry + b"\n")

    def _typed_events(self, lines: bytes) -> None:
        """The end and error events of the typed streams (Anthropic's, the Responses API's), known by
        their parsed type, however the engine spaced its JSON: an `event:` line's value, or a `data:`
        line's top-level JSON `type`. An error is an `event: error` (what the anthropic SDK raises on)
        or, where the dialect says so (`json_error_type`: the Responses API), also an event whose JSON
        `type` is "error" (the openai SDK reads the data's `type`, not the `event:` line). A name is
        searched for first, so a chunk without one costs a substring search per name."""
        if not self.done:
            for name in self._ends:
                if name in lines and _has_type(lines, name, True):
                    self.done = True
                    break
        if not self.failed and b"error" in lines:
            self.failed = _has_type(lines, b"error", self._json_error)

    def _usage_lines(self, lines: bytes) -> None:
        """Read each `data:` line of `lines` (whole lines) that holds `"usage"`: found by substring
        search, not by splitting every line (a chunk often holds a whole answer of ~35 lines)."""
        pos = lines.find(b'"usage"')
        while pos >= 0:
            start = lines.rfind(b"\n", 0, pos) + 1
            end = lines.find(b"\n", pos)
            end = len(lines) if end < 0 else end
            line = lines[start:end]
            if line.startswith(b"data:"):
                self._usage_line(line.rstrip(b"\r"))
            pos = lines.find(b'"usage"', end)

    def _usage_line(self, line: bytes) -> None:
        """One event's usage, wherever the engine put it: on the event (a chat chunk, with choices or
        without; Anthropic's `message_delta`), or in the object it carries (`message`: Anthropic's
        `message_start`, and SGLang's earlier Messages layer's `message_stop`; `response`: the
        Responses API's final events). An Anthropic stream's counts are merged over its events
        (`gateway.protocol.anthropic.merge_stream_usage`): the engines split them differently (vLLM:
        the whole prompt in `message_start`, its uncached part and its cache fields in
        `message_delta`; SGLang: zeros in `message_start`, all in `message_delta`; llama.cpp: the
        prompt only in `message_start`, as Anthropic; `gateway/sim/anthropic.py`), so the prompt is
        counted once, and a zero in one event never hides a count another one reported. A line over
        MAX_CARRY_BYTES (token-level data) has only its usage object parsed (`_usage_object`), read in
        the chat names (`chat_usage`)."""
        if len(line) > MAX_CARRY_BYTES:  # token-level data: parse its usage object alone (`_usage_object`)
            usage = _usage_object(line)
            if usage is not None:
                self.usage = chat_usage(usage)
            return
        try:
            event = orjson.loads(line[5:].strip())
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        usage = event.get("usage")
        for holder in ("message", "response"):
            if isinstance(usage, dict):
                break
            nested = event.get(holder)
            usage = nested.get("usage") if isinstance(nested, dict) else None
        if not isinstance(usage, dict):
            return
        kind = event.get("type")
        if isinstance(kind, str) and kind.startswith("message_"):  # Anthropic's message_start/_delta/_stop
            merged = merge_stream_usage(self._anthropic or {}, usage)
            self._anthropic = merged
            self.usage = openai_usage(merged, self._cache_in_input)
        else:
            self.usage = chat_usage(usage)

    def _response_created(self, lines: bytes) -> None:
        for line in lines.split(b"\n"):
            if line.startswith(b"data:") and b'"response.created"' in line:
                try:
                    rid = response_id_of(orjson.loads(line[5:].strip()))
                except orjson.JSONDecodeError:
                    continue
                if rid is not None and self.on_response_id is not None:
                    callback, self.on_response_id = self.on_response_id, None
                    callback(rid)
                return


def _has_type(lines: bytes, name: bytes, json_type: bool) -> bool:
    """Whether a line of `lines` (whole lines) names an event of type `name`: an `event:` line whose
    value (after the one optional space SSE allows, without a `\r`) is `name`, or, when `json_type`,
    a `data:` line whose JSON object's top-level `type` is `name`. Only lines holding `name` are read;
    a `data:` line is parsed only when it holds `name` as a JSON string, so text that mentions it is
    never an event of that type (a raw `"` cannot occur inside a JSON string); one over
    MAX_CARRY_BYTES is searched for its `"type": name` member instead of being parsed."""
    quoted = b'"' + name + b'"'
    text = name.decode()
    pos = lines.find(name)
    while pos >= 0:
        start = lines.rfind(b"\n", 0, pos) + 1
        end = lines.find(b"\n", pos)
        end = len(lines) if end < 0 else end
        line = lines[start:end].rstrip(b"\r")
        if line.startswith(b"event:"):
            value = line[6:]
            if (value[1:] if value.startswith(b" ") else value) == name:
                return True
        elif json_type and line.startswith(b"data:") and quoted in line:
            if len(line) > MAX_CARRY_BYTES:  # token-level data: its `"type": name` member, not parsed whole
                if re.search(rb'"type"\s*:\s*' + re.escape(quoted), line):
                    return True
            else:
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    event = None
                if isinstance(event, dict) and event.get("type") == text:
                    return True
        pos = lines.find(name, end)
    return False


USAGE_OBJECT_MAX = 64 * 1024
"""Bytes of a usage object at most that `_usage_object` reads (one is a few hundred)."""
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')


def _usage_object(line: bytes) -> dict[str, Any] | None:
    """The last `"usage": {...}` object of a long event line (a chat chunk's own, or the Responses
    API's final event's, near its end), parsed alone: the line's token-level data (a prompt's
    token ids or logprobs) is never parsed into objects. None when there is none, or it is not a
    JSON object of at most USAGE_OBJECT_MAX bytes."""
    pos = line.rfind(b'"usage"')
    found = None
    while pos >= 0 and (found := _USAGE_KEY.match(line, pos)) is None:
        pos = line.rfind(b'"usage"', 0, pos)
    if found is None:
        return None
    start = found.end() - 1
    depth, in_string, escaped = 0, False, False
    for at in range(start, min(len(line), start + USAGE_OBJECT_MAX)):
        byte = line[at]
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte == 0x7B:
            depth += 1
        elif byte == 0x7D:
            depth -= 1
            if depth == 0:
                try:
                    usage = orjson.loads(line[start:at + 1])
                except orjson.JSONDecodeError:
                    return None
                return usage if isinstance(usage, dict) else None
    return None


def event_end(data: bytes | bytearray, stop: int | None = None, start: int = 0) -> int:
    """Index just past the last complete SSE event in `data[:stop]` (0 if none): after `\n\n` or
    `\r\n\r\n` (looked for from `start` on). Where the relay may cut a chunk, and where the event
    holding `stop` starts."""
    if stop is None and data.endswith((b"\n\n", b"\r\n\r\n")):
        return len(data)  # the common case (an engine writes whole events): no scan of the chunk
    lf, crlf = data.rfind(b"\n\n", start, stop), data.rfind(b"\r\n\r\n", start, stop)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def sse_error_event(message: str, code: str = "upstream_error", api: str = CHAT) -> bytes:
    """The gateway's error event for a stream it cannot finish, in the stream's API
    (`Dialect.stream_error`: OpenAI's error object in a `data:` event on chat and completions,
    Anthropic's `event: error` on Messages, OpenAI's typed error event on Responses)."""
    return dialect_for(api).stream_error(message, code)
