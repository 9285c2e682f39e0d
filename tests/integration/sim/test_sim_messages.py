"""The simulator's Anthropic Messages API over real HTTP: shapes, event order, usage, errors, and the
same prompt tokens and prefix-cache blocks as the equivalent chat request."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from gateway.sim.tokens import output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
HELLO = [{"role": "user", "content": "hello world"}]  # 11 bytes -> 3 tokens + 4 per message


def test_message_shape_and_usage(start_sim: StartSim) -> None:
    srv = start_sim("sglang")
    body = httpx.post(srv.url + "/v1/messages", json={"model": "kimi-k3", "max_tokens": 3, "messages": HELLO}).json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": output_text(3)}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("max_tokens", None)
    # the whole prompt, and SGLang's cached part of it again (srt/entrypoints/anthropic/serving.py)
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 0}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_stream_events_in_the_engines_order(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine)
    with httpx.stream("POST", srv.url + "/v1/messages",
                      json={"model": "kimi-k3", "max_tokens": 2, "messages": HELLO, "stream": True}) as response:
        raw = response.read()
    assert b"[DONE]" not in raw  # vLLM 0.32 turns its chat stream's [DONE] into message_stop; SGLang too
    events = [e.split(b"\n") for e in raw.split(b"\n\n") if e]
    names = [e[0].removeprefix(b"event: ").decode() for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(e[1].startswith(b'data: {"type":"' + n.encode() + b'"') for e, n in zip(events, names, strict=True))
    start = orjson.loads(events[0][1][6:])["message"]["usage"]
    delta = orjson.loads(events[5][1][6:])["usage"]
    if engine == "sglang":  # SGLang's chat stream has no usage before its end
        assert start == {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
        assert delta == {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 0}
    else:  # vLLM 0.32: the whole prompt first, Anthropic's split (no prefix cache here: all uncached) last
        assert start == {"input_tokens": 7, "output_tokens": 0}
        assert delta == {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 0,
                         "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_splits_a_cached_prompt_as_anthropic_does(start_sim: StartSim, stream: bool) -> None:
    """vLLM 0.32 (`vllm/entrypoints/anthropic/serving.py` `_build_anthropic_usage`): `input_tokens` is the
    prompt less its cached part and the part its prefill wrote to the cache; `message_start` has the whole."""
    srv = start_sim("vllm", kv_capacity_tokens=65536, kv_block_tokens=16)
    turns = [{"role": "user", "content": "lorem ipsum " * 40}]  # 480 bytes: 120 + 4 tokens, 7 full blocks
    usages: list[dict[str, int]] = []
    for _ in range(2):
        body = {"model": "kimi-k3", "max_tokens": 2, "messages": turns, "stream": stream}
        if not stream:
            usages.append(httpx.post(srv.url + "/v1/messages", json=body).json()["usage"])
            continue
        with httpx.stream("POST", srv.url + "/v1/messages", json=body) as response:
            raw = response.read()
        events = {e.split(b"\n")[0].removeprefix(b"event: ").decode(): orjson.loads(e.split(b"\n")[1][6:])
                  for e in raw.split(b"\n\n") if e.startswith(b"event:")}
        assert events["message_start"]["message"]["usage"] == {"input_tokens": 124, "output_tokens": 0}
        usages.append(events["message_delta"]["usage"])
    assert usages == [
        {"input_tokens": 12, "output_tokens": 2, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 112},
        {"input_tokens": 12, "output_tokens": 2, "cache_read_input_tokens": 112, "cache_creation_input_tokens": 0}]


@pytest.mark.parametrize(("mode", "start", "delta", "stop"), [
    ("llamacpp", {"input_tokens": 7, "output_tokens": 0}, {"output_tokens": 2}, None),
    ("sglang_message_stop", {"input_tokens": 0, "output_tokens": 0}, None, {"input_tokens": 7, "output_tokens": 2}),
])
def test_messages_usage_modes(start_sim: StartSim, mode: str, start: dict[str, int], delta: dict[str, int] | None,
                              stop: dict[str, int] | None) -> None:
    """`messages_usage` puts the usage where that engine's Messages layer does (gateway/sim/anthropic.py)."""
    srv = start_sim("vllm", messages_usage=mode)
    with httpx.stream("POST", srv.url + "/v1/messages",
                      json={"model": "kimi-k3", "max_tokens": 2, "messages": HELLO, "stream": True}) as response:
        raw = response.read()
    events = {e.split(b"\n")[0].removeprefix(b"event: ").decode(): orjson.loads(e.split(b"\n")[1][6:])
              for e in raw.split(b"\n\n") if e.startswith(b"event:")}
    assert events["message_start"]["message"]["usage"] == start
    assert (events["message_delta"]["usage"] if "message_delta" in events else None) == delta
    assert events["message_stop"].get("message", {}).get("usage") == stop


def test_same_prompt_tokens_and_cache_blocks_as_chat(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=100_000)
    system, question = "Be precise. " * 40, "What is a KV cache? " * 40
    chat = httpx.post(srv.url + "/v1/chat/completions", json={"model": "kimi-k3", "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}).json()
    counted = httpx.post(srv.url + "/v1/messages/count_tokens", json={
        "model": "kimi-k3", "system": system, "messages": [{"role": "user", "content": question}]}).json()
    prompt = chat["usage"]["prompt_tokens"]  # vLLM 0.32 repeats the count under context_management
    assert counted == {"input_tokens": prompt, "context_management": {"original_input_tokens": prompt}}
    message = httpx.post(srv.url + "/v1/messages", json={
        "model": "kimi-k3", "max_tokens": 1, "system": [{"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}).json()
    usage = message["usage"]  # vLLM 0.32's split: the cached part apart from input_tokens
    assert (usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
            == chat["usage"]["prompt_tokens"])
    record = srv.engine.records[-1]
    assert record.path == "/v1/messages"
    assert record.cached_tokens >= chat["usage"]["prompt_tokens"] - 16 - 8  # all but the last block


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "kimi-k3", "max_tokens": 2, "messages": []}, 400, "messages"),
    ({"model": "nope", "max_tokens": 2, "messages": HELLO}, 404, "does not exist"),
    # vLLM 0.32 refuses an output limit over max_model_len (vllm/renderers/params.py)
    ({"model": "kimi-k3", "max_tokens": 500_000, "messages": HELLO}, 400, "cannot be greater than max_model_len"),
])
def test_errors_are_anthropic_shaped(start_sim: StartSim, body: dict[str, object], status: int, words: str) -> None:
    srv = start_sim()
    response = httpx.post(srv.url + "/v1/messages", json=body)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and words in error["error"]["message"]
    assert error["error"]["type"] in ("BadRequestError", "NotFoundError")


def test_legacy_engines_do_not_serve_messages(start_sim: StartSim) -> None:
    srv = start_sim("vllm", api_version="legacy")
    assert httpx.post(srv.url + "/v1/messages", json={"model": "kimi-k3", "max_tokens": 2,
                                                      "messages": HELLO}).status_code == 404


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_integral_float_max_tokens_is_that_many_tokens(start_sim: StartSim, engine: str) -> None:
    """`AnthropicMessagesRequest.max_tokens: int` (lax): 5.0 is 5."""
    srv = start_sim(engine)
    response = httpx.post(srv.url + "/v1/messages", json={"model": "kimi-k3", "max_tokens": 5.0, "messages": HELLO})
    assert response.status_code == 200
    assert response.json()["usage"]["output_tokens"] == 5 and response.json()["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(("engine", "nested"), [("vllm", True), ("sglang", False)])
@pytest.mark.parametrize(("max_tokens", "error_type", "words"), [
    (None, "missing", "Field required"), (5.5, "int_from_float", "fractional part"),
    (0, "value_error", "max_tokens must be positive")])
def test_max_tokens_refused_by_the_request_model(start_sim: StartSim, engine: str, nested: bool,
                                                 max_tokens: float | None, error_type: str, words: str) -> None:
    """Refused by pydantic before the Messages handler runs, so answered by the engine's app-wide
    RequestValidationError handler, in its OpenAI shape (not Anthropic's), naming the field in
    `loc`; a missing field is "Field required", a sent one says what is wrong with it."""
    srv = start_sim(engine)
    body: dict[str, object] = {"model": "kimi-k3", "messages": HELLO}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    response = httpx.post(srv.url + "/v1/messages", json=body)
    assert response.status_code == 400
    error = response.json()
    inner = error["error"] if nested else error
    assert "type" not in error or error["type"] != "error"
    # vLLM 0.32's handler: `param` and `loc` the dotted path; SGLang: param null, FastAPI's tuple `loc`
    loc = "'body.max_tokens'" if nested else "('body', 'max_tokens')"
    assert (inner["type"], inner["param"]) == ("Bad Request", "body.max_tokens" if nested else None)
    assert f"'type': '{error_type}', 'loc': {loc}" in inner["message"] and words in inner["message"]
    assert ("Field required" in inner["message"]) is (max_tokens is None)


def test_an_error_mid_stream_is_the_last_event(start_sim: StartSim) -> None:
    """vLLM 0.32's `message_stream_converter` (`vllm/entrypoints/anthropic/serving.py`) yields an `error`
    event when its chat stream fails, and the stream ends there: no `data: [DONE]`."""
    srv = start_sim("vllm")
    body = {"model": "kimi-k3", "max_tokens": 4, "messages": HELLO, "stream": True,
            "x_sim_faults": {"error_after_chunks": 2}}
    with httpx.stream("POST", srv.url + "/v1/messages", json=body) as response:
        events = [e for e in response.read().split(b"\n\n") if e]
    assert len(events) == 3 and events[-1].startswith(b"event: error\ndata: ")
    assert orjson.loads(events[-1].split(b"\n")[1][6:])["error"]["type"] == "internal_error"
