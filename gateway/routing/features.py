"""The frozen `RoutingRequest` a request is routed by (design §2 step 2), and the readers every API's
features share (session hints, output limits, forced outputs). Each API's own features are its
dialect's (`gateway/dialects/`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from gateway.affinity.hashing import PrefixKey
from gateway.dialects.names import Api
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest


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

    def reserved_output(self, default_output_tokens: int, room: int | None = None) -> int:
        """The output tokens reserved for each completion (tokens): the client's output limit, else
        the pool's `default_output_tokens` or the client's `min_tokens`, whichever is larger; at
        least llama.cpp's `n_predict` when the client set one (`engine_output_tokens`); at most
        `room`, what the pool's engines can generate after the prompt (`pools.output_room`: vLLM and
        llama.cpp shorten a larger limit to it). For a key with a token limit the gateway sends the
        engine exactly this limit (`ProxyService.handle`)."""
        base = self.output_tokens if self.output_tokens is not None else max(default_output_tokens,
                                                                              self.min_output_tokens)
        out = max(base, self.engine_output_tokens)
        return out if room is None else min(out, room)

    def quota_tokens(self, default_output_tokens: int, room: int | None = None) -> int:
        """Tokens charged to a per-key token limit: every prompt plus the output limit of every
        completion (as OpenAI's TPM counts a request: prompt + max_tokens * n; `reserved_output`,
        at most `room` each)."""
        out = self.reserved_output(default_output_tokens, room)
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


CACHE_PARTITION_FIELDS = ("cache_salt", "extra_key")
"""The body fields that keep a request's prefix-cache entries apart from other requests' with the
same model and prompt: `cache_salt`, which vLLM reads on chat, completions and Responses (their
`protocol.py`: a non-empty string, else 400) and mixes into the hash of the prompt's first block
(`generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`), so every later block's
chained hash differs too; and SGLang's `cache_salt` and `extra_key` (strings; its
`OpenAIServingBase._compute_extra_key` in `python/sglang/srt/entrypoints/openai/serving_base.py`
joins them into the request's `extra_key`, which its radix cache matches on beside the tokens).
The model (and a LoRA adapter, which is the request's model) and the images already seed or enter
the canonical prompt."""


def cache_partition(extra: Mapping[str, Any] | None) -> str | None:
    """The request's prefix-cache partition (`CACHE_PARTITION_FIELDS`) as one string, None for none:
    the JSON object of each field that is a non-empty string, by its name, so salt "ab" and salt
    "a" with extra_key "b" stay apart (vLLM ignores `extra_key`; keeping them apart costs at worst a
    missed affinity on SGLang, never an affinity to a cache entry the engine keeps apart). A field
    of another type is ignored here (the engine judges it)."""
    if not extra:
        return None
    parts = {name: value for name in CACHE_PARTITION_FIELDS if isinstance(value := extra.get(name), str) and value}
    return orjson.dumps(parts).decode() if parts else None


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


METHOD_ORDER = ["bytes", "pixels", "default", "audio", "audio_size", "audio_default", "video"]
"""The order of the estimate methods joined in `RoutingRequest.estimate_method`."""
