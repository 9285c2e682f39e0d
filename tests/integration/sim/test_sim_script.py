"""The simulator's scripted answers (`POST /sim/script`, gateway.sim.script) in the engines' shapes,
read by the real SDKs: Anthropic `tool_use` blocks streamed as `input_json_delta`, Responses
`function_call` items streamed as `function_call_arguments.delta`; which step answers follows the
tool results the conversation carries."""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
CALL = {"name": "Bash", "arguments": {"command": "ls -la", "description": "List files"}}
STEPS = {"steps": [{"text": "Let me look.", "tool_calls": [CALL]}, {"text": "Two files."}]}


@pytest.fixture
def sim(start_sim: StartSim) -> RunningSim:
    running = start_sim("vllm")
    assert httpx.post(f"{running.url}/sim/script", json=STEPS, timeout=5).json()["steps"][1]["text"] == "Two files."
    return running


def test_a_bad_script_is_refused(sim: RunningSim) -> None:
    answer = httpx.post(f"{sim.url}/sim/script", json={"steps": [{"tool_calls": [{"name": ""}]}]}, timeout=5)
    assert answer.status_code == 422
    kept = httpx.get(f"{sim.url}/sim/script", timeout=5).json()  # the last good script stays
    assert kept == {"steps": [{"text": "Let me look.", "tool_calls": [{**CALL, "id": None}]},
                              {"text": "Two files.", "tool_calls": []}]}


def test_messages_tool_use_then_text(sim: RunningSim) -> None:
    client = anthropic.Anthropic(base_url=sim.url, api_key="x", max_retries=0)
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    turns: list[dict[str, object]] = [{"role": "user", "content": "List the files."}]
    with client.messages.stream(model="kimi-k3", max_tokens=100, messages=turns, tools=tools) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert "input_json" in kinds and kinds.count("content_block_stop") == 2
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me look."
    assert use.type == "tool_use" and use.id == "toolu_sim_0_0" and use.name == "Bash"
    assert use.input == CALL["arguments"]
    assert first.usage.output_tokens == 3 + len(json.dumps(CALL["arguments"])) // 8 + 1
    turns += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a b"}]}]
    second = client.messages.create(model="kimi-k3", max_tokens=100, messages=turns, tools=tools)  # type: ignore[arg-type]
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == "Two files."  # type: ignore[union-attr]
    again = client.messages.create(model="kimi-k3", max_tokens=3, messages=turns[:1])  # type: ignore[arg-type]
    assert again.content[-1].type == "tool_use"  # a fresh conversation starts the script again


def test_responses_function_call_then_text(sim: RunningSim) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(model="kimi-k3", input="List the files.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert json.loads(deltas) == CALL["arguments"]
    final = events[-1].response  # type: ignore[union-attr]
    message, call = final.output
    assert message.type == "message" and message.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert call.type == "function_call" and call.call_id == "call_sim_0_0" and call.name == "Bash"
    assert json.loads(call.arguments) == CALL["arguments"]
    second = client.responses.create(model="kimi-k3", input=[
        {"role": "user", "content": "List the files."},
        {"type": "function_call", "call_id": call.call_id, "name": "Bash", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a b"}])
    assert second.output_text == "Two files." and [o.type for o in second.output] == ["message"]
