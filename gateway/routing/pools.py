"""Pool choice by context length and modality (design §2 step 3, §4)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PD_APIS, PoolConfig
from gateway.dialects.registry import dialect_for
from gateway.errors import ApiNotServed, ContextLengthExceeded, InvalidRequest
from gateway.routing.features import RoutingRequest


def accepts(pool: PoolConfig, request: RoutingRequest) -> bool:
    """Whether the pool's engines serve `request`'s prompt and output limit by their own rule
    (`EngineSpec.accepts`: vLLM and llama.cpp shorten an output limit the context cannot hold,
    SGLang refuses it)."""
    return ENGINES[pool.engine].accepts(request.prompt_tokens, request.output_tokens, pool.max_context_tokens)


def holds_output(pool: PoolConfig, request: RoutingRequest) -> bool:
    """Whether prompt + output fit the pool's context whole: the output the request asks for, else
    the pool's reservation (`default_output_tokens`), so the engine does not shorten it."""
    return request.context_tokens(pool.default_output_tokens) <= pool.max_context_tokens


def output_room(pool: PoolConfig, request: RoutingRequest) -> int:
    """Output tokens the pool's engines can generate after the request's prompt (at least 1): what
    its context leaves; an engine generates no more whatever the limit (`EngineSpec.accepts`)."""
    return max(pool.max_context_tokens - request.prompt_tokens, 1)


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
            and accepts(p, request)]


def fitting_pools(request: RoutingRequest, pools: Sequence[PoolConfig]) -> list[PoolConfig]:
    """The pools that can serve `request`, in the order they are tried: first those whose context
    holds prompt + output whole (`holds_output`), then those whose engines serve it by shortening
    the output (`accepts`: vLLM, vllm-ascend, llama.cpp), each cheapest (configured order) first.
    So the gateway never shortens an answer a pool could give whole, and never refuses what an
    engine would serve (docs/routing.md "Context fit").

    A pool fits when its engines serve the request's API (`serves`), it accepts every modality
    the request uses and its engine kind accepts the prompt and output limit on its context.
    Raises ApiNotServed (404) when no pool serves the API, InvalidRequest when no pool accepts a
    modality, ContextLengthExceeded (400, `context_length_exceeded`) when no such pool fits.
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
    fits = [p for p in by_modality if accepts(p, request)]
    if fits:
        return sorted(fits, key=lambda p: not holds_output(p, request))  # stable: cost order within each
    largest = max(by_modality, key=lambda p: p.max_context_tokens)
    prompt, output = request.prompt_tokens, request.output_tokens
    if output == 0:  # generates nothing: the prompt alone
        needs = (f"{prompt} tokens (estimated by {request.estimate_method}). Please reduce the length of "
                 "the input.")
    elif prompt >= largest.max_context_tokens or output is None:
        needs = (f"at least {prompt + 1} tokens ({prompt} estimated prompt tokens by {request.estimate_method} "
                 "+ at least 1 output token). Please reduce the length of the messages.")
    else:
        needs = (f"about {prompt + output} tokens ({prompt} estimated prompt tokens by "
                 f"{request.estimate_method} + {output} output tokens). Please reduce the length of the "
                 "messages or the output limit.")
    raise ContextLengthExceeded(
        f"This model's maximum context length is {largest.max_context_tokens} tokens. However, this "
        f"request needs {needs}",
        param=dialect_for(request.api).prompt_param,
    )


def larger_pools(current: PoolConfig, candidates: Sequence[PoolConfig]) -> list[PoolConfig]:
    """Pools after `current` in `candidates` with a strictly larger context, for a "too long" retry."""
    return [p for p in candidates if p.max_context_tokens > current.max_context_tokens]
