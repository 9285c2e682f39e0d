"""The dispatch loop's routing steps, each a plain function testable without a socket: where the
request goes next (`choose_pool`: route, spill over, wait or give up), which worker the pool's
policy picks among the candidates with room (`decide`), and the engine's body (`engine_body`)."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from enum import StrEnum

from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig
from gateway.dialects.names import Api
from gateway.parsing import BodyKey, Payload, encode_for
from gateway.protocol.adapter_fields import engine_adapter_field
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, RoutingPolicy
from gateway.routing.prefill import PrefillEstimator, PrefillTicket


class PoolStep(StrEnum):
    """What the dispatch loop does next (`choose_pool`); a spill-over's value is its metric reason."""

    ROUTE = "route"  # choose among the pool's candidates with room
    UNAVAILABLE = "unavailable"  # spill over to the next pool: this one has no candidate left
    SATURATED = "saturated"  # spill over to a later pool with room: this one is at its limits
    WAIT = "wait"  # queue for a slot of this pool (no later pool has room either)
    EXHAUSTED = "exhausted"  # no candidate here, and no later pool to spill over to


def choose_pool(registry: WorkerRegistry, pool: PoolConfig, pools: list[PoolConfig],
                tried: Collection[Worker], adapter: str | None = None) -> tuple[PoolStep, PoolConfig, list[Worker]]:
    """One step of choosing where a request goes, from the pool it is in (`pool`, one of `pools`,
    the fitting pools smallest first): the step, the pool it leads to (the next pool on a
    spill-over, else `pool`) and, for ROUTE, the candidates (not yet `tried`) with room. A pool
    spills over only with `spillover` set; "unavailable" goes to the next pool (whose own
    candidates are looked at in the next step), "saturated" to the first later pool with room.
    With `adapter` (a LoRA adapter's request) only the workers serving it are candidates."""
    workers = registry.candidates(pool.name, tried, None, adapter)
    if workers and pool.disaggregation is not None and not registry.candidates(pool.name, tried, "prefill", adapter):
        workers = []  # a PD pool needs a worker of each role
    later = pools[pools.index(pool) + 1:] if pool.spillover else []
    if not workers:
        return (PoolStep.UNAVAILABLE, later[0], workers) if later else (PoolStep.EXHAUSTED, pool, workers)
    gate = registry.gates[pool.name]
    if gate.limited and not (workers := with_room(registry, pool, workers, tried, adapter)):
        roomy = next((p for p in later if with_room(registry, p, registry.candidates(p.name, tried, None, adapter),
                                                     tried, adapter)), None)
        return (PoolStep.SATURATED, roomy, workers) if roomy is not None else (PoolStep.WAIT, pool, workers)
    return PoolStep.ROUTE, pool, workers


def with_room(registry: WorkerRegistry, pool: PoolConfig, workers: list[Worker],
              tried: Collection[Worker], adapter: str | None = None) -> list[Worker]:
    """Those of `workers` (the candidates whose answer the client gets) with room in `pool`; none
    when `pool` is a PD pool none of whose prefill workers (serving `adapter`, if given) has room."""
    gate = registry.gates[pool.name]
    if pool.disaggregation is not None and \
            not gate.with_room(registry.candidates(pool.name, tried, "prefill", adapter)):
        return []
    return gate.with_room(workers)


def served_name(pool: PoolConfig, request: RoutingRequest, config: GatewayConfig) -> str:
    """The `model` the engines of `pool` get for `request`: the LoRA adapter's name it asks for,
    else its model's served name on that pool (`GatewayConfig.served_name`)."""
    return request.adapter or config.served_name(pool, request.model)


class AffinityMatch(dict[str, float]):
    """One affinity lookup's answer: worker URL -> share of the prompt it holds (0..1], and
    `session`, the URL of the worker that served the request's session last (None: unknown)."""

    __slots__ = ("session",)

    def __init__(self, shares: Mapping[str, float], session: str | None) -> None:
        super().__init__(shares)
        self.session = session


def decide(policy: RoutingPolicy, request: RoutingRequest, workers: list[Worker],
           match: Mapping[str, float], prefill: PrefillEstimator | None = None) -> Decision:
    """The pool policy's choice among `workers` (candidates with room), each seen with its load,
    KV cache usage and the share of the prompt it holds (`match`: worker URL -> 0..1, from the
    affinity store; the matched tokens are that share of the estimated prompt tokens), and whether
    it served the request's session last (an `AffinityMatch`'s `session`); for a policy with a
    `prefill_model`, given `prefill`, also with its queued prefill tokens, prefill rate (tokens/s),
    decoding requests and the uncached tokens sent to it lately."""
    model = policy.prefill_model
    session = match.session if isinstance(match, AffinityMatch) else None
    if model is None or prefill is None:
        candidates = [Candidate(w, w.load(), w.kv_usage, match.get(w.url, 0.0),
                                int(match.get(w.url, 0.0) * request.prompt_tokens), session=w.url == session)
                      for w in workers]
        return policy.select(request, candidates)
    now = time.perf_counter()
    candidates = []
    for w in workers:
        share, load, state = match.get(w.url, 0.0), w.load(), prefill.of(w)
        candidates.append(Candidate(w, load, w.kv_usage, share, int(share * request.prompt_tokens),
                                    prefill.queued(w, state, model, load), model.rate(state, now), w.url == session,
                                    prefill.decoding(w, state, load), model.recent(state, now)))
    return policy.select(request, candidates)


def prefill_ticket(prefill: PrefillEstimator, policy: RoutingPolicy, request: RoutingRequest, worker: Worker,
                   match: Mapping[str, float]) -> PrefillTicket | None:
    """For a policy with a `prefill_model`: the ticket of a request about to go to `worker` (its
    uncached tokens there pending until its first byte; a stream's TTFT observed then), else None."""
    model = policy.prefill_model
    if model is None:
        return None
    uncached = request.prompt_tokens - int(match.get(worker.url, 0.0) * request.prompt_tokens)
    return prefill.start(worker, model, max(uncached, 0), request.stream, time.perf_counter())


def engine_body(bodies: dict[BodyKey, bytes], payload: Payload, api: Api, pool: PoolConfig, served_name: str,
                worker: Worker, patch_usage: bool, adapter: str | None = None) -> bytes:
    """The engine's request body for `worker`: the payload encoded with the pool's served model
    name, the usage patch, `max_tokens` for engines without `max_completion_tokens` on `api`, the
    client's KV connector fields only where the pool allows them (`allow_kv_transfer_fields`), and
    for a request routed for LoRA `adapter` the engine's own adapter field where it has one
    (`protocol.adapter_fields.engine_adapter_field`: SGLang's `lora_path`); encoded once per
    distinct form (`bodies` caches them for the request's later attempts)."""
    key: BodyKey = (served_name, patch_usage, api not in worker.engine.max_completion_tokens_apis,
                    pool.allow_kv_transfer_fields, engine_adapter_field(worker.engine.kind, adapter))
    body = bodies.get(key)
    if body is None:
        body = bodies[key] = encode_for(payload, *key)
    return body
