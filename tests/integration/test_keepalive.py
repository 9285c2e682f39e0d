"""SSE keep-alive comments while a long prefill sends nothing: the response is committed after
`timeouts.hold_headers`, then a comment goes out every `timeouts.keepalive_interval`."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}


def test_keepalives_during_prefill_then_the_stream(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=1.0)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"hold_headers": 0.2, "keepalive_interval": 0.2})
    started = time.monotonic()
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        assert time.monotonic() - started < 0.8  # headers came before the first token
        received = b"".join(response.iter_raw())
    comments = received.count(b": keep-alive\n\n")
    assert 3 <= comments <= 6
    assert received.startswith(b": keep-alive\n\n" * comments)
    assert received.endswith(b"data: [DONE]\n\n")
    # The real OpenAI SDK ignores the comments.
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, stream=True))
    assert len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()) == 3


def test_quick_first_token_sends_no_keepalive(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.0)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"hold_headers": 0.5, "keepalive_interval": 0.5})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT) as response:
        assert b"keep-alive" not in b"".join(response.iter_raw())


def test_hang_up_during_keepalives_aborts_the_engine(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=30.0)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"hold_headers": 0.1, "keepalive_interval": 0.1})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT) as response:
        assert next(response.iter_raw()).startswith(b": keep-alive")
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=5)
    assert record.first_byte_at is None
    gw.wait_until_idle()


def test_engine_failing_during_prefill_after_keepalives_is_an_error_event(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.6)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"hold_headers": 0.1, "keepalive_interval": 0.1})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT) as response:
        parts = response.iter_raw()
        assert next(parts).startswith(b": keep-alive")
        sim.server.server.should_exit = True  # the engine goes away mid-prefill
        sim.server.server.force_exit = True
        rest = b"".join(parts)
    assert b'"code":"upstream_error"' in rest and b"[DONE]" not in rest
