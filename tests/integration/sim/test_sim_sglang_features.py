"""The simulator's SGLang 0.5.23 mode where SGLang differs from vLLM (gateway.sim.sglang_shapes,
gateway.sim.chat_tools): its usage object, its refusals of tools and formats, and its tool calls, read
by the real openai SDK."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LONG = [{"role": "user", "content": "A long shared prefix for the cache. " * 60}]


def _client(sim: RunningSim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)


def test_usage_as_sglang_reports_it(start_sim: StartSim) -> None:
    """`reasoning_tokens` always; `prompt_tokens_details` only with the cache report and a cached prefix
    (python/sglang/srt/entrypoints/openai/usage_processor.py)."""
    sim = start_sim("sglang", kv_capacity_tokens=100_000, kv_block_tokens=16)
    body = {"model": "kimi-k3", "messages": LONG, "max_tokens": 2}
    first = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=10).json()["usage"]
    assert first["prompt_tokens_details"] is None and first["reasoning_tokens"] == 0
    assert first["total_tokens"] == first["prompt_tokens"] + first["completion_tokens"]
    again = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=10).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    streamed = list(_client(sim).chat.completions.create(model="kimi-k3", messages=LONG, max_tokens=2,  # type: ignore[arg-type]
                                                         stream=True, stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == again["prompt_tokens_details"]["cached_tokens"]
    text = httpx.post(sim.url + "/v1/completions", json={"model": "kimi-k3", "prompt": "The river", "max_tokens": 2},
                      timeout=10).json()["usage"]
    assert text["prompt_tokens_details"] is None and text["reasoning_tokens"] == 0

    quiet = start_sim("sglang", kv_capacity_tokens=100_000, kv_block_tokens=16, enable_cache_report=False)
    for _ in range(2):
        usage = httpx.post(quiet.url + "/v1/chat/completions", json=body, timeout=10).json()["usage"]
    assert usage["prompt_tokens_details"] is None


@pytest.mark.parametrize(("extra", "words"), [
    ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "Tools cannot be empty if tool choice is set to a specific tool."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' not found in tools list."),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "schema_ is required for json_schema response format request."),
])
def test_sglang_refusals(start_sim: StartSim, extra: dict[str, Any], words: str) -> None:
    """SGLang's `_validate_request` (python/sglang/srt/entrypoints/openai/serving_chat.py): 400 in its flat
    error shape."""
    sim = start_sim("sglang")
    answer = httpx.post(sim.url + "/v1/chat/completions", json={"model": "kimi-k3", "messages": ASK, **extra},
                        timeout=10)
    assert answer.status_code == 400
    assert answer.json() == {"object": "error", "message": words, "type": "BadRequestError", "param": None,
                             "code": 400}


def test_sglang_tool_calls(start_sim: StartSim) -> None:
    """With a tool parser a named choice finishes `tool_calls` (vLLM says `stop`) and ids are
    `call_<24 hex>`; without one the forced choice is a JSON constraint answered as text."""
    parsed = _client(start_sim("sglang", tool_call_parser="kimi_k2"))
    named = parsed.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type]
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls or []
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content == ""
    assert call.id.startswith("call_") and len(call.id) == 29 and json.loads(call.function.arguments) == {"city": ""}
    plain = _client(start_sim("sglang", tool_call_parser=None))
    required = plain.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type]
                                             tool_choice="required")
    assert not required.choices[0].message.tool_calls and required.choices[0].finish_reason == "stop"
    assert json.loads(required.choices[0].message.content or "") == [{"name": "get_weather",
                                                                      "parameters": {"city": ""}}]
    auto = plain.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER], max_tokens=2)  # type: ignore[arg-type]
    assert auto.choices[0].finish_reason == "length"  # SGLang refuses no `auto` choice, parser or not


def test_sglang_messages_tools(start_sim: StartSim) -> None:
    """SGLang's Messages layer checks the converted chat request (`invalid_request_error`), forces a call
    for `any`, and takes a `tool_result` outside a user turn (as text: python/sglang/srt/entrypoints/
    anthropic/serving.py), counting it in the prompt."""
    sim = start_sim("sglang", tool_call_parser="kimi_k2")
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    body: dict[str, Any] = {"model": "kimi-k3", "max_tokens": 5, "messages": ASK, "tools": [tool]}
    refused = httpx.post(sim.url + "/v1/messages", timeout=10, json={
        **body, "tool_choice": {"type": "tool", "name": "nope"}})
    assert refused.status_code == 400
    assert refused.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "Tool 'nope' not found in tools list."}}
    forced = httpx.post(sim.url + "/v1/messages", json={**body, "tool_choice": {"type": "any"}}, timeout=10).json()
    assert forced["stop_reason"] == "tool_use" and forced["content"][0]["input"] == {"city": ""}
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny and warm all day"}]}]
    counted = [httpx.post(sim.url + "/v1/messages", json={**body, "messages": m}, timeout=10).json()["usage"]
               for m in (ASK, history)]
    assert counted[1]["input_tokens"] > counted[0]["input_tokens"]
