"""The simulator's Responses API read by the real `openai` SDK, straight from the sim: vLLM's shapes,
stored responses in the sim's memory, `previous_response_id` chaining, vLLM's errors."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from gateway.sim.tokens import chat_prompt_tokens, output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_sdk_create_stream_retrieve_delete(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine=engine, responses_delete=True)  # a server that deletes, as OpenAI does
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=5)
        assert done.output_text == output_text(5)
        # stopped by its limit: vLLM 0.32's `incomplete` (vllm/entrypoints/openai/responses/serving.py)
        assert done.status == "incomplete" and done.incomplete_details is not None
        assert done.incomplete_details.reason == "max_output_tokens"
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


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_delete_is_fastapis_405_as_vllm_has_no_such_route(start_sim: StartSim, engine: str) -> None:
    """vLLM 0.32 routes GET and POST …/cancel only (vllm/entrypoints/openai/responses/api_router.py):
    FastAPI's own 405, whatever the id; the response stays stored."""
    srv = start_sim(engine=engine)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.responses.create(model="kimi-k3", input="hello world")
        assert done.status == "completed" and done.incomplete_details is None  # the model's own end
    for rid in (done.id, "resp_unknown"):
        answer = httpx.delete(f"{srv.url}/v1/responses/{rid}")
        assert (answer.status_code, answer.json(), answer.headers["allow"]) == (
            405, {"detail": "Method Not Allowed"}, "GET")
    assert done.id in srv.app.responses.stored


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_stopped_by_its_limit_is_incomplete(start_sim: StartSim, stream: bool) -> None:
    """vLLM 0.32: finish reason "length" makes the status "incomplete" with reason max_output_tokens
    (`responses_full_generator`, `ResponsesResponse.from_request`); streamed, the last event is still
    `response.completed`. The context's room stops it too; the model's own end does not."""
    srv = start_sim("vllm", max_context_tokens=64, eos_after_tokens=6)
    body = {"model": "kimi-k3", "input": "hello world", "stream": stream}

    def final(extra: dict[str, object]) -> dict[str, object]:
        if not stream:
            return httpx.post(srv.url + "/v1/responses", json={**body, **extra}).json()  # type: ignore[no-any-return]
        with httpx.stream("POST", srv.url + "/v1/responses", json={**body, **extra}) as response:
            last = [e for e in response.read().split(b"\n\n") if e][-1]
        assert last.startswith(b"event: response.completed\n")
        return orjson.loads(last.split(b"\n")[1][6:])["response"]  # type: ignore[no-any-return]

    limited = final({"max_output_tokens": 3})
    assert (limited["status"], limited["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert limited["usage"]["output_tokens"] == 3  # type: ignore[index]
    ended = final({"max_output_tokens": 10})
    assert (ended["status"], ended["incomplete_details"], ended["usage"]["output_tokens"]) == (  # type: ignore[index]
        "completed", None, 6)


def test_background_response_is_queued_runs_and_cancels_as_vllm(start_sim: StartSim) -> None:
    """vLLM 0.32 (`_create_responses`, `cancel_responses`): a background response answers `queued` at once,
    no output, no usage; it generates in the engine; `cancel` answers it `cancelled` and aborts it, and a
    finished one is refused ("Cannot cancel a synchronous response.", param `response_id`)."""
    srv = start_sim(tpot_s=0.05)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        queued = client.responses.create(model="kimi-k3", input="hello world", background=True, max_output_tokens=500)
        assert (queued.status, queued.output, queued.usage, queued.background) == ("queued", [], None, True)
        srv.engine.wait_for(lambda: srv.engine.records[-1].completion_tokens_sent >= 1)
        cancelled = client.responses.cancel(queued.id)
        assert (cancelled.status, cancelled.output) == ("cancelled", [])
        assert client.responses.retrieve(queued.id).status == "cancelled"
        record = srv.engine.records[-1]
        assert record.aborted and record.completion_tokens_sent < 500
        finished = client.responses.create(model="kimi-k3", input="hello world", background=True, max_output_tokens=2)
        deadline = time.monotonic() + 10
        while client.responses.retrieve(finished.id).status == "queued":  # generating in the background
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.responses.retrieve(finished.id).output_text == output_text(2)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.cancel(finished.id)
        assert refused.value.body == {"message": "Cannot cancel a synchronous response.",
                                      "type": "invalid_request_error", "param": "response_id", "code": 400}
    no_store = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "hi", "background": True,
                                                           "store": False})
    assert no_store.status_code == 400 and no_store.json()["error"]["param"] == "background"


def test_only_a_background_stream_replays_others_break_the_connection(start_sim: StartSim) -> None:
    """vLLM 0.32 keeps the events of a background stream only (`event_store`); `GET ?stream=true` of any
    other response sends the 200 and its SSE headers, then breaks the connection."""
    srv = start_sim()
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        live = list(client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=3, stream=True,
                                            background=True))
        rid = live[0].response.id  # type: ignore[union-attr]
        assert live[-1].type == "response.completed"
        replayed = list(client.responses.retrieve(rid, stream=True, starting_after=1))
        assert [e.sequence_number for e in replayed] == [e.sequence_number for e in live[2:]]
        streamed = list(client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=3,
                                                stream=True))
        plain = client.responses.create(model="kimi-k3", input="hello world", max_output_tokens=3)
    for other in (streamed[0].response.id, plain.id):  # type: ignore[union-attr]
        with httpx.stream("GET", f"{srv.url}/v1/responses/{other}", params={"stream": "true"}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            with pytest.raises(httpx.RemoteProtocolError):
                answer.read()


def test_response_object_fields_are_vllms(start_sim: StartSim) -> None:
    """`ResponsesResponse` (vllm/entrypoints/openai/responses/protocol.py): sampling values as floats,
    `service_tier`, `truncation`, no `store`; `ResponseUsage` with its cache-write and per-turn details."""
    srv = start_sim()
    body = httpx.post(srv.url + "/v1/responses", json={"model": "kimi-k3", "input": "hi", "max_output_tokens": 2,
                                                       "temperature": 0, "presence_penalty": 1}).json()
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["frequency_penalty"]) == (
        0.0, 1.0, 1.0, 0.0)
    assert isinstance(body["temperature"], float)
    assert (body["service_tier"], body["truncation"], "store" in body) == ("auto", "disabled", False)
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0,
                                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []}
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []}
    unknown = httpx.get(srv.url + "/v1/responses/resp_nope").json()["error"]
    assert (unknown["param"], unknown["code"]) == ("response_id", 404)
