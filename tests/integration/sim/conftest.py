"""Fixtures for the engine simulator's HTTP tests (the sims themselves come from tests/conftest.py's
`start_sim`: 127.0.0.1, port 0, uvicorn threads joined at the session end)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest


@pytest.fixture
def sse_payloads() -> Callable[[bytes], list[Any]]:
    """Parse an SSE body into the JSON payload of each `data:` event (`[DONE]` kept as the string)."""

    def parse(body: bytes) -> list[Any]:
        events = [e for e in body.split(b"\n\n") if e.strip()]
        out: list[Any] = []
        for event in events:
            assert event.startswith(b"data: "), event
            data = event[len(b"data: "):]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
        return out

    return parse
