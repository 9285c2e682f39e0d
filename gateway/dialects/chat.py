"""OpenAI's chat completions (`POST /v1/chat/completions`): the dialect every other chat-shaped API
builds on (Anthropic's Messages are routed as their chat twin, `messages.py`).

Features: text and image tokens, the chat template's overhead, modalities, the prefix hashes of
the canonical prompt. A stream ends with `data: [DONE]`; errors are OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.affinity.hashing import PrefixHasher, canonical_message, canonical_prelude, image_digest
from gateway.dialects.base import Dialect, SizeChecker
from gateway.dialects.names import CHAT
from gateway.errors import InvalidRequest
from gateway.protocol.openai import (
    PART_MODALITY,
    AudioURLPart,
    ChatCompletionRequest,
    ImagePart,
    InputAudioPart,
    RefusalPart,
    TextPart,
    VideoPart,
)
from gateway.routing.engine_prompt import prompt_ids, prompt_text_tokens
from gateway.routing.features import (
    METHOD_ORDER,
    RoutingRequest,
    cache_partition,
    completions_per_prompt,
    engine_output_limit,
    forced_output,
    output_limit,
    session_hint,
)
from gateway.routing.tokens import ImageEstimate, TokenEstimator


class ChatDialect(Dialect[ChatCompletionRequest]):
    """OpenAI's chat completions API."""

    api = CHAT
    wire_model = ChatCompletionRequest
    path = "/v1/chat/completions"
    output_limit_field = "max_completion_tokens"
    migrates = True

    def image_urls(self, wire: ChatCompletionRequest) -> list[str]:
        """`image_urls(wire)`."""
        return image_urls(wire)

    def features(self, wire: ChatCompletionRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`chat_features`."""
        return chat_features(wire, model, estimator, hasher, session_key, measured)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """`check_chat_size`."""
        return check_chat_size(checker, payload)


def check_chat_size(checker: SizeChecker, payload: dict[str, Any]) -> int:
    """The count limits of a chat-shaped body (chat, and Anthropic's messages: its `system` is not
    counted, a lower bound): messages and content parts, then the lower bound of its tokens with the
    chat template's. Returns messages + parts. Raises InvalidRequest, ContextLengthExceeded."""
    config = checker.config
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return 0
    if len(messages) > config.max_messages:
        raise InvalidRequest(f"Too many messages: {len(messages)}; the limit is {config.max_messages}.",
                             param="messages", code="too_many_messages")
    chars, images, parts = chat_counts(messages)
    if parts > config.max_content_parts:
        raise InvalidRequest(f"Too many content parts: {parts}; the limit is {config.max_content_parts}.",
                             param="messages", code="too_many_content_parts")
    checker.check_floor(payload, "messages", chars, images, 0, chat_output(payload), len(messages))
    return len(messages) + parts


def chat_output(payload: dict[str, Any]) -> object:
    """A decoded chat or completions body's output limit as sent: `max_completion_tokens` first, as
    `output_limit` reads it, else `max_tokens`."""
    output = payload.get("max_completion_tokens")
    return payload.get("max_tokens") if output is None else output


def chat_counts(messages: list[Any], text_type: str = "text", image_type: str = "image_url") -> tuple[int, int, int]:
    """(text characters, image parts, content parts) of a chat body's messages, from the decoded
    JSON before validation (anything not shaped as expected counts nothing: validation refuses it)."""
    chars = images = parts = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            parts += len(content)
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == text_type:
                    text = part.get("text")
                    chars += len(text) if isinstance(text, str) else 0
                elif kind == image_type:
                    images += 1
    return chars, images, parts


def image_urls(wire: ChatCompletionRequest) -> list[str]:
    """The image URLs of a chat request that are not `data:` URIs, in order, each once."""
    urls: dict[str, None] = {}
    for message in wire.messages:
        if isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, ImagePart) and not part.image_url.url.startswith("data:"):
                    urls[part.image_url.url] = None
    return list(urls)


def chat_features(wire: ChatCompletionRequest, model: str, estimator: TokenEstimator,
                  hasher: PrefixHasher | None = None, session_key: str | None = None,
                  measured: Mapping[str, tuple[int, int]] | None = None) -> RoutingRequest:
    """Features of a chat request: text and image tokens, template overhead, modalities, and the
    prefix hashes of its canonical bytes when a hasher is given.

    `measured` maps image URLs to their (width, height) in pixels, as the opt-in image fetch
    found them (`gateway/routing/image_fetch.py`); other URLs cost the configured default.
    The prompt an engine reads from other fields counts too (`gateway/routing/engine_prompt.py`):
    the text its chat template renders from them, and token ids it prefills instead of the
    rendered messages (the larger of the two counts; method `token_ids` when the ids are).
    Raises InvalidRequest for an image data URI that cannot be read.
    """
    config = estimator.config
    texts: list[bytes] = []  # prompt text only (separators and image digests are not tokens), counted in one pass
    tokens = config.tokens_per_request + config.tokens_per_message * len(wire.messages)
    modalities = {"text"}
    methods = {"bytes"}
    extra = wire.model_extra or {}
    images: dict[str, tuple[int, str, bytes]] = {}  # URL -> tokens, method, digest: each image measured once
    try:
        prelude = canonical_prelude(extra.get("tools") or extra.get("functions"))
        calls_json = [orjson.dumps(m.model_extra["tool_calls"]) if m.model_extra and "tool_calls" in m.model_extra
                      else None for m in wire.messages]
    except TypeError as exc:  # orjson writes at most 254 levels of nesting
        raise InvalidRequest(f"'tools' or 'tool_calls' cannot be read: {exc}", code="invalid_json") from None
    # No empty prelude in the lists: `b"".join` of one item returns it, so a one-message prompt is not copied.
    canonical = [prelude] if prelude else []
    texts.extend(canonical)
    for i, message in enumerate(wire.messages):
        content = message.content
        parts: list[bytes] = []
        if isinstance(content, str):
            parts.append(content.encode("utf-8", "surrogatepass"))
            texts.append(parts[-1])
        elif content is not None:
            for j, part in enumerate(content):
                if (modality := PART_MODALITY.get(part.type)) is not None:
                    modalities.add(modality)
                if isinstance(part, TextPart | RefusalPart):
                    text = part.text if isinstance(part, TextPart) else part.refusal
                    encoded = text.encode("utf-8", "surrogatepass")
                    parts.append(encoded)
                    texts.append(encoded)
                elif isinstance(part, ImagePart):
                    url = part.image_url.url
                    if (seen := images.get(url)) is None:
                        estimate = estimator.image_tokens(url, f"messages[{i}].content[{j}].image_url.url", measured)
                        seen = images[url] = (estimate.tokens, estimate.method, image_digest(url))
                    tokens += seen[0]
                    methods.add(seen[1])
                    parts.append(seen[2])
                elif (media := _media_estimate(part, estimator)) is not None:
                    tokens += media.tokens
                    methods.add(media.method)
        # Tool calls are rendered into the prompt by the chat template too.
        if (calls := calls_json[i]) is not None:
            parts.append(calls)
            texts.append(calls)
        canonical.append(canonical_message(message.role, parts))
    if "response_format" in extra:
        texts.append(orjson.dumps(extra["response_format"]))
    tokens += estimator.utf8_tokens(b"".join(texts)) + prompt_text_tokens(CHAT, extra, estimator)
    method = "+".join(sorted(methods, key=METHOD_ORDER.index))
    if (ids := prompt_ids(CHAT, extra)) > tokens:  # the engine prefills these instead of the rendered messages
        tokens, method = ids, "token_ids"
    output = output_limit(wire)
    prefix = hasher.hash(b"".join(canonical), model, cache_partition(extra)) if hasher is not None else None
    return RoutingRequest(
        api=CHAT, model=model, prompt_tokens=tokens, output_tokens=output, stream=bool(wire.stream),
        modalities=frozenset(modalities), estimate_method=method,
        session_key=session_hint(session_key, extra.get("prompt_cache_key"), wire.user),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        prefix=prefix, outputs=completions_per_prompt(wire.n, extra), min_output_tokens=forced_output(extra),
        engine_output_tokens=engine_output_limit(extra),
    )


def _media_estimate(part: object, estimator: TokenEstimator) -> ImageEstimate | None:
    """Tokens of an audio or video part (`input_audio`, `audio_url`, `video_url`); None for others.
    A part whose fields are not the expected strings costs the configured default: the engine judges it."""
    if isinstance(part, InputAudioPart):
        data = part.input_audio.get("data")
        return estimator.audio_tokens(data, is_base64=True) if isinstance(data, str) else \
            ImageEstimate(estimator.config.audio_tokens_default, "audio_default")
    if isinstance(part, AudioURLPart):
        url = part.audio_url.get("url")
        return estimator.audio_tokens(url if isinstance(url, str) else "")
    if isinstance(part, VideoPart):
        return ImageEstimate(estimator.config.video_tokens_default, "video")
    return None
