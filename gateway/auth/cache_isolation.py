"""Prefix-cache isolation per API key (`auth.cache_isolation: per_key`): the `cache_salt` the gateway
sets in each request's body, so one key's requests never reuse, or time, or read the
`cached_tokens` of, another key's cached prompt blocks.

Why: an engine's prefix cache is shared by every request to it, and it reports what it reused
(`usage.prompt_tokens_details.cached_tokens`, Anthropic's `cache_read_input_tokens`) and answers
a reused prefix sooner; with prefix-affinity routing sending a prompt to the worker that holds its
prefix, a key can probe whether someone sent a given text recently, token block by token block.
A salt closes that on the engines that read it: vLLM mixes `cache_salt` into the hash of a prompt's
first block, so every block of a salted prompt differs from the same prompt's under another salt
(`generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`; read on chat, completions,
Responses and, since 0.32, Messages: their `protocol.py`, `vllm/entrypoints/anthropic/serving.py`);
SGLang joins `cache_salt` and the body's `extra_key` into its radix cache's `extra_key`
(`OpenAIServingBase._compute_extra_key` in `python/sglang/srt/entrypoints/openai/serving_base.py`;
its Messages layer copies neither field into the chat request it builds,
`python/sglang/srt/entrypoints/anthropic/request_conversion.py`, so Messages requests on SGLang
pools stay unsalted); llama.cpp's server has no such field.

The salt is set where the client's body is decoded, before it is validated (`ProxyService.parse`),
so the routing features hash the prompt under it (`gateway.routing.features.cache_partition`) and
the prefix-affinity records are partitioned exactly as the engine's cache; a client's own
`cache_salt` is replaced (the field steers the cluster), its SGLang `extra_key` kept (it can only
split its own partition further: the salt in front of it has a fixed length).
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

from gateway.auth.params import AuthConfig
from gateway.dialects.names import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Api

SALTED_APIS: frozenset[Api] = frozenset({CHAT, COMPLETIONS, RESPONSES, MESSAGES})
"""The APIs whose engine body gets the salt: those that prefill a prompt into the cache and whose
engines read `cache_salt` (count_tokens and the pooling APIs cache nothing reusable across keys here)."""

SALT_FIELD = "cache_salt"


def cache_salt(group: str) -> str:
    """The salt of a cache group (a key's `cache_group`, else its name): `kgw-` and 32 hex digits of
    xxh3-128 over a tag and the group, the same in every replica and across restarts (the engines'
    caches outlive a gateway process), 36 characters, within vLLM's limits (at most 128, no `@`, `/`,
    `\\` nor NUL: `validate_cache_salt` in `vllm/entrypoints/generate/base/protocol.py`). Clients
    cannot choose it: the gateway replaces any salt they send."""
    return "kgw-" + xxhash.xxh3_128_hexdigest(b"kimi-gateway cache group\x00" + group.encode())


def salts(config: AuthConfig) -> Mapping[str, str]:
    """Key name -> its salt under `config.cache_isolation` (empty when off)."""
    if config.cache_isolation == "off":
        return {}
    return {key.name: cache_salt(key.cache_group or key.name) for key in config.keys}
