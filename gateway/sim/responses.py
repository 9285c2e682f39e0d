"""OpenAI-compatible payloads in vLLM's shapes (chat and text completions, SSE events, models).

Field sets follow vLLM's protocol models as serialised with `exclude_unset`: stream choices carry
`logprobs: null` and `finish_reason`; the choice that finishes also carries `stop_reason: null`;
with `stream_options.include_usage` every chunk has `"usage": null` and a last chunk with
`"choices": []` carries the usage. Payloads are serialised compactly (orjson: UTF-8, no spaces),
as pydantic's `model_dump_json` does.

Where the engines' shapes differ, `AnswerShape` (from the worker's dialect) says how:

- `system_fingerprint`: vLLM 0.32 stamps its fingerprint on every JSON answer and on a stream's
  last chunk: the usage chunk with `include_usage`, else the chunk that finishes
  (`vllm/entrypoints/openai/chat_completion/serving.py` and `completion/serving.py`; the string
  comes from `vllm/entrypoints/serve/utils/fingerprint.py`, `vllm-<version>-<8 hex of the config
  hash>` by default).
- A chat message without tool calls: vLLM's `ChatMessage` drops its empty `tool_calls` and names
  its reasoning `reasoning` (`vllm/entrypoints/openai/chat_completion/protocol.py`); the SGLang and
  legacy vLLM dialects keep `"tool_calls": []` and `reasoning_content`.
- Chat usage: vLLM's `prompt_tokens_details` carries `created_cache_tokens`, the prompt tokens its
  prefill wrote to the prefix cache (`_make_prompt_tokens_details` in the chat serving module);
  completions carry `cached_tokens` only (`completion/serving.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

SSE_DONE = b"data: [DONE]\n\n"

Kind = Literal["chat", "text"]


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event: `data: {json}` and a blank line."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True)
class AnswerShape:
    """How one engine shapes chat and text answers where the engines differ (module docstring)."""

    fingerprint: str | None = None
    """`system_fingerprint` of JSON answers and of a stream's last chunk; None: never set."""
    drop_empty_tool_calls: bool = False
    reasoning_field: str = "reasoning_content"
    created_cache_tokens: bool = False
    """Chat usage reports `prompt_tokens_details.created_cache_tokens`."""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          created_cache_tokens: int | None = None) -> dict[str, Any]:
    """The usage object (vLLM with prompt-token details enabled): `cached_tokens` of the prompt
    tokens came from the prefix cache (0 without a simulated cache); `created_cache_tokens` (when
    not None) were written to it by this request's prefill."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if created_cache_tokens is not None:
        details["created_cache_tokens"] = created_cache_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


@dataclass(frozen=True)
class ResponseMeta:
    """Identity shared by every payload of one response."""

    kind: Kind
    id: str
    created: int
    model: str
    shape: AnswerShape = AnswerShape()

    @staticmethod
    def new(kind: Kind, model: str, shape: AnswerShape | None = None) -> ResponseMeta:
        """Fresh id (`chatcmpl-…` / `cmpl-…`) and creation time (Unix seconds)."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return ResponseMeta(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, shape or AnswerShape())

    def chat_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                   created_cache_tokens: int) -> dict[str, Any]:
        """The usage object of this answer (chat's with `created_cache_tokens` where the engine reports it)."""
        created = created_cache_tokens if self.kind == "chat" and self.shape.created_cache_tokens else None
        return usage(prompt_tokens, completion_tokens, cached_tokens, created)

    @property
    def chunk_object(self) -> str:
        """`object` of stream chunks: "chat.completion.chunk" or "text_completion"."""
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


@dataclass(frozen=True)
class StreamFormat:
    """How a stream reports usage: `include_usage` (final usage chunk, `"usage": null` elsewhere) and
    `continuous_usage` (running usage on every chunk)."""

    include_usage: bool = False
    continuous_usage: bool = False

    @staticmethod
    def from_body(body: dict[str, Any]) -> StreamFormat:
        """Read `stream_options` of a request body."""
        options = body.get("stream_options")
        if not isinstance(options, dict):
            return StreamFormat()
        include = bool(options.get("include_usage"))
        return StreamFormat(include, include and bool(options.get("continuous_usage_stats")))


def role_chunk(meta: ResponseMeta, fmt: StreamFormat, index: int = 0, prompt_tokens: int = 0,
               cached_tokens: int = 0) -> dict[str, Any]:
    """First chat chunk: `delta: {"role": "assistant", "content": ""}`."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return _with_usage(meta._envelope(meta.chunk_object, [choice]), fmt, prompt_tokens, 0, cached_tokens)


def token_chunk(meta: ResponseMeta, fmt: StreamFormat, text: str, *, index: int = 0,
                finish_reason: str | None = None, prompt_tokens: int = 0,
                completion_tokens: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
    """A chunk carrying one token (`delta.content` for chat, `text` for completions); the chunk that
    finishes carries the engine's `system_fingerprint` unless a usage chunk follows."""
    choice: dict[str, Any] = {"index": index}
    if meta.kind == "chat":
        choice["delta"] = {"content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = None
    else:
        choice.update(text=text, logprobs=None, finish_reason=finish_reason, stop_reason=None)
    payload = meta._envelope(meta.chunk_object, [choice])
    if finish_reason is not None and not fmt.include_usage and meta.shape.fingerprint is not None:
        payload["system_fingerprint"] = meta.shape.fingerprint
    return _with_usage(payload, fmt, prompt_tokens, completion_tokens, cached_tokens)


def usage_chunk(meta: ResponseMeta, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0, created_cache_tokens: int = 0) -> dict[str, Any]:
    """The final usage chunk of a stream with `include_usage`: `"choices": []`, the engine's
    `system_fingerprint` (when it has one)."""
    payload = meta._envelope(meta.chunk_object, [])
    payload["usage"] = meta.chat_usage(prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens)
    if meta.shape.fingerprint is not None:
        payload["system_fingerprint"] = meta.shape.fingerprint
    return payload


def _with_usage(payload: dict[str, Any], fmt: StreamFormat, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    if fmt.continuous_usage:
        payload["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    elif fmt.include_usage:
        payload["usage"] = None
    return payload


def chat_completion(meta: ResponseMeta, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0, created_cache_tokens: int = 0) -> dict[str, Any]:
    """A non-streaming `chat.completion` object (`AnswerShape` for the engine's variations)."""
    shape = meta.shape
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None}
    if not shape.drop_empty_tool_calls:
        message["tool_calls"] = []
    message[shape.reasoning_field] = None
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": None}
    payload = meta._envelope("chat.completion", [choice])
    payload.update(service_tier=None, system_fingerprint=shape.fingerprint,
                   usage=meta.chat_usage(prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens),
                   prompt_logprobs=None, kv_transfer_params=None)
    return payload


def text_completion(meta: ResponseMeta, texts: list[str], finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A non-streaming `text_completion` object, one choice per prompt."""
    choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": None, "prompt_logprobs": None} for i, text in enumerate(texts)]
    payload = meta._envelope("text_completion", choices)
    payload.update(service_tier=None, system_fingerprint=meta.shape.fingerprint,
                   usage=usage(prompt_tokens, completion_tokens, cached_tokens), kv_transfer_params=None)
    return payload


def models_list(names: list[str], max_model_len: int, owned_by: str, created: int,
                adapters: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`GET /v1/models`: OpenAI's list shape with the engines' extra fields, in their `ModelCard`
    order: `root`, `parent` (null for a base model) and the context window in tokens as
    `max_model_len`; vLLM adds `permission` (one `ModelPermission`). Then one entry per LoRA adapter
    (`adapters`: name -> path) as both engines list a loaded one: `id` its name, `root` its path,
    `parent` the first served name, `max_model_len` null (vLLM: vllm/entrypoints/openai/serving_models.py
    `show_available_models`, vllm/entrypoints/openai/protocol.py `ModelCard`; SGLang:
    python/sglang/srt/entrypoints/http_server.py `available_models`, from its `lora_registry`, and
    python/sglang/srt/entrypoints/openai/protocol.py `ModelCard`, whose `parent` came with the
    adapter listing)."""
    vllm = owned_by != "sglang"

    def card(name: str, root: str, parent: str | None, length: int | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": owned_by,
                                 "root": root, "parent": parent, "max_model_len": length}
        if vllm:
            entry["permission"] = [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}]
        return entry

    data = [card(name, names[0], None, max_model_len) for name in names]
    data += [card(name, path, names[0], None) for name, path in (adapters or {}).items()]
    return {"object": "list", "data": data}
