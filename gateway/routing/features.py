"""Build the frozen `RoutingRequest` a request is routed by (design §2 step 2)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson
import xxhash

from gateway.affinity.hashing import PrefixHasher, PrefixKey, canonical_message, canonical_prelude, image_digest
from gateway.errors import InvalidRequest
from gateway.protocol.openai import (
    PART_MODALITY,
    AudioURLPart,
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    InputAudioPart,
    RefusalPart,
    TextPart,
    VideoPart,
)
from gateway.protocol.responses import ResponsesRequest, item_text_and_images
from gateway.routing.tokens import ImageEstimate, TokenEstimator

Api = Literal["chat", "completions", "messages", "count_tokens", "responses"]
"""The proxied APIs: OpenAI chat and completions, Anthropic Messages and its count_tokens, OpenAI Responses."""

ANTHROPIC_APIS: frozenset[str] = frozenset({"messages", "count_tokens"})


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What routing needs to know about one request.

    `prompt_tokens` is an estimate (tokens); `output_tokens` is what the client asked for
    (`max_completion_tokens`, else `max_tokens`), None when it set neither, in which case each pool's
    `default_output_tokens` is reserved. `estimate_method` says how the prompt was counted:
    `bytes` (text by script, `tokens.py`), plus `pixels`/`default` for images, `audio` (header
    duration), `audio_size`, `audio_default` and `video` (configured cost), joined by `+`; or `token_ids`.
    `prefix` holds the sampled block hashes of the canonical prompt (None when affinity is off).
    `outputs` is how many completions the engine generates (`n` times the prompts of a completions
    batch) and `batch_prompt_tokens` the prompt tokens of all prompts together: they size the
    request's quota charge, not its context. `min_output_tokens` is what the client forces the
    engine to generate at least (vLLM's and SGLang's `min_tokens` sampling parameter, 0 when unset):
    with no output limit the reservation is at least that (`reserved_output`). `engine_output_tokens`
    is llama.cpp's own output limit `n_predict` when the client set a positive one (0 otherwise),
    which that server ranks over `max_tokens` (`engine_output_limit`): the reservation covers it too.
    `session_key` is the request's session hint (`session_hint`), and after `ProxyService.handle`
    scoped to the caller's API key (`scoped_session`): the `session` policy's key and, with
    affinity on, the key of the worker that served the session last (`session_hash`).
    """

    api: Api
    model: str
    prompt_tokens: int
    output_tokens: int | None
    stream: bool
    modalities: frozenset[str]
    estimate_method: str
    session_key: str | None = None
    include_usage: bool = False
    prefix: PrefixKey | None = None
    outputs: int = 1
    batch_prompt_tokens: int | None = None
    previous_response_id: str | None = None
    """Responses API: the stored response this one continues; its worker must serve it."""
    store: bool = False
    """Responses API: the engine stores the response (the gateway records its worker)."""
    min_output_tokens: int = 0
    engine_output_tokens: int = 0
    adapter: str | None = None
    """The LoRA adapter the request names (then also its `model`, which seeds the prefix hashes:
    an adapter's KV cache is not the base model's), None for the model itself."""

    def context_tokens(self, default_output_tokens: int) -> int:
        """Tokens of context one sequence needs on a pool that reserves `default_output_tokens` by default."""
        out = self.output_tokens if self.output_tokens is not None else default_output_tokens
        return self.prompt_tokens + out

    def reserved_output(self, default_output_tokens: int) -> int:
        """The output tokens reserved for each completion (tokens): the client's output limit, else
        the pool's `default_output_tokens` or the client's `min_tokens`, whichever is larger; at
        least llama.cpp's `n_predict` when the client set one (`engine_output_tokens`). For a key
        with a token limit the gateway sends the engine exactly this limit (`ProxyService.handle`)."""
        base = self.output_tokens if self.output_tokens is not None else max(default_output_tokens,
                                                                              self.min_output_tokens)
        return max(base, self.engine_output_tokens)

    def quota_tokens(self, default_output_tokens: int) -> int:
        """Tokens charged to a per-key token limit: every prompt plus the output limit of every
        completion (as OpenAI's TPM counts a request: prompt + max_tokens * n; `reserved_output`)."""
        out = self.reserved_output(default_output_tokens)
        prompts = self.batch_prompt_tokens if self.batch_prompt_tokens is not None else self.prompt_tokens
        return prompts + out * self.outputs


SESSION_HEADERS = ("x-session-id", "session_id", "session-id")
"""The request headers that carry a session hint, in precedence order: the gateway's own, then the
one Codex CLI sends on every turn (its conversation id; codex-rs/codex-api/src/requests/headers.rs
`build_conversation_headers`) and its hyphenated spelling (proxies that drop `_` in names)."""

SESSION_HINT_MAX = 512
"""Characters; a longer session hint is no session key (the next one in precedence is used)."""


def session_hint(*hints: object) -> str | None:
    """The request's session key before scoping (`scoped_session`): the first of `hints` that is a
    non-empty string of at most `SESSION_HINT_MAX` characters, else None. Callers pass them in
    precedence order: the session headers (`X-Session-ID`, then Codex's `session_id` / `session-id`),
    the body's `prompt_cache_key` (OpenAI's cache-routing key, chat, completions and Responses),
    then `user` (on /v1/messages, Anthropic's `metadata.user_id`, which Claude Code sets per session).
    A body field of another type is ignored here (the engine judges it)."""
    for hint in hints:
        if isinstance(hint, str) and 0 < len(hint) <= SESSION_HINT_MAX:
            return hint
    return None


def scoped_session(hint: str, tenant: str | None, adapter: str | None = None) -> str:
    """The session key routing uses: 32 hex digits of xxh3_128 over the caller's key name (`tenant`,
    None with auth off), the hint and the LoRA adapter the request names (if any), so two API keys
    sending the same hint share no affinity, nor do a base model's and an adapter's requests, and
    the key's size is fixed whatever the client sent."""
    scope = f"{tenant or ''}\x00{hint}" if adapter is None else f"{tenant or ''}\x00{hint}\x00{adapter}"
    return xxhash.xxh3_128_hexdigest(scope.encode("utf-8", "surrogatepass"))


def output_limit(wire: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The output tokens a request asks for: `max_completion_tokens`, which OpenAI ranks over the
    deprecated `max_tokens`, else `max_tokens`; None when it sets neither."""
    return wire.max_completion_tokens if wire.max_completion_tokens is not None else wire.max_tokens


def forced_output(extra: Mapping[str, Any] | None) -> int:
    """The output tokens a request forces the engine to generate at least: `min_tokens` (vLLM's
    `SamplingParams.min_tokens`, read from the chat, completions and Responses bodies by
    `vllm/entrypoints/openai/*/protocol.py`; SGLang's `ChatCompletionRequest.min_tokens`, its
    `min_new_tokens`), 0 when unset or not a non-negative integer (the engine refuses those).
    `ignore_eos` needs nothing here: it makes the engine run to its output limit, which the
    reservation already is."""
    value = (extra or {}).get("min_tokens")
    if type(value) is float and value.is_integer():
        value = int(value)
    return value if type(value) is int and value > 0 else 0


ENGINE_OUTPUT_FIELD = "n_predict"
"""llama.cpp's own output limit: its server copies a body's `n_predict` over the one it derives from
`max_tokens` (`oaicompat_chat_params_parse` and `oaicompat_completion_params_parse` in
`tools/server/server-common.cpp`: "if n_predict is present, we overwrite the value specified earlier
by max_tokens"; `params_from_json_cmpl` in `server-task.cpp` reads `n_predict` before `max_tokens`),
and -1 means no limit. vLLM and SGLang ignore the field."""


def engine_output_limit(extra: Mapping[str, Any] | None) -> int:
    """The client's positive `n_predict` (tokens; `ENGINE_OUTPUT_FIELD`; a float as llama.cpp's JSON
    library reads it into an int, truncated), 0 when unset, not a number or not positive (-1 is
    llama.cpp's "no limit": nothing to reserve, the gateway overwrites it for a token-limited key,
    `parsing.with_engine_output_limit`)."""
    value = (extra or {}).get(ENGINE_OUTPUT_FIELD)
    if type(value) is float and math.isfinite(value):
        value = int(value)
    return value if type(value) is int and value > 0 else 0


def completions_per_prompt(n: int | None, extra: Mapping[str, Any] | None) -> int:
    """Sequences the engine may generate per prompt: `n`, or `best_of` when larger (vLLM's V0
    engine generated `best_of` candidates and returned the best `n`, all of them generated tokens;
    SGLang's `CompletionRequest` in `srt/entrypoints/openai/protocol.py` still accepts the field),
    or llama.cpp's `n_cmpl` when larger (its server reads it before `n`: `params_from_json_cmpl` in
    `tools/server/server-task.cpp`), so the reservation covers whichever engine serves it."""
    extra = extra or {}
    counts = [value for value in (extra.get("best_of"), extra.get("n_cmpl")) if type(value) is int and value > 0]
    return max([n or 1, *counts])


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
                # By class, not `part.type`: OtherPart's `type` is any string, so a tag does not narrow the union
                # for the type checker (the discriminator gives every known tag its own class).
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
    tokens += estimator.utf8_tokens(b"".join(texts))
    output = output_limit(wire)
    method = "+".join(sorted(methods, key=_METHOD_ORDER.index))
    prefix = hasher.hash(b"".join(canonical), model) if hasher is not None else None
    return RoutingRequest(
        api="chat", model=model, prompt_tokens=tokens, output_tokens=output, stream=bool(wire.stream),
        modalities=frozenset(modalities), estimate_method=method,
        session_key=session_hint(session_key, extra.get("prompt_cache_key"), wire.user),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        prefix=prefix, outputs=completions_per_prompt(wire.n, extra), min_output_tokens=forced_output(extra),
        engine_output_tokens=engine_output_limit(extra),
    )


_METHOD_ORDER = ["bytes", "pixels", "default", "audio", "audio_size", "audio_default", "video"]


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


@dataclass(frozen=True, slots=True)
class AnthropicWire:
    """A validated Anthropic request (`messages` or `count_tokens`) as the chat request it stands
    for (`gateway.protocol.anthropic.to_chat`): routing reads `chat`."""

    api: Api
    chat: ChatCompletionRequest


def messages_features(wire: AnthropicWire, model: str, estimator: TokenEstimator,
                      hasher: PrefixHasher | None = None, session_key: str | None = None,
                      measured: Mapping[str, tuple[int, int]] | None = None) -> RoutingRequest:
    """Features of an Anthropic Messages request: exactly those of the equivalent chat request
    (`chat_features` of `wire.chat`: the same token estimate, images, template overhead and prefix
    hashes, so a conversation moving between the two APIs keeps its prefix blocks), with its own
    `api`. `max_tokens` is the output reservation; the stream always carries usage (Anthropic's
    `message_start` / `message_delta`), so no usage patch. A count_tokens request generates
    nothing and is charged no tokens: output 0, quota 0 (Anthropic rate-limits it by requests).
    Raises InvalidRequest as `chat_features`."""
    request = chat_features(wire.chat, model, estimator, hasher, session_key, measured)
    if wire.api == "count_tokens":
        return replace(request, api="count_tokens", output_tokens=0, stream=False, include_usage=True,
                       batch_prompt_tokens=0)
    return replace(request, api=wire.api, include_usage=True)


def completion_features(wire: CompletionRequest, model: str, estimator: TokenEstimator,
                        hasher: PrefixHasher | None = None, session_key: str | None = None) -> RoutingRequest:
    """Features of a legacy completions request (text prompt(s) or token ids).

    A batch of prompts is several sequences: the longest decides the context, the first the prefix.
    """
    prompt = wire.prompt
    method = "bytes"
    prompts = 1
    if isinstance(prompt, str):
        first = prompt.encode("utf-8", "surrogatepass")
        tokens = total = estimator.utf8_tokens(first)
    elif not prompt:
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        encoded = [p.encode("utf-8", "surrogatepass") for p in prompt]
        each = [estimator.utf8_tokens(e) for e in encoded]
        first, tokens, total, prompts = encoded[0], max(each), sum(each), len(each)
    elif isinstance(prompt[0], int):
        first, tokens, method = _ids_bytes(prompt), len(prompt), "token_ids"
        total = tokens
    else:
        first, method = _ids_bytes(prompt[0]), "token_ids"
        lengths = [len(p) for p in prompt]
        tokens, total, prompts = max(lengths), sum(lengths), len(lengths)
    prefix = hasher.hash(first, model) if hasher is not None else None
    return RoutingRequest(
        api="completions", model=model, prompt_tokens=tokens, output_tokens=output_limit(wire),
        stream=bool(wire.stream), modalities=frozenset({"text"}), estimate_method=method,
        session_key=session_hint(session_key, (wire.model_extra or {}).get("prompt_cache_key"), wire.user),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage), prefix=prefix,
        outputs=completions_per_prompt(wire.n, wire.model_extra) * prompts, batch_prompt_tokens=total,
        min_output_tokens=forced_output(wire.model_extra), engine_output_tokens=engine_output_limit(wire.model_extra),
    )


def _ids_bytes(ids: list[int]) -> bytes:
    return orjson.dumps(ids)


def responses_features(wire: ResponsesRequest, model: str, estimator: TokenEstimator,
                       hasher: PrefixHasher | None = None, session_key: str | None = None,
                       measured: Mapping[str, tuple[int, int]] | None = None) -> RoutingRequest:
    """Features of a Responses API request, counted like chat (`chat_features`): `instructions` is
    a system message, a string `input` one user message, each input item a message (its text
    parts, its images at their pixel or default cost, a function call's name and arguments, a
    function call's output, other items as their JSON); the tools' JSON too; `max_output_tokens`
    is the output reservation. The prefix hashes run over the same canonical bytes as chat's, so
    a conversation sent through both APIs meets the same cache entries.

    With `previous_response_id` the stored history on the engine is not counted: the gateway does
    not hold it (the request goes to its owner, `ProxyService`). Raises InvalidRequest for an
    image data URI that cannot be read.
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
    tokens += estimator.utf8_tokens(b"".join(texts_all))
    method = "+".join(sorted(methods, key=_METHOD_ORDER.index))
    prefix = hasher.hash(b"".join(canonical), model) if hasher is not None else None
    return RoutingRequest(
        api="responses", model=model, prompt_tokens=tokens, output_tokens=wire.max_output_tokens,
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
