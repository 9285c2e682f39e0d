"""Fixtures for the engine simulator's HTTP tests: sims on 127.0.0.1, port 0, in uvicorn threads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from gateway.server import ThreadedServer
from gateway.sim import SimConfig, sim_server

StartSim = Callable[..., ThreadedServer]


@pytest.fixture(scope="session")
def _stopping_sims() -> Iterator[list[ThreadedServer]]:
    """Sims told to exit; joined once at the end of the session.

    uvicorn needs ~0.2 s to shut down; letting that happen in the background keeps the suite fast.
    """
    stopping: list[ThreadedServer] = []
    yield stopping
    for server in stopping:
        server.stop()


@pytest.fixture
def start_sim(_stopping_sims: list[ThreadedServer]) -> Iterator[StartSim]:
    """Start a sim: `start_sim(engine="sglang", ttft_s=0.1, ...)` (defaults: vLLM, 4096 tokens).

    Every sim started through the fixture is told to exit at the end of the test.
    """
    servers: list[ThreadedServer] = []

    def start(**fields: Any) -> ThreadedServer:
        config = SimConfig.model_validate({"engine": "vllm", "max_context_tokens": 4096, **fields})
        server = sim_server(config).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.server.should_exit = True
        _stopping_sims.append(server)


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
