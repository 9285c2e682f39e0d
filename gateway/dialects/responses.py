"""OpenAI's Responses API (`POST /v1/responses`): typed events, stored responses, `previous_response_id`.

Counted like chat (`chat.chat_features`): `instructions` a system message, the input items
messages. Its stream always carries usage (the final event's `response.usage`) and ends with one of
`response.completed`, `response.incomplete`, `response.failed` (no `data: [DONE]`); errors are OpenAI's
error object, mid-stream an `event: error` the openai SDK raises on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.affinity.hashing import PrefixHasher, canonical_message, canonical_prelude, image_digest
from gateway.dialects.base import Dialect, SizeChecker, server_error
from gateway.dialects.chat import chat_counts
from gateway.dialects.names import RESPONSES, Api
from gateway.errors import InvalidRequest
from gateway.protocol.responses import TERMINAL_EVENTS, ResponsesRequest, chat_usage, item_text_and_images
from gateway.routing.engine_prompt import prompt_text_tokens
from gateway.routing.features import (
    METHOD_ORDER,
    RoutingRequest,
    cache_partition,
    forced_output,
    session_hint,
)
from gateway.routing.tokens import TokenEstimator


class ResponsesDialect(Dialect[ResponsesRequest]):
    """OpenAI's Responses API."""

    api: Api = RESPONSES
    wire_model = ResponsesRequest
    path = "/v1/responses"
    output_limit_field = "max_output_tokens"
    prompt_param = "input"
    # The last event of a stream (https://platform.openai.com/docs/api-reference/responses-streaming).
    stream_end_events = tuple(sorted(name.encode() for name in TERMINAL_EVENTS))
    json_error_type = True  # the openai SDK reads the data's `type`, not the `event:` line
    stores_responses = True

    def image_urls(self, wire: ResponsesRequest) -> list[str]:
        """`response_image_urls(wire)`."""
        return response_image_urls(wire)

    def features(self, wire: ResponsesRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`responses_features`."""
        return responses_features(wire, model, estimator, hasher, session_key, measured)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """The count limits of a Responses body: its input items count as messages, their content
        parts as parts; the floor counts the text of `instructions`, string inputs and text parts."""
        config = checker.config
        value = payload.get("input")
        output = payload.get("max_output_tokens")
        instructions = payload.get("instructions")
        chars = len(instructions) if isinstance(instructions, str) else 0
        if isinstance(value, str):
            checker.check_floor(payload, "input", chars + len(value), 0, 0, output, None)
            return 1
        if not isinstance(value, list):
            return 0
        if len(value) > config.max_messages:
            raise InvalidRequest(f"Too many input items: {len(value)}; the limit is {config.max_messages}.",
                                 param="input", code="too_many_messages")
        text, images, parts = chat_counts(value, "input_text", "input_image")
        if parts > config.max_content_parts:
            raise InvalidRequest(f"Too many content parts: {parts}; the limit is {config.max_content_parts}.",
                                 param="input", code="too_many_content_parts")
        checker.check_floor(payload, "input", chars + text, images, 0, output, None)
        return len(value) + parts

    def answer_usage(self, usage: dict[str, Any], cache_in_input: bool) -> dict[str, Any]:
        """Its input_tokens include the cached ones: the chat names added (`chat_usage`)."""
        return chat_usage(usage)

    def stream_error(self, message: str, code: str = "upstream_error") -> bytes:
        """An `event: error` whose data is OpenAI's error event (`type` "error", `code`, `message`,
        `param`; https://platform.openai.com/docs/api-reference/responses-streaming/error) plus the
        OpenAI error object under `error`, which the openai SDK raises on. No `sequence_number`: the
        gateway does not number the engine's events."""
        typed = {"type": "error", "code": code, "message": message, "param": None,
                 "error": server_error(message, code)}
        return b"event: error\ndata: " + orjson.dumps(typed) + b"\n\n"


def responses_features(wire: ResponsesRequest, model: str, estimator: TokenEstimator,
                       hasher: PrefixHasher | None = None, session_key: str | None = None,
                       measured: Mapping[str, tuple[int, int]] | None = None) -> RoutingRequest:
    """Features of a Responses API request, counted like chat (`chat_features`): `instructions` is
    a system message, a string `input` one user message, each input item a message (its text
    parts, its images at their pixel or default cost, a function call's name and arguments, a
    function call's output, other items as their JSON); the tools' JSON too; `max_output_tokens`
    is the output reservation. The prefix hashes run over the same canonical bytes as chat's, so
    a conversation sent through both APIs meets the same cache entries.

    The text an engine's chat template renders from other fields counts too
    (`gateway/routing/engine_prompt.py`). With `previous_response_id` the stored conversation the
    engine prefills first is not in these features: the gateway adds it once the response store
    named its worker (`ProxyService.handle`, `response_affinity.follow_up_of`). Raises
    InvalidRequest for an image data URI that cannot be read.
    """
    config = estimator.config
    # role, texts, image URLs, uncountable images, where it is in the request (for an error's `param`)
    items: list[tuple[str, list[bytes], list[str], int, str]] = []
    if wire.instructions:
        items.append(("system", [wire.instructions.encode("utf-8", "surrogatepass")], [], 0, "instructions"))
    if isinstance(wire.input, str):
        items.append(("user", [wire.input.encode("utf-8", "surrogatepass")], [], 0, "input"))
    else:
        for i, item in enumerate(wire.input):
            role = item.get("role")
            texts, urls, others = item_text_and_images(item)
            items.append((role if isinstance(role, str) else str(item.get("type", "item")), texts, urls, others,
                          f"input[{i}].content"))
    try:
        prelude = canonical_prelude(wire.tools)
    except TypeError as exc:
        raise InvalidRequest(f"'tools' cannot be read: {exc}", code="invalid_json") from None
    canonical = [prelude] if prelude else []  # as in `chat_features`
    texts_all = list(canonical)
    tokens = config.tokens_per_request + config.tokens_per_message * len(items)
    modalities = {"text"}
    methods = {"bytes"}
    images: dict[str, tuple[int, str, bytes]] = {}
    for role, texts, urls, others, where in items:
        parts = list(texts)
        texts_all.extend(texts)
        for url in urls:
            modalities.add("image")
            if (seen := images.get(url)) is None:
                estimate = estimator.image_tokens(url, where, measured)
                seen = images[url] = (estimate.tokens, estimate.method, image_digest(url))
            tokens += seen[0]
            methods.add(seen[1])
            parts.append(seen[2])
        if others:
            modalities.add("image")
            tokens += others * config.image_tokens_default
            methods.add("default")
        canonical.append(canonical_message(role, parts))
    tokens += estimator.utf8_tokens(b"".join(texts_all)) + prompt_text_tokens(RESPONSES, wire.model_extra, estimator)
    method = "+".join(sorted(methods, key=METHOD_ORDER.index))
    prefix = hasher.hash(b"".join(canonical), model, cache_partition(wire.model_extra)) if hasher is not None else None
    return RoutingRequest(
        api=RESPONSES, model=model, prompt_tokens=tokens, output_tokens=wire.max_output_tokens,
        stream=bool(wire.stream), modalities=frozenset(modalities), estimate_method=method,
        session_key=session_hint(session_key, (wire.model_extra or {}).get("prompt_cache_key"), wire.user),
        include_usage=True, prefix=prefix, previous_response_id=wire.previous_response_id,
        store=wire.store is not False, min_output_tokens=forced_output(wire.model_extra),
    )


def response_image_urls(wire: ResponsesRequest) -> list[str]:
    """The `input_image` URLs of a Responses request that are not `data:` URIs, in order, each once."""
    urls: dict[str, None] = {}
    if isinstance(wire.input, list):
        for item in wire.input:
            for url in item_text_and_images(item)[1]:
                if not url.startswith("data:"):
                    urls[url] = None
    return list(urls)
