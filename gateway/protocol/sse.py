"""An incremental SSE observer for the relay: counts events, sees `[DONE]`, keeps the usage object.

It never changes bytes; it reads a copy of each chunk. Lines split across chunks are joined from a
small carry buffer; JSON is parsed only for `data:` lines that carry a non-null `usage`
(OpenAI's `stream_options.include_usage` chunk, https://platform.openai.com/docs/api-reference/chat-streaming).
"""

from __future__ import annotations

from typing import Any

import orjson

# A line longer than this is not tracked (no engine sends one; it bounds memory).
MAX_CARRY_BYTES = 1 << 20


class SSETap:
    """Feed it every relayed chunk, in order. Attributes after the stream ends:

    `events` (data events seen), `done` (`data: [DONE]` seen), `usage` (the last usage dict or None).
    """

    __slots__ = ("_carry", "done", "events", "usage")

    def __init__(self) -> None:
        self.events = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk if self._carry else chunk
        lines = data.split(b"\n")
        carry = lines.pop()
        self._carry = carry if len(carry) <= MAX_CARRY_BYTES else b""
        for line in lines:
            if line.startswith(b"data:"):
                self._data_line(line)

    def _data_line(self, line: bytes) -> None:
        self.events += 1
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        if b'"usage"' not in payload or b'"usage":null' in payload or b'"usage": null' in payload:
            return
        try:
            usage = orjson.loads(payload).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(usage, dict):
            self.usage = usage


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """One SSE `data:` event holding an OpenAI error object (what the OpenAI SDKs raise on)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"
