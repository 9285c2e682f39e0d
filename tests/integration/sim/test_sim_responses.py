"""The simulator's Responses API read by the real `openai` SDK, straight from the sim: vLLM's shapes,
stored responses in the sim's memory, `previous_response_id` chaining, vLLM's errors."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.sim.tokens import chat_prompt_tokens, output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_sdk_create_stream_retrieve_delete(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine=engine)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=5)
        assert done.output_text == output_text(5) and done.status == "completed"
        # 11 bytes at 4 bytes a token + the message overhead: chat's accounting of the same message
        assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (7, 5)
        events = list(client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=3,
                                              stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert client.responses.retrieve(done.id).output_text == done.output_text
        client.responses.delete(done.id)
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(done.id)
        assert f"Response with id '{done.id}' not found." in missing.value.message
    assert set(srv.app.responses.stored) == {events[-1].response.id}  # type: ignore[union-attr]


def test_previous_response_id_prepends_the_stored_conversation(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=100_000)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        first = client.responses.create(model="kimi-k3", input="x" * 400, instructions="Be brief.",
                                        max_output_tokens=4)
        second = client.responses.create(model="kimi-k3", input="y" * 40, instructions="Be brief.",
                                         previous_response_id=first.id, max_output_tokens=4)
        assert first.usage is not None and second.usage is not None
        # the prompt is the whole conversation: instructions, the first input, its answer, the new input
        conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 400},
                        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "y" * 40}]
        assert second.usage.input_tokens == chat_prompt_tokens(conversation, srv.engine.config)
        assert second.usage.input_tokens > first.usage.input_tokens + 10
        assert second.usage.input_tokens_details.cached_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="kimi-k3", input="z", previous_response_id="resp_nope")
        with pytest.raises(openai.BadRequestError) as cancel:
            client.responses.cancel(first.id)
        assert "synchronous" in cancel.value.message
    unstored = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "q", "store": False,
                                                           "max_output_tokens": 1}).json()
    assert unstored["id"] not in srv.app.responses.stored
    bad = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_vllm_refuses_a_prompt_of_max_model_len_and_clamps_the_output(start_sim: StartSim) -> None:
    srv = start_sim(max_context_tokens=100)
    too_long = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "x" * 400})
    assert too_long.status_code == 400  # 104 tokens: vLLM 0.32's renderer refuses it
    assert "maximum context length is 100 tokens" in too_long.json()["error"]["message"]
    full = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "x" * 384})
    assert full.status_code == 400  # exactly 100: serving.py's _validate_generator_input
    assert "exceeds the max_model_len 100" in full.json()["error"]["message"]
    clamped = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "x" * 360,
                                                          "max_output_tokens": 50}).json()
    assert clamped["usage"]["output_tokens"] == 100 - clamped["usage"]["input_tokens"]
