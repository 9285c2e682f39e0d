"""OpenAI's legacy completions (`POST /v1/completions`): a text prompt, a batch of them, or token ids.

A batch is several sequences: the longest decides the context, the first the prefix hashes. A stream
ends with `data: [DONE]`; errors are OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.affinity.hashing import PrefixHasher
from gateway.dialects.base import Dialect, SizeChecker
from gateway.dialects.chat import chat_output
from gateway.dialects.names import COMPLETIONS, Api
from gateway.errors import InvalidRequest
from gateway.protocol.openai import CompletionRequest
from gateway.routing.features import (
    RoutingRequest,
    cache_partition,
    completions_per_prompt,
    engine_output_limit,
    forced_output,
    output_limit,
    session_hint,
)
from gateway.routing.tokens import TokenEstimator


class CompletionsDialect(Dialect[CompletionRequest]):
    """OpenAI's legacy completions API."""

    api: Api = COMPLETIONS
    wire_model = CompletionRequest
    path = "/v1/completions"
    output_limit_field = "max_tokens"
    prompt_param = "prompt"
    migrates = True

    def features(self, wire: CompletionRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`completion_features` (a prompt has no images: `measured` is not read)."""
        return completion_features(wire, model, estimator, hasher, session_key)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """The prompt's token-id limit, then the lower bound of its tokens; the prompt's size in items
        (1 for a string, its token ids, or one a text of a batch)."""
        config = checker.config
        output = chat_output(payload)
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            checker.check_floor(payload, "prompt", len(prompt), 0, 0, output, None)
            return 1
        if not isinstance(prompt, list) or not prompt:
            return 0
        if type(prompt[0]) is int:  # token ids (a mixed list fails validation, which sees only these)
            ids = longest = len(prompt)
        elif isinstance(prompt[0], list):  # a batch of token-id lists: the longest decides the context
            sizes = [len(p) if type(p) is list else 1 for p in prompt]
            ids, longest = sum(max(size, 1) for size in sizes), max(sizes)  # an empty list still counts one
        else:  # texts: one id each for the count; the longest text decides the context
            ids, longest = len(prompt), 0
            checker.check_floor(payload, "prompt", max(len(p) if type(p) is str else 0 for p in prompt), 0, 0,
                                output, None)
        if ids > config.max_prompt_ids:
            raise InvalidRequest(f"The prompt has {ids} token ids; the limit is {config.max_prompt_ids}.",
                                 param="prompt", code="context_length_exceeded")
        checker.check_floor(payload, "prompt", 0, 0, longest, output, None)
        return ids


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
        encoded = [p.encode("utf-8", "surrogatepass") for p in prompt]  # type: ignore[union-attr]
        each = [estimator.utf8_tokens(e) for e in encoded]
        first, tokens, total, prompts = encoded[0], max(each), sum(each), len(each)
    elif isinstance(prompt[0], int):
        first, tokens, method = _ids_bytes(prompt), len(prompt), "token_ids"  # type: ignore[arg-type]
        total = tokens
    else:
        first, method = _ids_bytes(prompt[0]), "token_ids"  # type: ignore[arg-type]
        lengths = [len(p) for p in prompt]  # type: ignore[arg-type]
        tokens, total, prompts = max(lengths), sum(lengths), len(lengths)
    prefix = hasher.hash(first, model, cache_partition(wire.model_extra)) if hasher is not None else None
    return RoutingRequest(
        api=COMPLETIONS, model=model, prompt_tokens=tokens, output_tokens=output_limit(wire),
        stream=bool(wire.stream), modalities=frozenset({"text"}), estimate_method=method,
        session_key=session_hint(session_key, (wire.model_extra or {}).get("prompt_cache_key"), wire.user),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage), prefix=prefix,
        outputs=completions_per_prompt(wire.n, wire.model_extra) * prompts, batch_prompt_tokens=total,
        min_output_tokens=forced_output(wire.model_extra), engine_output_tokens=engine_output_limit(wire.model_extra),
    )


def _ids_bytes(ids: list[int]) -> bytes:
    return orjson.dumps(ids)
