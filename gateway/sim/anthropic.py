"""Anthropic's Messages API in the simulator (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Served by the simulated engines at `api_version` "current" (vLLM's `vllm/entrypoints/anthropic`
layer, SGLang's `srt/entrypoints/anthropic` since 2026-02); "legacy" engines answer 404 as those
releases did. Like the engines, the simulator serves the request as its chat request (system
first as a system message, then the turns, a mid-conversation `system` turn as a system message in
its place; tool results as tool messages, tool uses as tool calls
with `json.dumps` arguments, images as image parts, thinking left out), so prompt tokens and
prefix-cache blocks are those of the equivalent chat request: a conversation alternating between
the two APIs hits the same cached blocks.

Shapes as those engines produce them (their serving code, read 2026-11; vLLM's 0.32.0): a
non-streaming `message` with its usage; streamed, `message_start`, `content_block_start` (an empty
text block, with the first token), `content_block_delta` (one `text_delta` per token),
`content_block_stop`, `message_delta` (stop reason, usage), `message_stop`, each as
`event: <type>` + `data: <json>`, and nothing after it: neither engine writes `data: [DONE]` (vLLM's
`message_stream_converter` turns its chat stream's `[DONE]` into `message_stop`). Where the usage
goes differs per engine (`MessagesUsage`, chosen by `SimConfig.messages_usage`; `usage_shapes`):

- `vllm` (0.32.0 `vllm/entrypoints/anthropic/serving.py`, `_build_anthropic_usage`, with prompt
  token details on, as the simulator's chat usage has them; its chat stream runs with
  `continuous_usage_stats`, so the first chunk has the prompt but no `prompt_tokens_details`,
  `vllm/entrypoints/openai/chat_completion/serving.py`): `message_start` `{input_tokens: P,
  output_tokens: 0}`; `message_delta` and the answer `{input_tokens: P - C - K, output_tokens: O,
  cache_read_input_tokens: C, cache_creation_input_tokens: K}`, Anthropic's split, with C the cached
  prefix and K the tokens the prefill wrote to the prefix cache (`ActiveRequest.created_cache_tokens`);
- `sglang` (`python/sglang/srt/entrypoints/anthropic/serving.py`, on its OpenAI chat stream, whose
  usage comes only in the last chunk): `message_start` `{input_tokens: 0, cache_read_input_tokens: 0,
  output_tokens: 0}`, `message_delta` `{input_tokens: P, output_tokens: O, cache_read_input_tokens: C}`
  with P the whole prompt and C its cached part (not Anthropic's split); the answer likewise;
- `sglang_message_stop` (SGLang's earlier `entrypoints/anthropic/serving_messages.py`):
  `message_start` `{input_tokens: 0, output_tokens: 0}`, no `message_delta`, and the usage in
  `message_stop`'s `message`;
- `llamacpp` (`tools/server/server-task.cpp`, `to_json_anthropic*`): `message_start`
  `{input_tokens: P, output_tokens: 0}`, `message_delta` `{output_tokens: O}` only, as Anthropic does.
Neither sends Anthropic's `ping` events (the gateway holds them as content-less if an engine does).
Errors are `{"type": "error", "error": {"type", "message"}}` with the engine's error type, except
a body the engine's `AnthropicMessagesRequest` refuses (`max_tokens` missing, 5.5 or <= 0): FastAPI
validates it before the handler runs, so the engine's app-wide RequestValidationError handler answers
in its OpenAI shape (`tokens.FieldValidationError`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.protocol.anthropic import (  # shared with the gateway: the engines' own constants
    ATTRIBUTION_PREFIX,
    STOP_REASONS,
)
from gateway.sim.config import MessagesUsage
from gateway.sim.tokens import FieldValidationError, PromptError

_ROLES = ("user", "assistant", "system")


# The content block types each engine's Anthropic request model accepts (released versions read:
# vLLM 0.33.0 `vllm/entrypoints/anthropic/protocol.py`, `AnthropicContentBlock.type`, whose
# `tool_addition` / `tool_removal` only a `system` turn may carry; SGLang 0.5.23
# `srt/entrypoints/anthropic/protocol.py`, the `AnthropicContentBlock` union, which also types the
# blocks inside a `tool_result`, where vLLM takes any object). Both type `role` as user, assistant
# or system. Anything else fails their FastAPI body validation: a 400 in their OpenAI shape.
VLLM_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                         "redacted_thinking", "tool_addition", "tool_removal"})
SGLANG_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "search_result",
                           "thinking", "redacted_thinking"})
_SYSTEM_ONLY = frozenset({"tool_addition", "tool_removal"})


def check_shapes(body: dict[str, Any], sglang: bool) -> None:
    """Refuse what the engine's request model refuses: a role other than user, assistant or system,
    a content block type outside the engine's set (in `system`, in each turn and, on SGLang, inside
    a `tool_result`), and on vLLM a `tool_addition` / `tool_removal` outside a system turn. Raises
    FieldValidationError (pydantic's errors, `loc` from "body"); shapes it does not read pass."""
    allowed = SGLANG_BLOCKS if sglang else VLLM_BLOCKS
    errors: list[dict[str, Any]] = []

    def blocks(content: Any, loc: tuple[Any, ...], role: str | None) -> None:
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str):
                continue  # left to the conversion's own error
            if kind not in allowed:
                errors.append({"type": "literal_error", "loc": (*loc, j, "type"), "input": kind,
                               "msg": "Input should be " + ", ".join(f"'{k}'" for k in sorted(allowed))})
            elif not sglang and kind in _SYSTEM_ONLY and role != "system":
                errors.append({"type": "value_error", "loc": (*loc, j), "input": block,
                               "msg": f'Value error, {kind} blocks are only allowed in messages with role "system"'})
            elif sglang and kind == "tool_result":
                blocks(block.get("content"), (*loc, j, "content"), role)

    blocks(body.get("system"), ("body", "system"), "system")
    messages = body.get("messages")
    for i, turn in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(turn, dict):
            continue
        role = turn.get("role")
        if role not in _ROLES:
            errors.append({"type": "literal_error", "loc": ("body", "messages", i, "role"), "input": role,
                           "msg": "Input should be 'user', 'assistant' or 'system'"})
        blocks(turn.get("content"), ("body", "messages", i, "content"), role if isinstance(role, str) else None)
    if errors:
        raise FieldValidationError(errors)


def chat_messages(body: dict[str, Any], sglang: bool = False) -> list[dict[str, Any]]:
    """The chat messages an Anthropic request stands for, as the engines build them; a `system` turn
    stays a system message in its place (vLLM 0.33.0 `entrypoints/anthropic/serving.py` and SGLang
    0.5.23 `srt/entrypoints/anthropic/serving.py` keep it there when the chat template renders a
    system message after others, else merge it into the leading system message: the simulator has
    no template, so it keeps it). Raises FieldValidationError for what `check_shapes` refuses
    (llama.cpp, which passes every role on and drops unknown blocks, is not simulated: tests/e2e
    runs the real one), PromptError for a malformed `system` or `messages`. vLLM leaves Claude Code's
    attribution text blocks (`ATTRIBUTION_PREFIX`) out of the top-level `system` and of `system`
    turns (`_convert_system_message` and `_extract_system_text` in `vllm/entrypoints/anthropic/serving.py`,
    0.32.0: a top-level `system` string keeps it); SGLang keeps them. SGLang makes a `tool_result`
    outside a user turn a text part "Tool result: ..." of that turn
    (python/sglang/srt/entrypoints/anthropic/serving.py `_convert_to_chat_completion_request`)."""
    system = body.get("system")
    out: list[dict[str, Any]] = []
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts: list[Any] = [b.get("text") for b in system if isinstance(b, dict) and b.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise PromptError("system: text blocks need a string 'text'")
        if not sglang:
            texts = [t for t in texts if not t.startswith(ATTRIBUTION_PREFIX)]
        if texts:
            out.append({"role": "system", "content": "\n".join(texts)})
    elif system is not None:
        raise PromptError("system must be a string or a list of text blocks")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages: Field required (a non-empty list)")
    check_shapes(body, sglang)
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not turn["role"]:
            raise PromptError("each message needs a role")
        content = turn.get("content")
        if turn["role"] == "system" and not sglang:  # vLLM: attribution text out of system turns too
            if isinstance(content, str) and content.startswith(ATTRIBUTION_PREFIX):
                continue
            if isinstance(content, list):
                content = [b for b in content if not (isinstance(b, dict) and b.get("type") == "text" and
                                                      str(b.get("text") or "").startswith(ATTRIBUTION_PREFIX))]
                if not content:
                    continue
        if isinstance(content, str):
            out.append({"role": turn["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise PromptError("message content must be a string or a list of content blocks")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        thinking = False
        results = 0
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(block.get("text") or "")})
            elif kind == "image":
                source = block.get("source") or {}
                url = (f"data:{source.get('media_type')};base64,{source.get('data')}"
                       if source.get("type") == "base64" else str(source.get("url") or ""))
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                result = block.get("content")
                if isinstance(result, list):
                    result = "\n".join(str(b.get("text") or "") for b in result if isinstance(b, dict))
                if sglang and turn["role"] != "user":  # SGLang: a result outside a user turn stays text
                    parts.append({"type": "text", "text": f"Tool result: {result or ''}"})
                    continue
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result or ""})
                results += 1
            elif kind == "thinking":
                thinking = True  # kept out of the prompt: chat templates drop earlier turns' reasoning
            elif kind is None:
                raise PromptError("content blocks must be objects with a 'type'")
        if parts or calls or thinking or not results:  # a turn of other blocks only (a document) stays
            message: dict[str, Any] = {"role": turn["role"], "content": parts}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def error_body(err_type: str, message: str) -> bytes:
    """Anthropic's error object with the engine's error type (vLLM: its exception's name)."""
    return orjson.dumps({"type": "error", "error": {"type": err_type, "message": message}})


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class UsageShapes:
    """One answer's usage objects as an engine writes them: in `message_start`, in `message_delta`
    (None: no such event), in `message_stop`'s `message` (None: no usage there), in the JSON answer."""

    start: dict[str, int]
    delta: dict[str, int] | None
    stop: dict[str, int] | None
    answer: dict[str, int]


def usage_shapes(mode: MessagesUsage, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                 created_tokens: int = 0) -> UsageShapes:
    """The usage objects of an answer of `prompt_tokens` (whole prompt, `cached_tokens` of it from the
    prefix cache, `created_tokens` of it written to the cache by its prefill) and `output_tokens`, as
    engine `mode` writes them."""
    whole = {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    start = {"input_tokens": prompt_tokens, "output_tokens": 0}
    if mode == "sglang":
        full = {**whole, "cache_read_input_tokens": cached_tokens}
        return UsageShapes({"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}, full, None, full)
    if mode == "sglang_message_stop":
        return UsageShapes({"input_tokens": 0, "output_tokens": 0}, None, whole, whole)
    if mode == "llamacpp":
        return UsageShapes(start, {"output_tokens": output_tokens}, None, whole)
    split = {"input_tokens": max(0, prompt_tokens - cached_tokens - created_tokens), "output_tokens": output_tokens,
             "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": created_tokens}
    return UsageShapes(start, split, None, split)


def message(mid: str, model: str, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
    """The non-streaming answer: one text block."""
    return {"id": mid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": model, "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None,
            "usage": usage}


def count_tokens_answer(input_tokens: int, vllm: bool) -> dict[str, Any]:
    """`POST /v1/messages/count_tokens`'s answer: the prompt's tokens; vLLM adds
    `context_management.original_input_tokens`, the same count (`count_tokens` in
    `vllm/entrypoints/anthropic/serving.py`, `AnthropicCountTokensResponse` in its `protocol.py`)."""
    if not vllm:
        return {"input_tokens": input_tokens}
    return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def message_start(mid: str, model: str, usage: dict[str, int]) -> bytes:
    """`message_start`: the message shell with the engine's start usage."""
    shell: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model,
             "stop_reason": None, "stop_sequence": None, "usage": usage}
    return event({"type": "message_start", "message": shell})


def block_start() -> bytes:
    """`content_block_start` of the (one) text block."""
    return event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})


def text_delta(text: str) -> bytes:
    return event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})


def stream_end(finish_reason: str, shapes: UsageShapes, mid: str = "", model: str = "",
               text: str = "") -> list[bytes]:
    """`content_block_stop`, `message_delta` (stop reason, usage) unless the engine sends none,
    `message_stop` (with the message and its usage where the engine puts it there: `mid`, `model`,
    `text`): the stream's last event (no `data: [DONE]`)."""
    stop_reason = STOP_REASONS.get(finish_reason, "end_turn")
    events = [event({"type": "content_block_stop", "index": 0})]
    if shapes.delta is not None:
        events.append(event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                             "usage": shapes.delta}))
    if shapes.stop is not None:
        events.append(event({"type": "message_stop", "message": message(mid, model, text, finish_reason, shapes.stop)}))
    else:
        events.append(event({"type": "message_stop"}))
    return events
