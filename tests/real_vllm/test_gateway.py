"""The gateway in front of two real vLLM engines (the tiny dense model, 2,048-token context, a LoRA adapter
declared at start and one loaded on demand): both SDKs on every API, the misbehaviours only a real engine
showed, a client hang-up aborting the engine's request, `/admin/workers` load read from vLLM's own
`/metrics`, and last (it kills an engine) a SIGKILL mid-stream migrated with the exact greedy text.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.real_vllm import contract
from tests.real_vllm.engine import VllmEngine, models_dir
from tests.support import RunningGateway, access_lines, pool

pytestmark = pytest.mark.vllm

MODEL, ADAPTER, CONTEXT = contract.MODEL, contract.ADAPTER, contract.CONTEXT
ON_DEMAND = "story-lora"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[VllmEngine]]:
    models = models_dir()
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"{ADAPTER}={models / 'lora'}"]
    started = [VllmEngine(models / "dense", [MODEL], max_model_len=CONTEXT, args=args) for _ in range(2)]
    try:
        for engine in started:
            engine.start()
        yield started
    finally:
        for engine in started:
            engine.stop()


def _gateway(start_gateway: Callable[..., RunningGateway], engines: list[VllmEngine],
             timeouts: dict[str, float] | None = None, **pool_extra: Any) -> RunningGateway:
    """A gateway with one vLLM pool of `engines` (round robin unless `pool_extra` says otherwise), once it
    has found them all healthy."""
    extra = {"policy": "round_robin", "lora_adapters": [ADAPTER],
             "lora_on_demand": [{"name": ON_DEMAND, "path": str(models_dir() / "lora")}], **pool_extra}
    gw = start_gateway([pool("vllm", "vllm", [e.url for e in engines], CONTEXT, **extra)],
                       health={"interval": 1.0, "timeout": 10.0, "verify_models": True},
                       timeouts={"first_byte_base": 120.0, **(timeouts or {})})
    _wait_healthy(gw, len(engines))
    return gw


def _wait_healthy(gw: RunningGateway, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        workers = httpx.get(gw.url + "/admin/workers", timeout=10).json()["pools"][0]["workers"]
        if sum(w["healthy"] for w in workers) == count:
            return
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)


def _oai(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_openai_sdk_on_chat_completions_and_responses(engines: list[VllmEngine],
                                                      start_gateway: Callable[..., RunningGateway]) -> None:
    client = _oai(_gateway(start_gateway, engines))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 8
    completion = client.completions.create(model=MODEL, prompt="The river", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason == "length"
    response = client.responses.create(model=MODEL, input="The river", max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.usage and response.usage.output_tokens == 8
    streamed = list(client.responses.create(model=MODEL, input="The river", max_output_tokens=8, temperature=0,
                                            stream=True))
    assert streamed[-1].type in {"response.completed", "response.incomplete"}


def test_anthropic_sdk_on_messages(engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    gw = _gateway(start_gateway, engines)
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=120, max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "The river"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    with client.messages.stream(model=MODEL, max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "The river"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text  # type: ignore[union-attr]
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "The river"}])
    assert counted.input_tokens > 0


def test_a_cached_messages_stream_is_billed_its_prompt_once(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway],
        caplog: pytest.LogCaptureFixture) -> None:
    # vLLM puts the whole prompt in message_start and (uncached part + cache_read_input_tokens) in
    # message_delta: the cached part must not be added on top of the whole prompt.
    caplog.set_level(logging.INFO, logger="gateway.access")
    gw = _gateway(start_gateway, engines, policy="prefix_affinity")
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=120, max_retries=0)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "extra_body": {"temperature": 0},
                            "system": contract.LONG_TEXT, "messages": [{"role": "user", "content": "Go on."}]}
    first = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        second = stream.get_final_message()
    assert (second.usage.cache_read_input_tokens or 0) >= contract.BLOCK  # the engine did hit its cache
    whole_prompt = (second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
                    + (second.usage.cache_creation_input_tokens or 0))
    assert whole_prompt == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) + (
        first.usage.cache_creation_input_tokens or 0)
    billed = [line["usage"]["prompt_tokens"] for line in access_lines(caplog, gw, 2)]
    assert billed == [whole_prompt, whole_prompt]


def test_a_max_tokens_the_prompt_leaves_no_room_for_is_served_shortened_as_vllm_does(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    client = _oai(_gateway(start_gateway, engines))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river " * 50}],
                                          max_tokens=CONTEXT - 8, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT


def test_a_request_without_an_output_limit_is_answered_and_ejects_no_worker(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    # vLLM generates to the end of the context when no max_tokens is given; a pool's small
    # default_output_tokens must not size the wait for it (it did: 504, then both workers ejected).
    gw = _gateway(start_gateway, engines, default_output_tokens=16,
                  timeouts={"first_byte_base": 1.0, "generation": 0.5, "generation_per_token": 0.01})
    client = _oai(gw)
    for _ in range(3):
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river"}],
                                              temperature=0)
        assert chat.choices[0].finish_reason == "length" and chat.usage
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT
    workers = httpx.get(gw.url + "/admin/workers", timeout=10).json()["pools"][0]["workers"]
    assert all(w["healthy"] and not w["ejected"] and w["ejections"] == 0 for w in workers), workers


def test_a_replay_the_engine_breaks_reaches_the_client_as_a_failure(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    # vLLM breaks the connection when asked to stream a stored response that was not created streaming.
    gw = _gateway(start_gateway, engines)
    created = httpx.post(gw.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "The river", "max_output_tokens": 8, "store": True})
    assert created.status_code == 200, created.text
    replay = httpx.get(gw.url + f"/v1/responses/{created.json()['id']}", params={"stream": "true"}, timeout=120)
    if replay.status_code == 200:
        events = contract.sse_events(replay.text)
        assert any(name == "error" or '"type": "error"' in data or '"type":"error"' in data for name, data in events)
        assert not any('"response.completed"' in data for _, data in events)
    else:
        assert replay.status_code >= 500 and replay.json()["error"]["message"]


def test_deleting_a_stored_response_vllm_cannot_delete_is_a_clear_405(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    gw = _gateway(start_gateway, engines)
    created = httpx.post(gw.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "The river", "max_output_tokens": 4, "store": True})
    deleted = httpx.delete(gw.url + f"/v1/responses/{created.json()['id']}", timeout=30)
    assert deleted.status_code == 405
    message = deleted.json()["error"]["message"]
    assert "{" not in message and "delet" in message.lower(), message


def test_lora_adapters_declared_and_loaded_on_demand(engines: list[VllmEngine],
                                                     start_gateway: Callable[..., RunningGateway]) -> None:
    client = _oai(_gateway(start_gateway, engines))
    base = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river"}],
                                          max_tokens=12, temperature=0).choices[0].message.content
    declared = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "The river"}],
                                              max_tokens=12, temperature=0).choices[0].message.content
    loaded = client.chat.completions.create(model=ON_DEMAND, messages=[{"role": "user", "content": "The river"}],
                                            max_tokens=12, temperature=0).choices[0].message.content
    assert declared == loaded != base  # the same adapter weights, served under two names
    listed = {m.id for m in client.models.list()}
    assert {MODEL, ADAPTER, ON_DEMAND} <= listed


def test_a_moe_model_is_served_through_the_gateway(start_gateway: Callable[..., RunningGateway]) -> None:
    # The tiny Qwen2-MoE (4 experts, top 2) runs vLLM's fused-MoE path on the CPU: a second model
    # behind the same gateway, answered on chat (streamed) and completions with vLLM's usage.
    moe = VllmEngine(models_dir() / "moe", ["tiny-moe"], max_model_len=CONTEXT).start()
    try:
        gw = start_gateway([pool("moe", "vllm", [moe.url], CONTEXT, served_model_name="tiny-moe")],
                           model={"name": "tiny-moe"},
                           health={"interval": 1.0, "timeout": 10.0, "verify_models": True})
        _wait_healthy(gw, 1)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": "The river"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 6
        completion = client.completions.create(model="tiny-moe", prompt="The river", max_tokens=6, temperature=0)
        assert completion.choices[0].finish_reason == "length" and completion.usage
        assert completion.usage.completion_tokens == 6
    finally:
        moe.stop()


def _finished(engine: VllmEngine) -> float:
    """Requests the engine finished by itself (stop or length), from its `vllm:request_success_total`."""
    total = 0.0
    for line in httpx.get(engine.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{") and ('reason="stop"' in line or 'reason="length"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_hang_up_aborts_the_engine_request_and_admin_reads_vllm_load(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    gw = _gateway(start_gateway, engines, policy="round_robin")
    deadline = time.monotonic() + 60
    while True:  # the gateway's load scrape read the engines' own /metrics (None before its first scrape)
        workers = httpx.get(gw.url + "/admin/workers", timeout=10).json()["pools"][0]["workers"]
        if all(w["engine_running"] is not None and w["kv_usage"] is not None for w in workers):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)
    # 16 sequences of ~2,000 tokens: seconds of work even for the tiny model on a quiet machine, so the
    # hang-up after the first content finds the engine still generating
    body = {"model": MODEL, "messages": [{"role": "user", "content": "The river"}], "max_tokens": CONTEXT - 64,
            "temperature": 1.0, "n": 16, "stream": True}
    finished = [_finished(e) for e in engines]
    generated = sum(e.metric("vllm:generation_tokens_total") for e in engines)
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=120) as response:
        next(response.iter_raw())  # the first content, then the client hangs up
    last, deadline = -1.0, time.monotonic() + 60
    while (now := sum(e.metric("vllm:generation_tokens_total") for e in engines)) != last:  # the engines settle
        assert time.monotonic() < deadline
        last = now
        time.sleep(1.5)
    assert [_finished(e) for e in engines] == finished  # aborted, not run to its end
    assert last - generated < 16 * (CONTEXT - 64)
    assert all(e.metric("vllm:num_requests_running") == 0 for e in engines)


def _stream(response: httpx.Response, on_event: Callable[[int], None]) -> list[str]:
    """The SSE events of `response` as text, calling `on_event(count)` after each."""
    events, buffer = [], b""
    for chunk in response.iter_raw():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event.decode())
            on_event(len(events))
    return events


def _content(events: list[str]) -> str:
    return "".join((choice.get("delta") or {}).get("content") or ""
                   for e in events if e.startswith("data: {") for choice in json.loads(e[6:]).get("choices") or [])


def _token_ids(events: list[str]) -> list[int]:
    return [t for e in events if e.startswith("data: {") for choice in json.loads(e[6:]).get("choices") or []
            for t in choice.get("token_ids") or []]


def test_zz_a_sigkilled_engine_s_stream_is_migrated_with_the_exact_greedy_text(
        engines: list[VllmEngine], start_gateway: Callable[..., RunningGateway]) -> None:
    # Last in the file: it kills engines[0]. After the kill the gateway continues the answer on engines[1]
    # from the text the client has (the chat twin + that text as a final assistant message). The client's
    # text must be exactly that prefix + what the engine answers to that continuation; and the whole
    # uninterrupted answer wherever the prefix tokenizes back to the tokens that made it (checked through
    # the engine's /tokenize: the tiny model was trained on the books so that its greedy words do).
    messages = [{"role": "user", "content": "Tell me about the river."}]
    # 1,500 tokens: the engine is still generating when the client has read 20 events, however fast it is
    body = {"model": MODEL, "messages": messages, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", engines[1].url + "/v1/chat/completions", timeout=120,
                      json={**body, "return_token_ids": True}) as direct:
        direct_events = _stream(direct, lambda n: None)
    uninterrupted, uninterrupted_ids = _content(direct_events), _token_ids(direct_events)
    gw = _gateway(start_gateway, engines, policy="round_robin")

    def kill(count: int) -> None:
        if count == 20:
            os.killpg(engines[0].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]

    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.headers["x-kimi-gateway-worker"] == "vllm/0"
        events = _stream(response, kill)
    assert engines[0].proc is not None and engines[0].proc.wait(30) is not None
    moved = [i for i, e in enumerate(events) if e.startswith(": x-kimi-gateway-migrated from=vllm/0 to=vllm/1")]
    assert len(moved) == 1, events[:30]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    prefix, rest = _content(events[:moved[0]]), _content(events[moved[0]:])
    assert prefix and uninterrupted.startswith(prefix)
    continued = httpx.post(engines[1].url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [*messages, {"role": "assistant", "content": prefix}], "temperature": 0,
        "max_tokens": 1500, "continue_final_message": True, "add_generation_prompt": False})
    assert continued.json()["choices"][0]["message"]["content"].startswith(rest)
    tokens = httpx.post(engines[1].url + "/tokenize", json={"model": MODEL, "prompt": prefix}, timeout=30).json()
    if tokens["tokens"] == uninterrupted_ids[:len(tokens["tokens"])]:
        # The uninterrupted answer, exactly: the continuation's output limit is the request's less the kept
        # text's tokens as the engine's /tokenize counts them (a loaded vLLM packs several tokens in a chunk).
        assert prefix + rest == uninterrupted
