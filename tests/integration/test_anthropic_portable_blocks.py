"""Content blocks some engine kinds refuse or drop, and what the gateway does with them.

The simulator refuses what each engine's request model refuses (vLLM 0.33.0: a block type outside
its `AnthropicContentBlock.type`, `tool_addition` / `tool_removal` outside a system turn; SGLang
0.5.23: a type outside its block union, inside a `tool_result` too). The gateway forwards what an
engine may accept, and rewrites the two shapes that some refuse and others drop into the text an
engine that reads them renders: a `search_result` (SGLang's text) and a plain-text `document`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.protocol.anthropic import portable_blocks
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

SEARCH = {"type": "search_result", "title": "KV cache", "source": {"type": "url", "url": "https://kv.example/a"},
          "content": [{"type": "text", "text": "Keys and values."}, {"type": "text", "text": "Per token."}],
          "cache_control": {"type": "ephemeral"}}
SEARCH_TEXT = "Title: KV cache\nSource: https://kv.example/a\nContent: Keys and values.\nPer token."
DOC = {"type": "document", "title": "notes.txt", "context": "From the repo.",
       "source": {"type": "text", "media_type": "text/plain", "data": "Line one.\nLine two."}}
DOC_TEXT = "Title: notes.txt\nFrom the repo.\nLine one.\nLine two."
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}


def turns(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "Read these."}, *blocks]}]


def test_portable_blocks_renders_search_results_and_text_documents() -> None:
    payload = {"messages": [*turns(SEARCH, DOC, PDF), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [SEARCH]}]}]}
    assert portable_blocks(payload) == 3
    first, result = payload["messages"]
    assert first["content"][1] == {"type": "text", "text": SEARCH_TEXT, "cache_control": {"type": "ephemeral"}}
    assert first["content"][2] == {"type": "text", "text": DOC_TEXT}
    assert first["content"][3] == PDF  # no engine reads a PDF: left for the engine to refuse
    assert result["content"][0]["content"] == [{"type": "text", "text": SEARCH_TEXT,
                                                "cache_control": {"type": "ephemeral"}}]
    content_doc = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}
    image_doc = {"type": "document", "source": {"type": "content", "content": [{"type": "image", "source": {}}]}}
    payload = {"messages": turns(content_doc, image_doc)}
    assert portable_blocks(payload) == 1
    assert payload["messages"][0]["content"][1:] == [{"type": "text", "text": "a\nb"}, image_doc]
    garbage = {"messages": [None, {"content": "x"}, {"content": [3, {"type": "document", "source": "s"}]}]}
    before = copy.deepcopy(garbage)
    assert portable_blocks(garbage) == 0 and garbage == before


def post(gw: RunningGateway, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/messages", timeout=10,
                      json={"model": "kimi-k3", "max_tokens": 3, "messages": messages})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_search_results_and_text_documents_reach_every_engine_as_text(
        start_sim: StartSim, start_gateway: StartGateway, engine: str) -> None:
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    answer = post(gw, turns(SEARCH, DOC))
    assert answer.status_code == 200, answer.text
    assert sim.engine.records[-1].body["messages"][0]["content"][1:] == [
        {"type": "text", "text": SEARCH_TEXT, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": DOC_TEXT}]


@pytest.mark.parametrize(("engine", "blocks", "refused"), [
    ("vllm", [PDF], True), ("sglang", [PDF], True),
    ("vllm", [{"type": "bogus"}], True), ("sglang", [{"type": "redacted_thinking", "data": "x"}], False),
])
def test_a_block_the_engine_refuses_is_its_400(start_sim: StartSim, start_gateway: StartGateway, engine: str,
                                               blocks: list[dict[str, Any]], refused: bool) -> None:
    """Forwarded as sent; the engine's FastAPI validation answers 400 (in Anthropic's shape through
    the gateway), naming the block's place."""
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    answer = post(gw, turns(*blocks))
    assert sim.engine.records[-1].body["messages"] == turns(*blocks)
    if not refused:
        assert answer.status_code == 200, answer.text
        return
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    # vLLM 0.32 names the place dotted (`vllm_validation_message`, handlers/validation.py); SGLang as a tuple
    place = "messages.0.content.1.type" if engine == "vllm" else "'messages', 0, 'content', 1, 'type'"
    assert place in answer.json()["error"]["message"]


def test_each_engines_own_rules_for_tool_changes_and_tool_results(start_sim: StartSim) -> None:
    """vLLM takes `tool_addition` only in a system turn and any object inside a `tool_result`;
    SGLang has no `tool_addition` (Claude Code falls back to announcing the tool on that 400) and
    types a tool result's blocks too."""
    addition = {"type": "tool_addition", "tool": {"type": "tool_reference", "tool_name": "Bash"}}
    in_result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [PDF]}]}]
    cases = [("vllm", [{"role": "system", "content": [addition]}, *turns()], 200),
             ("vllm", turns(addition), 400), ("sglang", [{"role": "system", "content": [addition]}, *turns()], 400),
             ("vllm", in_result, 200), ("sglang", in_result, 400)]
    for engine, messages, status in cases:
        sim = start_sim(engine)
        answer = httpx.post(f"{sim.url}/v1/messages", timeout=10,
                            json={"model": "kimi-k3", "max_tokens": 2, "messages": messages})
        assert answer.status_code == status, (engine, messages, answer.text)
        if status == 400:  # the engine's app-wide validation answer, in its OpenAI shape (SGLang's is flat)
            error = answer.json().get("error", answer.json())
            assert error["type"] == "Bad Request" and "tool" in error["message"] + str(messages)
