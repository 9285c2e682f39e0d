"""Requests that fail because of what they ask (issue 10 §4): they must not eject workers, and the
body the engine gets must be one it honours (no top-level nulls, the output limit under the name
the engine reads)."""

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


def test_a_request_every_worker_fails_alike_is_its_own_fault(start_sim: StartSim,
                                                             start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm"), start_sim("vllm")]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH)
    # The simulator fails any request carrying this override: the request's own doing, on every worker.
    poison = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}],
              "x_sim_faults": {"fail_status": 500, "fail_body": '{"error": {"message": "bad grammar in request"}}'}}
    for n in range(1, 5):  # more than passive_failures (3) per worker
        response = httpx.post(gw.v1 + "/chat/completions", json=poison)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["message"] == "bad grammar in request"
        assert response.json()["error"]["type"] == "server_error"
        assert response.headers["x-should-retry"] == "false"  # the OpenAI SDKs do not resend it
        assert response.headers["x-kimi-gateway-attempts"] == "2"  # stopped after the second worker
        assert sum(len(s.engine.records) for s in sims) == 2 * n
    assert _ejections(gw) == 0
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    assert all(w["state"] == "healthy" for w in workers), workers
    ok = httpx.post(gw.v1 + "/chat/completions", json={**poison, "x_sim_faults": {}})
    assert ok.status_code == 200 and ok.headers["x-kimi-gateway-attempts"] == "1"


def test_a_worker_failing_alone_is_still_held_against_it(start_sim: StartSim, start_gateway: StartGateway) -> None:
    broken = start_sim("vllm", faults=SimFaults(fail_status=500))
    steady = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [broken.url, steady.url], 131072, policy="round_robin")],
                       health=HEALTH)
    chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for _ in range(6):  # round robin puts every other first attempt on the broken worker
        response = httpx.post(gw.v1 + "/chat/completions", json=chat)
        assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/1"
    assert len(broken.engine.records) == 3
    assert _ejections(gw) == 1  # three failures in a row, each followed by a success elsewhere


def test_a_500_then_another_500_with_a_different_cause_counts_both(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", faults=SimFaults(fail_status=500, fail_body=f'{{"error": {{"message": "dead {i}"}}}}'))
            for i in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)], health=HEALTH)
    for _ in range(3):
        response = httpx.post(gw.v1 + "/chat/completions",
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 502 and "x-should-retry" not in response.headers
    assert _ejections(gw) == 2


def test_the_same_error_with_another_status_is_not_the_same_failure(start_sim: StartSim,
                                                                    start_gateway: StartGateway) -> None:
    same_body = '{"error": {"message": "internal error"}}'
    sims = [start_sim("vllm", faults=SimFaults(fail_status=status, fail_body=same_body)) for status in (500, 501)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH)
    for _ in range(3):
        response = httpx.post(gw.v1 + "/chat/completions",
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 502 and "x-should-retry" not in response.headers
    assert _ejections(gw) == 2


def test_too_long_is_retried_on_one_larger_pool_only(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Both smaller engines count 1 token a byte, far above the gateway's estimate: each says "too long".
    sims = [start_sim("vllm", max_context_tokens=ctx, bytes_per_token=1.0) for ctx in (4096, 8192)]
    big = start_sim("vllm", max_context_tokens=65536)
    gw = start_gateway([pool("small", "vllm", [sims[0].url], 4096), pool("mid", "vllm", [sims[1].url], 8192),
                        pool("big", "vllm", [big.url], 65536)])
    response = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert (response.headers["x-kimi-gateway-pool"], response.headers["x-kimi-gateway-attempts"]) == ("mid", "2")
    assert [len(s.engine.records) for s in (*sims, big)] == [1, 1, 0]


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
