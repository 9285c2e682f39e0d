"""The simulator names requests as vLLM does and refuses an id that is already running
(gateway/sim/request_ids.py: `OutputProcessor.add_request` in vllm/v1/engine/output_processor.py);
its Responses API names the response after the body's `request_id` (vLLM's `ResponsesRequest`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


def _while_running(sim: RunningSim, first: Callable[[], object],
                   second: Callable[[], httpx.Response]) -> httpx.Response:
    """`second()`'s answer, sent while `first()` runs on the engine."""
    runner = threading.Thread(target=first)
    runner.start()
    try:
        sim.engine.wait_for(lambda: sim.engine.sim_stats()["running"] >= 1 or None, timeout=5)
        return second()
    finally:
        runner.join(10)


@pytest.mark.parametrize("same", ["header", "body"])
def test_vllm_refuses_a_running_chat_id_as_its_output_processor_does(start_sim: StartSim, same: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    extra = {"headers": {"x-request-id": "dup"}} if same == "header" else {"json": {**CHAT, "request_id": "dup"}}
    kwargs = {"json": CHAT, **extra, "timeout": 10}
    refused = _while_running(sim, lambda: httpx.post(sim.url + "/v1/chat/completions", **kwargs),
                             lambda: httpx.post(sim.url + "/v1/chat/completions", **kwargs))
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "Request id chatcmpl-dup already running."
    streamed = _while_running(sim, lambda: httpx.post(sim.url + "/v1/chat/completions", **kwargs),
                              lambda: httpx.post(sim.url + "/v1/chat/completions",
                                                 **{**kwargs, "json": {**kwargs["json"], "stream": True}}))
    assert streamed.status_code == 200  # a stream has started: the error is in it, then [DONE]
    assert "already running" in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    after = httpx.post(sim.url + "/v1/chat/completions", **kwargs)  # the id is free again once it ended
    assert after.status_code == 200


def test_the_responses_api_names_and_stores_the_response_by_the_request_id(start_sim: StartSim) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    body = {"model": "kimi-k3", "input": "hi", "max_output_tokens": 20, "request_id": "resp_chosen"}
    refused = _while_running(sim, lambda: httpx.post(sim.url + "/v1/responses", json=body, timeout=10),
                             lambda: httpx.post(sim.url + "/v1/responses", json=body, timeout=10))
    assert refused.status_code == 400 and "resp_chosen already running" in refused.text
    assert httpx.get(sim.url + "/v1/responses/resp_chosen").json()["id"] == "resp_chosen"
    other = httpx.post(sim.url + "/v1/responses", json={**body, "input": "again", "max_output_tokens": 1})
    assert other.json()["id"] == "resp_chosen"  # stored anew under the same key: the one before is gone
    assert httpx.get(sim.url + "/v1/responses/resp_chosen").json()["output"][0]["content"][0]["text"] == \
        other.json()["output"][0]["content"][0]["text"]


def test_sglang_workers_are_not_checked(start_sim: StartSim) -> None:
    sim = start_sim("sglang", tpot_s=0.05)
    kwargs = {"json": CHAT, "headers": {"x-request-id": "dup"}, "timeout": 10}
    answer = _while_running(sim, lambda: httpx.post(sim.url + "/v1/chat/completions", **kwargs),
                            lambda: httpx.post(sim.url + "/v1/chat/completions", **kwargs))
    assert answer.status_code == 200
