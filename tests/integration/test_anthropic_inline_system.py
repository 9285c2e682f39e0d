"""A `system` turn in the middle of `messages` (what Claude Code 2.1 sends on `/v1/messages?beta=true`):
the gateway forwards it unchanged, as current vLLM, SGLang and llama.cpp accept it, and routes it as a
system message in its place; the simulator answers as each engine does (vLLM and SGLang refuse any
other role with their FastAPI validation 400, llama.cpp passes every role to its template)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from gateway.protocol.anthropic import MessagesRequest, to_chat
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

# The shape of Claude Code 2.1's requests: top-level system blocks, then a system reminder turn
# between the user's question and the assistant's tool call, and a tool result.
CLAUDE_CODE_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
    {"role": "system", "content": "<system-reminder>Plan mode is off.</system-reminder>"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                       "input": {"command": "ls"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}]},
    {"role": "system", "content": [{"type": "text", "text": "Keep answers short."}]},
]


def body(messages: list[dict[str, object]], stream: bool = False) -> dict[str, object]:
    return {"model": "kimi-k3", "max_tokens": 4, "stream": stream,
            "system": [{"type": "text", "text": "You are Claude Code."}], "messages": messages,
            "tools": [{"name": "Bash", "description": "Run a command.",
                       "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]}


def test_the_canonical_conversation_keeps_a_system_turn_in_its_place() -> None:
    chat = to_chat(MessagesRequest.model_validate(body(CLAUDE_CODE_TURNS)))
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system", "assistant", "tool", "system"]
    assert chat["messages"][2]["content"] == "<system-reminder>Plan mode is off.</system-reminder>"
    assert chat["messages"][5]["content"] == "Keep answers short."


@pytest.mark.parametrize("engine", ["vllm", "sglang", "ascend"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_mid_conversation_system_turn_reaches_the_engine_unchanged(
        start_sim: StartSim, start_gateway: StartGateway, engine: str, stream: bool) -> None:
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    sent = body(CLAUDE_CODE_TURNS, stream)
    answer = httpx.post(f"{gw.url}/v1/messages?beta=true", json=sent, timeout=10,
                        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})
    assert answer.status_code == 200, answer.text
    if stream:
        assert "event: message_stop" in answer.text
    else:
        assert answer.json()["type"] == "message"
    record = sim.engine.records[-1]
    assert record.status == 200
    assert record.body["messages"] == CLAUDE_CODE_TURNS


def test_count_tokens_takes_a_system_turn(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    sent = {k: v for k, v in body(CLAUDE_CODE_TURNS).items() if k not in ("max_tokens", "stream")}
    answer = httpx.post(f"{gw.url}/v1/messages/count_tokens", json=sent, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["input_tokens"] > 0
    assert sim.engine.records[-1].body["messages"] == CLAUDE_CODE_TURNS


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_another_role_is_the_engines_to_refuse(start_sim: StartSim, start_gateway: StartGateway,
                                               engine: str) -> None:
    """The gateway forwards a role it does not know; vLLM and SGLang refuse it (their pydantic model,
    answered by their app-wide validation handler in the OpenAI shape), llama.cpp renders it
    (tests/e2e/test_real_engine_messages.py)."""
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = httpx.post(f"{gw.url}/v1/messages", json=body(turns), timeout=10)
    assert answer.status_code == 400, answer.text
    assert sim.engine.records[-1].body["messages"] == turns  # it reached the engine, as sent
    assert "messages" in answer.text and "role" in answer.text


def test_an_empty_role_is_refused_by_the_gateway(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    answer = httpx.post(f"{gw.url}/v1/messages", json=body([{"role": "", "content": "Hi"}]), timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert sim.engine.records == []
