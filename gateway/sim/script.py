"""Scripted answers: a deterministic conversation for tests that drive a real agent (Claude Code,
Codex CLI) through the gateway.

    GET /sim/script, POST /sim/script     the script (JSON `SimScript`; POST replaces, `{}` clears)

A script is a list of steps, each the whole answer to one model turn: optional `text`, then the
`tool_calls` the model makes (name + JSON arguments). Which step answers a request follows from the
conversation the request carries, not from a counter, so an agent's retries or side requests do not
shift it: step i answers a conversation holding the results of every call of steps 0..i-1 (Anthropic
`tool_result` blocks by `tool_use_id`, Responses `function_call_output` items by `call_id`, chat
`tool` messages by `tool_call_id`) and not yet all of step i's. Past the last step, or with no script,
the engine answers as usual (filler).

`/v1/messages`, `/v1/responses` and `/v1/chat/completions` follow the script, in the engines' own shapes
(chat: `gateway.sim.chat_tools`):

- Messages (vLLM 0.33.0 `vllm/entrypoints/anthropic/serving.py`, SGLang `srt/entrypoints/anthropic/serving.py`):
  streamed, `message_start`, a text block (`content_block_start` / `text_delta`s /
  `content_block_stop`) when there is text, then per call `content_block_start` with
  `{"type": "tool_use", "id", "name", "input": {}}`, its arguments as `input_json_delta`
  `partial_json` pieces, `content_block_stop`; `message_delta` with `stop_reason` `tool_use` (or
  `end_turn`), `message_stop` (vLLM then `data: [DONE]`). Not streamed: one `message` with the
  text and `tool_use` blocks.
- Responses (vLLM 0.33.0 `vllm/entrypoints/openai/responses/streaming_events.py`): per call an output item
  `{"type": "function_call", "id": "fc_…", "call_id", "name", "arguments", "status"}`, streamed as
  `response.output_item.added` (empty arguments), `response.function_call_arguments.delta` pieces,
  `response.function_call_arguments.done`, `response.output_item.done`; text as the usual message
  item. The final `response.completed` lists every item.

Call ids are the step's own (`id`) or `toolu_sim_{step}_{call}` (Messages) / `call_sim_{step}_{call}`
(Responses) / `chatcmpl-tool-sim-{step}-{call}` (chat), item ids `fc_` + the call id: deterministic where
vLLM draws `fc_<uuid>` / `call_<uuid>` / `chatcmpl-tool-<uuid>`,
so a test can name the result it expects back. Each text word and each ~8-character argument piece
counts as one output token.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

Api = Literal["messages", "responses", "chat"]
_PIECE = 8  # characters of arguments per delta (one "token")


class ScriptedCall(BaseModel):
    """One tool call the model makes: the tool's `name` and its `arguments` (a JSON object)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(default=None, min_length=1, description="the call id; default: derived from the position")


class ScriptStep(BaseModel):
    """One model turn: `text` first (may be empty), then `tool_calls` (may be none)."""

    model_config = ConfigDict(extra="forbid")
    text: str = ""
    tool_calls: list[ScriptedCall] = Field(default_factory=list)


class SimScript(BaseModel):
    """The scripted conversation (`steps` in order); empty: no script."""

    model_config = ConfigDict(extra="forbid")
    steps: list[ScriptStep] = Field(default_factory=list)


def call_id(api: Api, step: int, index: int, call: ScriptedCall) -> str:
    """The id of call `index` of step `step` on `api`."""
    if call.id is not None:
        return call.id
    if api == "chat":
        return f"chatcmpl-tool-sim-{step}-{index}"
    return f"{'toolu' if api == 'messages' else 'call'}_sim_{step}_{index}"


def _answered_ids(api: Api, body: dict[str, Any]) -> set[str]:
    """The call ids the request's conversation carries results for."""
    ids: set[str] = set()
    if api == "messages":
        for turn in body.get("messages") or []:
            content = turn.get("content") if isinstance(turn, dict) else None
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    ids.add(str(block.get("tool_use_id")))
    elif api == "chat":
        for turn in body.get("messages") or []:
            if isinstance(turn, dict) and turn.get("role") == "tool":
                ids.add(str(turn.get("tool_call_id")))
    else:
        items = body.get("input")
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                ids.add(str(item.get("call_id")))
    return ids


def next_step(script: SimScript, api: Api, body: dict[str, Any]) -> tuple[int, ScriptStep] | None:
    """The step that answers this request body (its index and the step), or None (no script, or
    every step done): the first step whose calls are not all answered in the conversation."""
    answered = _answered_ids(api, body)
    for i, step in enumerate(script.steps):
        if not step.tool_calls or not all(call_id(api, i, j, c) in answered for j, c in enumerate(step.tool_calls)):
            return i, step
    return None


def _words(text: str) -> list[str]:
    """The text in pieces of one word each (with its leading space), one output token apiece."""
    pieces: list[str] = []
    for i, word in enumerate(text.split(" ")):
        pieces.append(word if i == 0 else " " + word)
    return [p for p in pieces if p] if text else []


def cut_text(step: ScriptStep, tokens: int) -> ScriptStep:
    """A text-only step cut to its first `tokens` output tokens (words)."""
    return ScriptStep(text="".join(_words(step.text)[:tokens]))


def tokens(step: ScriptStep) -> list[tuple[int | None, str]]:
    """The step's output tokens in order: `(None, word)` for its text, then `(j, piece)` for call j's
    arguments."""
    out: list[tuple[int | None, str]] = [(None, w) for w in _words(step.text)]
    for j, call in enumerate(step.tool_calls):
        out.extend((j, piece) for piece in _chunks(arguments_json(call)))
    return out


def _chunks(arguments: str) -> list[str]:
    return [arguments[i:i + _PIECE] for i in range(0, len(arguments), _PIECE)] or [""]


def arguments_json(call: ScriptedCall) -> str:
    """A call's arguments as the engines serialise them (`json.dumps` style: `", "` and `": "`)."""
    return json.dumps(call.arguments)


def output_tokens(step: ScriptStep) -> int:
    """The step's output tokens: its words and argument pieces."""
    return len(_words(step.text)) + sum(len(_chunks(arguments_json(c))) for c in step.tool_calls)


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def messages_events(api_step: tuple[int, ScriptStep]) -> list[bytes]:
    """The content events of a streamed Messages answer (after `message_start`, before
    `message_delta`), one per output token (block starts and stops ride along)."""
    index, step = api_step
    events: list[bytes] = []
    block = 0
    words = _words(step.text)
    if words:
        events.append(_event({"type": "content_block_start", "index": 0,
                              "content_block": {"type": "text", "text": ""}}))
        events.extend(_event({"type": "content_block_delta", "index": 0,
                              "delta": {"type": "text_delta", "text": w}}) for w in words)
        events.append(_event({"type": "content_block_stop", "index": 0}))
        block = 1
    for j, call in enumerate(step.tool_calls):
        events.append(_event({"type": "content_block_start", "index": block, "content_block": {
            "type": "tool_use", "id": call_id("messages", index, j, call), "name": call.name, "input": {}}}))
        events.extend(_event({"type": "content_block_delta", "index": block,
                              "delta": {"type": "input_json_delta", "partial_json": piece}})
                      for piece in _chunks(arguments_json(call)))
        events.append(_event({"type": "content_block_stop", "index": block}))
        block += 1
    return events


def messages_content(api_step: tuple[int, ScriptStep]) -> list[dict[str, Any]]:
    """The `content` of a non-streamed Messages answer: the text block, then the `tool_use` blocks."""
    index, step = api_step
    content: list[dict[str, Any]] = [{"type": "text", "text": step.text}] if step.text else []
    content.extend({"type": "tool_use", "id": call_id("messages", index, j, c), "name": c.name,
                    "input": c.arguments} for j, c in enumerate(step.tool_calls))
    return content


def stop_reason(step: ScriptStep) -> str:
    """`tool_use` when the model calls tools, else `end_turn`."""
    return "tool_use" if step.tool_calls else "end_turn"


def responses_items(api_step: tuple[int, ScriptStep], item_id: str) -> list[tuple[dict[str, Any], list[str]]]:
    """The Responses output items of a step with their deltas: the message item (id `item_id`, its
    words) when there is text, then one `function_call` item per call (its argument pieces); each
    item as it is once completed."""
    index, step = api_step
    items: list[tuple[dict[str, Any], list[str]]] = []
    if step.text:
        part: dict[str, Any] = {"annotations": [], "text": step.text, "type": "output_text", "logprobs": None}
        items.append(({"id": item_id, "content": [part], "role": "assistant", "status": "completed",
                       "type": "message"}, _words(step.text)))
    for j, call in enumerate(step.tool_calls):
        arguments = arguments_json(call)
        cid = call_id("responses", index, j, call)
        items.append(({"id": f"fc_{cid}", "call_id": cid, "name": call.name, "arguments": arguments,
                       "type": "function_call", "status": "completed"}, _chunks(arguments)))
    return items
