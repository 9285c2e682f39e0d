"""OpenAI-compatible payloads in vLLM's shapes (chat and text completions, SSE events, models).

Field sets follow vLLM's protocol models as serialised with `exclude_unset`: stream choices carry
`logprobs: null` and `finish_reason`; the choice that finishes also carries `stop_reason: null`;
with `stream_options.include_usage` every chunk has `"usage": null` and a last chunk with
`"choices": []` carries the usage. Payloads are serialised compactly (orjson: UTF-8, no spaces),
as pydantic's `model_dump_json` does.
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The usage object (vLLM with prompt-token details enabled): `cached_tokens` of the prompt
    tokens came from the prefix cache (0 without a simulated cache)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ResponseMeta:
    """Identity shared by every payload of one response."""

    kind: Kind
    id: str
    created: int
    model: str

    @staticmethod
    def new(kind: Kind, model: str) -> ResponseMeta:
        """Fresh id (`chatcmpl-…` / `cmpl-…`) and creation time (Unix seconds)."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return ResponseMeta(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

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
    """A chunk carrying one token (`delta.content` for chat, `text` for completions)."""
    choice: dict[str, Any] = {"index": index}
    if meta.kind == "chat":
        choice["delta"] = {"content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = None
    else:
        choice.update(text=text, logprobs=None, finish_reason=finish_reason, stop_reason=None)
    return _with_usage(meta._envelope(meta.chunk_object, [choice]), fmt, prompt_tokens, completion_tokens,
                       cached_tokens)


def usage_chunk(meta: ResponseMeta, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict[str, Any]:
    """The final usage chunk of a stream with `include_usage`: `"choices": []`."""
    payload = meta._envelope(meta.chunk_object, [])
    payload["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return payload


def _with_usage(payload: dict[str, Any], fmt: StreamFormat, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    if fmt.continuous_usage:
        payload["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    elif fmt.include_usage:
        payload["usage"] = None
    return payload


def chat_completion(meta: ResponseMeta, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A non-streaming `chat.completion` object."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": None}
    payload = meta._envelope("chat.completion", [choice])
    payload.update(service_tier=None, system_fingerprint=None,
                   usage=usage(prompt_tokens, completion_tokens, cached_tokens), prompt_logprobs=None,
                   kv_transfer_params=None)
    return payload


def text_completion(meta: ResponseMeta, texts: list[str], finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A non-streaming `text_completion` object, one choice per prompt."""
    choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": None, "prompt_logprobs": None} for i, text in enumerate(texts)]
    payload = meta._envelope("text_completion", choices)
    payload.update(service_tier=None, system_fingerprint=None,
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
