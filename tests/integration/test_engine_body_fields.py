"""The body an engine gets is one it honours (issue 10 §4): no top-level nulls (an engine version
answers 500 to `"max_tokens": null` on completions), nested nulls kept as the client sent them, and
the output limit under the name the engine reads (`max_completion_tokens` on completions is sent as
`max_tokens` to vLLM and SGLang, kept for llama.cpp, and decides the pool either way)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from gateway.sim.generation import NULL_MAX_TOKENS_MESSAGE
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

HEALTH = {"interval": 60, "passive_failures": 3, "ejection_base": 30}  # probes stay out of the way


def _ejections(gw: RunningGateway) -> float:
    return gw.metric("kimi_gateway_worker_ejections_total{")


def test_null_max_tokens_on_completions_is_not_forwarded(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # An engine version that answers 500 to `"max_tokens": null` on completions (issue 10's report).
    sims = [start_sim("vllm", faults=SimFaults(null_max_tokens_500=True)) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH)
    direct = httpx.post(sims[0].url + "/v1/completions",
                        json={"model": "kimi-k3", "prompt": "Once", "max_tokens": None})
    assert direct.status_code == 500 and NULL_MAX_TOKENS_MESSAGE in direct.text  # the fault is real
    sims[0].engine.clear_records()
    body = {"model": "kimi-k3", "prompt": "Once upon a time", "max_tokens": None, "stop": None, "user": None,
            "logit_bias": {"50256": -100}, "stream_options": None}
    for _ in range(4):
        response = httpx.post(gw.v1 + "/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-kimi-gateway-attempts"] == "1"
    received = [r.body for s in sims for r in s.engine.records]
    assert len(received) == 4
    assert all(r == {"model": "kimi-k3", "prompt": "Once upon a time", "logit_bias": {"50256": -100}}
               for r in received), received
    assert _ejections(gw) == 0


def test_nested_nulls_reach_the_engine(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    messages = [{"role": "user", "content": "call f"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    body = {"model": "kimi-k3", "messages": messages, "max_tokens": 2, "seed": None,
            "chat_template_kwargs": {"thinking": None}}
    assert httpx.post(gw.v1 + "/chat/completions", json=body).status_code == 200
    received = sim.engine.records[-1].body
    assert "seed" not in received
    assert received["messages"] == messages  # a null content inside a message is the message's own
    assert received["chat_template_kwargs"] == {"thinking": None}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_max_completion_tokens_on_completions_is_sent_as_max_tokens(start_sim: StartSim,
                                                                    start_gateway: StartGateway,
                                                                    engine: str) -> None:
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    c = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    completion = c.completions.create(model="kimi-k3", prompt="Once upon a time", max_tokens=None,
                                      extra_body={"max_completion_tokens": 200})
    assert completion.usage is not None and completion.usage.completion_tokens == 200  # not the engine's 16
    sent = sim.engine.records[-1].body
    assert sent["max_tokens"] == 200 and "max_completion_tokens" not in sent
    # Both given: max_completion_tokens wins, as OpenAI ranks them and as the gateway reserved it.
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model="kimi-k3", prompt="Once", max_tokens=3, stream=True, extra_body={"max_completion_tokens": 7})
        if ch.choices]
    assert len("".join(pieces).split()) == 7
    assert sim.engine.records[-1].body["max_tokens"] == 7
    # Chat: the engines read max_completion_tokens themselves; it is forwarded as sent.
    c.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}],
                              max_completion_tokens=5)
    sent = sim.engine.records[-1].body
    assert sent["max_completion_tokens"] == 5 and "max_tokens" not in sent


def test_max_completion_tokens_kept_for_an_engine_that_reads_it_on_completions(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")  # speaks the API; the pool says llama.cpp, which reads max_completion_tokens
    gw = start_gateway([pool("p", "llamacpp", [sim.url], 131072)])
    response = httpx.post(gw.v1 + "/completions",
                          json={"model": "kimi-k3", "prompt": "Once", "max_completion_tokens": 9})
    assert response.status_code == 200
    sent = sim.engine.records[-1].body
    assert sent["max_completion_tokens"] == 9 and "max_tokens" not in sent


def test_completions_max_completion_tokens_decides_the_pool(start_sim: StartSim, start_gateway: StartGateway) -> None:
    small, big = start_sim("vllm", max_context_tokens=2048), start_sim("vllm", max_context_tokens=8192)
    gw = start_gateway([pool("small", "vllm", [small.url], 2048), pool("big", "vllm", [big.url], 8192)])
    response = httpx.post(gw.v1 + "/completions",
                          json={"model": "kimi-k3", "prompt": "Once", "max_tokens": 10,
                                "max_completion_tokens": 4000})
    assert response.status_code == 200
    assert response.headers["x-kimi-gateway-pool"] == "big"
    assert response.headers["x-kimi-gateway-attempts"] == "1"
    assert not small.engine.records
