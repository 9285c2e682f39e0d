"""Chat tool calls and structured output of the simulator's vLLM mode (gateway.sim.chat_tools,
gateway.sim.structured), read by the real openai / anthropic SDKs through the gateway: scripted
`tool_calls`, forced (`required`, named) calls, `response_format` / `text.format` /
`output_config.format` answers, vLLM's refusals, and tools counted by `count_tokens`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
STEPS = {"steps": [{"text": "Let me check.", "tool_calls": [CALL]}, {"text": "Sunny."}]}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1}}, "required": ["city", "days"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "minItems": 1,
                                                                                   "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}, "n": {"type": "number"}},
          "required": ["name", "tags", "ok", "n"]}
LEAST = {"name": "", "tags": [""], "ok": False, "n": 0}


def _through_gateway(start_sim: StartSim, start_gateway: StartGateway, **sim: Any) -> tuple[RunningGateway,
                                                                                           RunningSim]:
    running = start_sim("vllm", **sim)
    return start_gateway([pool("p", "vllm", [running.url], 131072)]), running


@pytest.fixture
def scripted(start_sim: StartSim, start_gateway: StartGateway) -> tuple[openai.OpenAI, RunningSim]:
    gw, running = _through_gateway(start_sim, start_gateway)
    assert httpx.post(f"{running.url}/sim/script", json=STEPS, timeout=5).status_code == 200
    return openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0), running


def test_scripted_chat_tool_call_then_text(scripted: tuple[openai.OpenAI, RunningSim]) -> None:
    client, _ = scripted
    first = client.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER])  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.id == "chatcmpl-tool-sim-0-0" and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert first.usage is not None and first.usage.completion_tokens == 3 + 1 + 4  # words, name, argument pieces
    turns = [*ASK, choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="kimi-k3", messages=turns, tools=[WEATHER])  # type: ignore[arg-type]
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "Sunny."
    assert not second.choices[0].message.tool_calls


def test_scripted_chat_tool_call_streamed(scripted: tuple[openai.OpenAI, RunningSim]) -> None:
    client, _ = scripted
    chunks = list(client.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id == "chatcmpl-tool-sim-0-0" and calls[0].function and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments or "" for tc in calls if tc.function)) == CALL["arguments"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_forced_calls_fill_the_schema(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """`required` calls the first tool (finish `tool_calls`), a named choice that tool (finish `stop`, as
    vLLM's serving says for a named call); the arguments are the least the schema allows."""
    gw, _ = _through_gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    required = client.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER, other],  # type: ignore[arg-type]
                                              tool_choice="required")
    [call] = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content == ""
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 1}
    assert call.id.startswith("chatcmpl-tool-")
    named = list(client.chat.completions.create(
        model="kimi-k3", messages=ASK, tools=[WEATHER, other], stream=True,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "noop"}}))
    calls = [tc for c in named for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function and calls[0].function.name == "noop"
    assert "".join(tc.function.arguments or "" for tc in calls if tc.function) == "{}"
    assert named[-1].choices[0].finish_reason == "stop"


def test_a_call_cut_by_max_tokens_is_no_call(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _ = _through_gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    cut = client.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         max_tokens=2)  # type: ignore[arg-type]
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls


def test_tool_choice_refusals(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM's checks (chat_completion/protocol.py `check_tool_usage`; renderers/online_renderer.py without
    a tool parser), relayed by the gateway as the engine's 400."""
    gw, _ = _through_gateway(start_sim, start_gateway, tool_call_parser=None, enable_auto_tool_choice=False)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "does not match any of the specified `tools`", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required"},
         'tool_choice="required" requires --tool-call-parser to be set', None),
        ({"tools": [WEATHER]}, '"auto" tool choice requires --enable-auto-tool-choice', None),
        ({"tools": []}, "`tools` must not be an empty array.", "tools"),
    ]
    for extra, words, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="kimi-k3", messages=ASK, **extra)  # type: ignore[call-overload]
        assert words in refused.value.message and refused.value.param == param, extra
    fine = client.chat.completions.create(model="kimi-k3", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=3)  # type: ignore[arg-type]
    assert fine.choices[0].finish_reason == "length"


def test_structured_answers(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _ = _through_gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    chat = client.chat.completions.create(model="kimi-k3", messages=ASK, response_format=fmt)
    assert chat.choices[0].finish_reason == "stop"
    assert json.loads(chat.choices[0].message.content or "") == LEAST
    streamed = client.chat.completions.create(model="kimi-k3", messages=ASK, stream=True,
                                              response_format={"type": "json_object"})
    assert json.loads("".join(c.choices[0].delta.content or "" for c in streamed)) == {}
    cut = client.chat.completions.create(model="kimi-k3", messages=ASK, response_format=fmt, max_tokens=2)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content or "")
    response = client.responses.create(model="kimi-k3", input="Describe it.", text={  # type: ignore[call-overload]
        "format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}})
    assert json.loads(response.output_text) == LEAST and response.status == "completed"
    assert response.text.format.type == "json_schema"
    short = client.responses.create(model="kimi-k3", input="Describe it.", max_output_tokens=2,  # type: ignore[call-overload]
                                    text={"format": {"type": "json_object"}})
    assert short.output_text == "{}" and short.status == "completed"
    messages = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0).messages.create(
        model="kimi-k3", max_tokens=50, messages=ASK,  # type: ignore[arg-type]
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert messages.stop_reason == "end_turn" and json.loads(messages.content[0].text) == LEAST  # type: ignore[union-attr]


def test_response_format_refusals(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _ = _through_gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model="kimi-k3", messages=ASK, response_format={"type": "json_schema"})  # type: ignore[typeddict-item]
    assert "the 'json_schema' field must be provided" in missing.value.message
    assert missing.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model="kimi-k3", messages=ASK, response_format={"type": "yaml"})  # type: ignore[typeddict-item]
    assert "validation error" in unknown.value.message and "Input should be 'text'" in unknown.value.message


def test_count_tokens_counts_tools_and_system(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM's `count_tokens` renders the whole chat request, tools and system included
    (vllm/entrypoints/anthropic/serving.py); without a tool parser its `auto` choice is refused."""
    gw, running = _through_gateway(start_sim, start_gateway)
    client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    tool: Any = {"name": "get_weather", "description": "The weather.",
                 "input_schema": WEATHER["function"]["parameters"]}
    bare = client.messages.count_tokens(model="kimi-k3", messages=ASK).input_tokens  # type: ignore[arg-type]
    tooled = client.messages.count_tokens(model="kimi-k3", messages=ASK, tools=[tool]).input_tokens  # type: ignore[arg-type]
    system = client.messages.count_tokens(model="kimi-k3", messages=ASK, system="Be terse.").input_tokens  # type: ignore[arg-type]
    assert tooled > bare + 20 and system > bare
    made = client.messages.create(model="kimi-k3", max_tokens=3, messages=ASK, tools=[tool])  # type: ignore[arg-type]
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == tooled
    chat: dict[str, Any] = {"model": "kimi-k3", "messages": ASK, "tools": [WEATHER], "max_tokens": 2}
    rendered = httpx.post(f"{running.url}/v1/chat/completions/render", json=chat, timeout=10).json()["token_ids"]
    usage = httpx.post(f"{running.url}/v1/chat/completions", json=chat, timeout=10).json()["usage"]
    assert len(rendered) == usage["prompt_tokens"] > 20  # the render endpoint counts the tools as generation does
    gw2, _ = _through_gateway(start_sim, start_gateway, tool_call_parser=None, enable_auto_tool_choice=False)
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic.Anthropic(base_url=gw2.url, api_key="x", max_retries=0).messages.count_tokens(
            model="kimi-k3", messages=ASK, tools=[tool])  # type: ignore[arg-type]
    assert "--enable-auto-tool-choice" in str(refused.value)
