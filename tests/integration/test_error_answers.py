"""What the client is told when the gateway cannot serve it (issue 10 §9): the model object for
`models.retrieve()`, errors that name the pool the request was meant for and the real cause,
OpenAI's `param` for a prompt too long everywhere, and honest waits when every worker is busy."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


def test_models_retrieve_every_listed_id(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       model={"name": "kimi-k3", "aliases": ["Kimi-K3", "moonshotai/Kimi-K3"]})
    c = client(gw)
    listed = [m.id for m in c.models.list()]
    assert "moonshotai/Kimi-K3" in listed
    for model_id in listed:
        model = c.models.retrieve(model_id)
        assert (model.id, model.object) == (model_id, "model")
        assert model.created > 0 and model.owned_by
    for unknown in ("gpt-4o", "moonshotai/Kimi-K2", "kimi-k3/extra"):
        with pytest.raises(openai.NotFoundError) as info:
            c.models.retrieve(unknown)
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
        assert unknown in body["message"]
    assert not sim.engine.records


def test_models_retrieve_needs_a_key_when_auth_is_on(start_sim: StartSim, start_gateway: StartGateway) -> None:
    from gateway.auth.keys import hash_key

    key = "sk-" + "a" * 40
    gw = start_gateway([pool("p", "vllm", [start_sim("vllm").url], 131072)],
                       auth={"enabled": True, "keys": [{"name": "app", "sha256": hash_key(key)}]})
    assert httpx.get(gw.v1 + "/models/kimi-k3").status_code == 401
    answer = httpx.get(gw.v1 + "/models/kimi-k3", headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 200 and answer.json()["id"] == "kimi-k3"


def test_every_pool_down_names_the_pool_meant_and_the_cause(start_gateway: StartGateway) -> None:
    import socket

    ports = []
    for _ in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    gw = start_gateway([pool("small", "vllm", [f"http://127.0.0.1:{ports[0]}"], 131072),
                        pool("mid", "sglang", [f"http://127.0.0.1:{ports[1]}"], 524288),
                        pool("big", "vllm", [f"http://127.0.0.1:{ports[2]}"], 1048576)],
                       health={"interval": 30, "timeout": 1.0})
    for _ in range(2):  # first with three refused connections, then with every worker known down
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT)
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("No inference server of pool small"), message
        assert "spilled over to, up to big" in message
        assert "ConnectError" in message or "connect" in message.lower(), message
        assert "small/0 unhealthy" in message
        assert response.headers["retry-after"] == "30"  # the next probe may bring one back, not sooner
        assert response.json()["error"]["code"] == "no_healthy_upstream"


@pytest.mark.parametrize(("api", "body", "param"), [
    ("chat", {"messages": [{"role": "user", "content": "word " * 1000}]}, "messages"),
    ("completions", {"prompt": "word " * 1000}, "prompt"),
])
def test_an_engines_too_long_on_the_largest_pool_names_the_prompt(start_sim: StartSim,
                                                                  start_gateway: StartGateway,
                                                                  api: str, body: dict[str, object],
                                                                  param: str) -> None:
    only = start_sim("sglang", max_context_tokens=4096, bytes_per_token=1.0)  # SGLang sends param: null
    gw = start_gateway([pool("only", "sglang", [only.url], 4096)])
    response = httpx.post(f"{gw.v1}/{'chat/completions' if api == 'chat' else 'completions'}",
                          json={"model": "kimi-k3", "max_tokens": 4, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert "context length" in error["message"]


@pytest.mark.parametrize(("api", "param"), [("chat", "messages"), ("completions", "prompt")])
def test_over_every_pools_context_names_the_prompt(start_sim: StartSim, start_gateway: StartGateway,
                                                   api: str, param: str) -> None:
    sim = start_sim("vllm", max_context_tokens=4096)
    gw = start_gateway([pool("p", "vllm", [sim.url], 4096)])
    body = ({"messages": [{"role": "user", "content": "hi"}]} if api == "chat" else {"prompt": "hi"})
    response = httpx.post(f"{gw.v1}/{'chat/completions' if api == 'chat' else 'completions'}",
                          json={"model": "kimi-k3", "max_tokens": 5000, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert not sim.engine.records


def test_every_worker_429_gives_the_shortest_wait_and_the_engines_limits(start_sim: StartSim,
                                                                         start_gateway: StartGateway) -> None:
    limits = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
              "x-ratelimit-reset-requests": "7s"}
    slow = start_sim("vllm", faults=SimFaults(fail_status=429, retry_after_s=9,
                                              fail_headers={**limits, "x-ratelimit-reset-requests": "9s"}))
    soon = start_sim("vllm", faults=SimFaults(fail_status=429, retry_after_s=7, fail_headers=limits))
    gw = start_gateway([pool("p", "vllm", [slow.url, soon.url], 131072, policy="round_robin")])
    with pytest.raises(openai.InternalServerError) as info:
        client(gw).chat.completions.create(**CHAT)  # type: ignore[arg-type]
    response = info.value.response
    assert response.status_code == 503
    assert info.value.body["code"] == "upstream_overloaded"  # type: ignore[index]
    assert "pool p" in info.value.body["message"]  # type: ignore[index]
    assert response.headers["retry-after"] == "7"  # the sooner of 9 and 7
    assert {k: response.headers[k] for k in limits} == limits  # the worker that asked for 7
    assert len(slow.engine.records) == 1 and len(soon.engine.records) == 1
    # Both workers now sit out their Retry-After: a later request is told how long that still is.
    later = httpx.post(gw.v1 + "/chat/completions", json=CHAT)
    assert later.status_code == 503 and later.json()["error"]["code"] == "upstream_overloaded"
    assert later.headers["retry-after"] in ("6", "7"), later.headers
    assert "p/1 busy (429)" in later.json()["error"]["message"]
    assert len(slow.engine.records) == 1 and len(soon.engine.records) == 1  # nothing sent meanwhile
