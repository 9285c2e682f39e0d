"""Requests refused before any engine sees them, each with an OpenAI error: JSON nested deeper than
can be forwarded, more messages than `max_messages`, empty token-id prompts and more of them than
`max_prompt_ids`, and a path with a trailing slash."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field", ["x_extra", "tools"])
def test_json_nested_deeper_than_can_be_forwarded_is_a_400(start_sim: StartSim, start_gateway: StartGateway,
                                                           field: str) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    nested = "[" * 300 + "]" * 300
    body = json.dumps(CHAT)[:-1] + f', "{field}": {nested}}}'
    response = httpx.post(gw.v1 + "/chat/completions", content=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert not sim.engine.records


def test_too_many_messages_is_refused_fast(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_messages=1000)
    body = {"model": "kimi-k3", "messages": [{"role": "user"}] * 1001}
    response = httpx.post(gw.v1 + "/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_messages"


def test_trailing_slash_is_a_json_404(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    response = httpx.post(gw.v1 + "/chat/completions/", json=CHAT)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_empty_token_id_lists_are_refused_and_counted_by_the_size_cap(start_sim: StartSim,
                                                                      start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_prompt_ids=1000)
    empty = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": [[1, 2], []]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt[1]"
    many = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": [[]] * 1001})
    assert many.status_code == 400 and many.json()["error"]["code"] == "context_length_exceeded"
    assert not sim.engine.records
