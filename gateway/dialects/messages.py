"""Anthropic's Messages API (`POST /v1/messages`) and its token counter (`POST /v1/messages/count_tokens`).

A request is validated as Anthropic's, then routed as the chat request it stands for
(`protocol.anthropic.to_chat`, `messages_features`). Its stream always carries usage (`message_start`,
`message_delta`) and ends with `message_stop`. Every error is Anthropic's error object
`{"type": "error", "error": {"type", "message"}, "request_id"}` with Anthropic's type for the status
(https://docs.claude.com/en/api/errors), rendered directly from the gateway's error or the engine's
answer; a 503 (no worker can take the request now) goes out as Anthropic's 529 `overloaded_error`,
which the Anthropic SDKs and coding agents treat as "busy, retry" (its `Retry-After` stays).
Mid-stream errors are Anthropic `event: error` events. Each answer also carries Anthropic's
`request-id` header (the gateway's request id), which the SDKs expose as `_request_id`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway.affinity.hashing import PrefixHasher
from gateway.auth.guard import MISSING_KEY
from gateway.dialects.base import Dialect, SizeChecker
from gateway.dialects.chat import chat_features, check_chat_size, image_urls
from gateway.dialects.names import COUNT_TOKENS, MESSAGES, Api
from gateway.errors import GatewayError, upstream_error_object
from gateway.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    attribution_text,
    error_body,
    portable_blocks,
    sse_error,
    to_chat,
)
from gateway.protocol.openai import ChatCompletionRequest
from gateway.routing.features import CACHE_PARTITION_FIELDS, RoutingRequest
from gateway.routing.tokens import TokenEstimator

OVERLOADED_STATUS = 529
"""Anthropic's status for "busy, retry": what the gateway's 503 goes out as on these endpoints."""

MISSING_ANTHROPIC_KEY = ("You didn't provide an API key. Send it in an x-api-key header "
                         "(or as Authorization: Bearer YOUR_KEY).")
"""The missing-key message on these endpoints (OpenAI's wording names only its own header)."""

STREAM_ERROR_STATUS = {"request_timeout": 504, "shutting_down": OVERLOADED_STATUS}
"""The Anthropic status of a gateway stream error's code: a 504 `timeout_error`, a 529
`overloaded_error` (retry elsewhere); any other code is a 500 `api_error`."""


@dataclass(frozen=True, slots=True)
class AnthropicWire:
    """A validated Anthropic request (`messages` or `count_tokens`) as the chat request it stands
    for (`gateway.protocol.anthropic.to_chat`): routing reads `chat`."""

    api: Api
    chat: ChatCompletionRequest
    attribution: str = ""
    """Claude Code's attribution lines (`protocol.anthropic.attribution_text`): out of `chat`, as
    vLLM's prompt leaves them out, so they are not hashed; counted, as SGLang and llama.cpp prefill them."""


def messages_features(wire: AnthropicWire, model: str, estimator: TokenEstimator,
                      hasher: PrefixHasher | None = None, session_key: str | None = None,
                      measured: Mapping[str, tuple[int, int]] | None = None) -> RoutingRequest:
    """Features of an Anthropic Messages request: exactly those of the equivalent chat request
    (`chat_features` of `wire.chat`: the same token estimate, images, template overhead and prefix
    hashes, so a conversation moving between the two APIs keeps its prefix blocks), with its own
    `api`, and Claude Code's attribution lines (`AnthropicWire.attribution`) added to the estimate
    but not to the hashes. `max_tokens` is the output reservation; the stream always carries usage (Anthropic's
    `message_start` / `message_delta`), so no usage patch. A count_tokens request generates
    nothing and is charged no tokens: output 0, quota 0 (Anthropic rate-limits it by requests).
    Raises InvalidRequest as `chat_features`."""
    request = chat_features(wire.chat, model, estimator, hasher, session_key, measured)
    if wire.attribution:
        request = replace(request, prompt_tokens=request.prompt_tokens + estimator.text_tokens(wire.attribution))
    if wire.api == COUNT_TOKENS:
        return replace(request, api=COUNT_TOKENS, output_tokens=0, stream=False, include_usage=True,
                       batch_prompt_tokens=0)
    return replace(request, api=wire.api, include_usage=True)


class MessagesDialect(Dialect[AnthropicWire]):
    """Anthropic's Messages API."""

    api: Api = MESSAGES
    path = "/v1/messages"
    output_limit_field = "max_tokens"
    # The last event of a stream (https://docs.claude.com/en/docs/build-with-claude/streaming).
    stream_end_events = (b"message_stop",)
    request_id_header = b"request-id"
    rate_limit_headers = "anthropic"
    wire_model = MessagesRequest
    migrates = True  # continued on the engine's chat API (dispatch/migration.py)
    # Anthropic's own heartbeat event, which its SDKs skip (`anthropic/_streaming.py`: `if sse.event == "ping"`).
    heartbeat = b'event: ping\ndata: {"type": "ping"}\n\n'

    def validate(self, payload: dict[str, Any]) -> AnthropicWire:
        """The Anthropic wire model, as its chat twin (search results and text documents made text
        first, for every engine: `portable_blocks`), with the body's cache partition fields
        (`CACHE_PARTITION_FIELDS`: vLLM's Messages layer reads `cache_salt`, 0.32.0
        `vllm/entrypoints/anthropic/protocol.py` and `serving.py`), so its prefix hashes are
        partitioned as the chat request's. Raises ValidationError."""
        portable_blocks(payload)
        anthropic = self.wire_model.model_validate(payload)
        chat = to_chat(anthropic)
        extra = anthropic.model_extra or {}
        chat.update((name, extra[name]) for name in CACHE_PARTITION_FIELDS if name in extra)
        return AnthropicWire(self.api, ChatCompletionRequest.model_validate(chat), attribution_text(anthropic))

    def model_of(self, wire: AnthropicWire) -> str:
        """The chat twin's `model`."""
        return wire.chat.model

    def image_urls(self, wire: AnthropicWire) -> list[str]:
        """The chat twin's image URLs (`chat.image_urls`)."""
        return image_urls(wire.chat)

    def features(self, wire: AnthropicWire, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`messages_features`."""
        return messages_features(wire, model, estimator, hasher, session_key, measured)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """As chat's (`chat.check_chat_size`; its `system` is not counted: a lower bound)."""
        return check_chat_size(checker, payload)

    def answer_status(self, status: int) -> int:
        """503 → 529 `overloaded_error` (module docstring)."""
        return OVERLOADED_STATUS if status == 503 else status

    def error_bytes(self, error: GatewayError, request_id: str | None) -> bytes:
        """Anthropic's error object for the gateway's error (the missing-key message names its header)."""
        return self._error(error.status, error.message, request_id)

    def engine_error_bytes(self, status: int, body: bytes, code: str | None, param: str | None,
                           request_id: str | None) -> bytes:
        """Anthropic's error object with the engine's message (`errors.upstream_error_object`: its
        text when it is no error object)."""
        return self._error(status, upstream_error_object(status, body, code, param)["message"], request_id)

    def _error(self, status: int, message: object, request_id: str | None) -> bytes:
        text = message if isinstance(message, str) else str(message)
        if text == MISSING_KEY:
            text = MISSING_ANTHROPIC_KEY
        return error_body(self.answer_status(status), text, request_id)

    def stream_error(self, message: str, code: str = "upstream_error") -> bytes:
        """An Anthropic `event: error` (`STREAM_ERROR_STATUS` picks its type)."""
        return sse_error(message, STREAM_ERROR_STATUS.get(code, 500))


class CountTokensDialect(MessagesDialect):
    """Anthropic's token counter: a Messages body that generates nothing (no stream, no output,
    charged no tokens; rate-limited by its own request limit)."""

    api: Api = COUNT_TOKENS
    path = "/v1/messages/count_tokens"
    output_limit_field = None
    stream_end_events = ()
    generates = False
    migrates = False
    wire_model = CountTokensRequest
