"""Anthropic's Messages API in the simulator (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Served by the simulated engines at `api_version` "current" (vLLM's `vllm/entrypoints/anthropic`
layer, SGLang's `srt/entrypoints/anthropic` since 2026-02); "legacy" engines answer 404 as those
releases did. Like the engines, the simulator serves the request as its chat request (system
first as a system message, then the turns, a mid-conversation `system` turn as a system message in
its place; tool results as tool messages, tool uses as tool calls
with `json.dumps` arguments, images as image parts, thinking left out), so prompt tokens and
prefix-cache blocks are those of the equivalent chat request: a conversation alternating between
the two APIs hits the same cached blocks.

Shapes as those engines produce them (their serving code, read 2026-11): a non-streaming `message`
whose usage is `input_tokens` (the whole prompt) and `output_tokens`; streamed, `message_start`
(input usage), `content_block_start` (an empty text block, with the first token),
`content_block_delta` (one `text_delta` per token), `content_block_stop`, `message_delta` (stop
reason; `input_tokens` and `output_tokens`), `message_stop`, each as `event: <type>` +
`data: <json>`; vLLM then writes `data: [DONE]` (its chat stream's end, passed on), SGLang does not.
Neither sends Anthropic's `ping` events (the gateway holds them as content-less if an engine does).
Errors are `{"type": "error", "error": {"type", "message"}}` with the engine's error type, except
a body the engine's `AnthropicMessagesRequest` refuses (`max_tokens` missing, 5.5 or <= 0): FastAPI
validates it before the handler runs, so the engine's app-wide RequestValidationError handler answers
in its OpenAI shape (`tokens.FieldValidationError`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.sim.tokens import PromptError, engine_errors

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
_ROLES = ("user", "assistant", "system")


class _EngineTurn(BaseModel):
    """A turn's role as vLLM's and SGLang's `AnthropicMessage` types it now: `user`, `assistant` and
    `system` (a system turn mid-conversation, which Claude Code 2.1 sends: vLLM
    `entrypoints/anthropic/inline_system.py`, SGLang `srt/entrypoints/anthropic/request_conversion.py`).
    Another role fails their FastAPI body validation (a 400 in their OpenAI shape)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]


class _EngineTurns(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[_EngineTurn]


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages an Anthropic request stands for, as the engines build them; a `system` turn
    stays a system message in its place (vLLM and SGLang do so when the chat template can place it,
    else they fold or merge it: the simulator has no template, so it keeps it). A role other than
    user, assistant or system raises FieldValidationError, as their pydantic request model refuses
    it (llama.cpp, which passes every role on, is not simulated: tests/e2e runs the real one).
    Raises PromptError for a malformed `system` or `messages`."""
    system = body.get("system")
    out: list[dict[str, Any]] = []
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts = [b.get("text") for b in system if isinstance(b, dict) and b.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise PromptError("system: text blocks need a string 'text'")
        if texts:
            out.append({"role": "system", "content": "\n".join(texts)})
    elif system is not None:
        raise PromptError("system must be a string or a list of text blocks")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages: Field required (a non-empty list)")
    if not all(isinstance(t, dict) and t.get("role") in _ROLES for t in messages):
        try:
            _EngineTurns.model_validate({"messages": messages})
        except ValidationError as exc:
            raise engine_errors(exc) from None
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not turn["role"]:
            raise PromptError("each message needs a role")
        content = turn.get("content")
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


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    """The engines' usage: the whole prompt as `input_tokens` (no cache fields)."""
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}


def message(mid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
            output_tokens: int) -> dict[str, Any]:
    """The non-streaming answer: one text block."""
    return {"id": mid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": model, "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None,
            "usage": usage(prompt_tokens, output_tokens)}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def message_start(mid: str, model: str, prompt_tokens: int) -> bytes:
    """`message_start`: the message shell with the input usage."""
    shell = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model,
             "stop_reason": None, "stop_sequence": None, "usage": usage(prompt_tokens, 0)}
    return event({"type": "message_start", "message": shell})


def block_start() -> bytes:
    """`content_block_start` of the (one) text block."""
    return event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})


def text_delta(text: str) -> bytes:
    return event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})


def stream_end(finish_reason: str, prompt_tokens: int, output_tokens: int, done: bool) -> list[bytes]:
    """`content_block_stop`, `message_delta` (stop reason, usage), `message_stop`, and with `done`
    (vLLM) `data: [DONE]`."""
    events = [event({"type": "content_block_stop", "index": 0}),
              event({"type": "message_delta", "delta": {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
                                                        "stop_sequence": None},
                     "usage": usage(prompt_tokens, output_tokens)}),
              event({"type": "message_stop"})]
    return [*events, b"data: [DONE]\n\n"] if done else events
