"""Issue 23 with the real llama.cpp engine (SmolLM2-135M, temperature 0): a worker SIGKILLed in the
middle of a streamed answer, and the client still reads exactly the answer an uninterrupted run
gives, in one stream, for chat and completions (the continuation on the other worker is prefilled
with the text so far: llama.cpp continues a trailing assistant message; a completion prompt gets
the text appended)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.llamacpp_worker import LlamaCppSettings, LlamaCppWorker
from tests.e2e.smollm2 import SMOLLM2_ESTIMATION
from tests.support import RunningGateway, pool

pytestmark = pytest.mark.engine

STORY = "Write a short story about a lighthouse keeper."
BODIES = {
    "chat": {"model": "kimi-k3", "messages": [{"role": "user", "content": STORY}], "max_tokens": 80,
             "temperature": 0, "stream": True},
    "completions": {"model": "kimi-k3", "prompt": "The history of the lighthouse begins", "max_tokens": 80,
                    "temperature": 0, "stream": True},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest.fixture
def doomed() -> Iterator[LlamaCppWorker]:
    """A llama.cpp worker this test kills."""
    worker = LlamaCppWorker(LlamaCppSettings(n_ctx=2048)).start()
    try:
        yield worker
    finally:
        worker.stop()


def _pieces(events: list[bytes], api: str) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def _text(chunks: list[dict[str, Any]], api: str) -> str:
    key = "content" if api == "chat" else "text"
    return "".join((c.get("delta") or {}).get(key) or "" if api == "chat" else c.get(key) or ""
                   for chunk in chunks for c in chunk.get("choices") or ())


def _events(response: httpx.Response, on_event: Callable[[int], None] = lambda n: None) -> list[bytes]:
    events: list[bytes] = []
    buffer = b""
    for chunk in response.iter_raw():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event)
            on_event(len(events))
    assert buffer == b""
    return events


def _gateway_before(doomed: LlamaCppWorker, worker_2k: LlamaCppWorker,
                    start_gateway: Callable[..., RunningGateway]) -> tuple[RunningGateway, Callable[[int], None]]:
    """A gateway whose pool is `doomed` then `worker_2k` (round robin: the first stream goes to
    `doomed`), and the `on_event` callback that SIGKILLs `doomed` at the stream's 12th event."""
    gw = start_gateway([pool("cpu", "llamacpp", [doomed.url, worker_2k.url], 2048, policy="round_robin")],
                       timeouts={"first_byte_base": 120.0}, estimation=SMOLLM2_ESTIMATION,
                       health={"interval": 30, "timeout": 10.0})

    def kill(count: int) -> None:
        if count == 12:
            os.kill(doomed.process.pid, signal.SIGKILL)
            doomed.process.wait()

    return gw, kill


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_sigkilled_worker_s_stream_reads_as_the_uninterrupted_answer(
        api: str, doomed: LlamaCppWorker, worker_2k: LlamaCppWorker,
        start_gateway: Callable[..., RunningGateway]) -> None:
    body = BODIES[api]
    with httpx.stream("POST", worker_2k.url + PATHS[api], json=body, timeout=120) as direct:
        uninterrupted = _text(_pieces(_events(direct), api), api)
    gw, kill = _gateway_before(doomed, worker_2k, start_gateway)

    with httpx.stream("POST", gw.url + PATHS[api], json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "cpu/0"
        events = _events(response, kill)
    assert doomed.process.poll() is not None
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events), events[-3:]
    assert any(e.startswith(b": x-kimi-gateway-migrated from=cpu/0 to=cpu/1") for e in events)
    chunks = _pieces(events, api)
    assert _text(chunks, api) == uninterrupted
    assert len({c["id"] for c in chunks}) == 1


def test_a_sigkilled_worker_s_messages_stream_reads_as_the_uninterrupted_answer(
        doomed: LlamaCppWorker, worker_2k: LlamaCppWorker, start_gateway: Callable[..., RunningGateway]) -> None:
    # A Messages answer goes on on the engine's chat API (its chat twin + the text so far); the
    # client still reads one Anthropic stream with the uninterrupted run's text.
    body = {"model": "kimi-k3", "max_tokens": 80, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": STORY}]}

    def text(events: list[bytes]) -> str:
        out = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: {") and b'"text_delta"' in line:
                    out.append(json.loads(line[6:])["delta"]["text"])
        return "".join(out)

    with httpx.stream("POST", worker_2k.url + "/v1/messages", json=body, timeout=120) as direct:
        uninterrupted = text(_events(direct))
    gw, kill = _gateway_before(doomed, worker_2k, start_gateway)

    with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "cpu/0"
        events = _events(response, kill)
    assert doomed.process.poll() is not None
    kinds = [e.split(b"\n")[0] for e in events if e.startswith(b"event: ")]
    assert kinds.count(b"event: message_start") == 1 and kinds[-1] == b"event: message_stop", kinds[-3:]
    assert b"event: error" not in kinds and kinds.count(b"event: message_delta") == 1
    assert any(e.startswith(b": x-kimi-gateway-migrated from=cpu/0 to=cpu/1") for e in events)
    assert text(events) == uninterrupted
