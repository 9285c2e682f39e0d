"""Pool choice by context length and modality (design §2 step 3, §4)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PD_APIS, PoolConfig
from gateway.dialects.registry import dialect_for
from gateway.errors import ApiNotServed, ContextLengthExceeded, InvalidRequest
from gateway.routing.features import RoutingRequest


def usable_context(pool: PoolConfig) -> int:
    """Tokens of prompt + output the pool's engines accept: `max_context_tokens` less the engine's
    slack (SGLang refuses a request that would fill its context exactly)."""
    return pool.max_context_tokens - ENGINES[pool.engine].context_slack_tokens


def serves(pool: PoolConfig, api: str) -> bool:
    """Whether the pool's engines serve `api`: its `apis` when configured, else its engine kind's;
    a prefill/decode pool only the APIs its two-leg protocols are known for (`PD_APIS`)."""
    if pool.disaggregation is not None and api not in PD_APIS:
        return False
    return api in pool.apis if pool.apis is not None else api in ENGINES[pool.engine].apis


def skipped_pools(request: RoutingRequest, pools: Sequence[PoolConfig]) -> list[str]:
    """Names of the pools that would fit `request` by modality and context but whose engines do
    not serve its API (the route reason `x-kimi-gateway-skipped-pools` reports)."""
    return [p.name for p in pools if not serves(p, request.api) and request.modalities.issubset(p.modalities)
            and request.context_tokens(p.default_output_tokens) <= usable_context(p)]


def fitting_pools(request: RoutingRequest, pools: Sequence[PoolConfig]) -> list[PoolConfig]:
    """The pools that can serve `request`, cheapest (configured order) first.

    A pool fits when its engines serve the request's API (`serves`), it accepts every modality
    the request uses and its `usable_context` is at least prompt + output tokens (output = the
    request's limit, else the pool's reservation). Raises ApiNotServed (404) when no pool serves
    the API, InvalidRequest when no pool accepts a modality, ContextLengthExceeded (400,
    `context_length_exceeded`) when the request is larger than every such pool.
    """
    by_api = [p for p in pools if serves(p, request.api)]
    if not by_api:
        raise ApiNotServed(f"No pool of this gateway serves the {request.api} API for the model "
                           f"`{request.model[:200]}`: its pools ({', '.join(p.name for p in pools)}; engines "
                           f"{', '.join(sorted({p.engine for p in pools}))}) do not answer it; a pool's `apis` "
                           "lists what it serves.")
    pools = by_api
    by_modality = [p for p in pools if request.modalities.issubset(p.modalities)]
    if not by_modality:
        missing = sorted(request.modalities - set().union(*(set(p.modalities) for p in pools)))
        raise InvalidRequest(
            f"This model's pools do not accept {', '.join(missing)} content; accepted: "
            f"{', '.join(sorted(set().union(*(set(p.modalities) for p in pools))))}.",
            param="messages", code="unsupported_content_type",
        )
    fits = [p for p in by_modality if request.context_tokens(p.default_output_tokens) <= usable_context(p)]
    if fits:
        return fits
    largest = max(by_modality, key=lambda p: p.max_context_tokens)
    output = request.output_tokens if request.output_tokens is not None else largest.default_output_tokens
    raise ContextLengthExceeded(
        f"This model's maximum context length is {largest.max_context_tokens} tokens. However, this "
        f"request needs about {request.prompt_tokens + output} tokens ({request.prompt_tokens} "
        f"estimated prompt tokens by {request.estimate_method} + {output} output tokens). "
        "Please reduce the length of the messages or the output limit.",
        param=dialect_for(request.api).prompt_param,
    )


def larger_pools(current: PoolConfig, candidates: Sequence[PoolConfig]) -> list[PoolConfig]:
    """Pools after `current` in `candidates` with a strictly larger context, for a "too long" retry."""
    return [p for p in candidates if p.max_context_tokens > current.max_context_tokens]
