"""Pool kinds: what makes a pool's attempts. The dispatch loop asks the pool's kind for one
attempt among the candidates with room and runs it; it knows nothing of legs.

`Aggregated` (every pool today): the pool's policy picks one worker, whose attempt is a
`SingleLeg` (with a cost-aware policy, holding the request's prefill ticket:
`steps.prefill_ticket`). `Disaggregated` (a prefill/decode pool, issue 13): a prefill and a
decode worker, each picked by its role's policy, in a two-leg attempt run by the pool's protocol
runner (`dispatch/pd/`); `kind_of` picks the kind from the pool's `disaggregation` config. A cost-aware
prefill policy sees the prefill workers' engine load in tokens there, but no prefill ticket is
taken: their rates stay at the prior.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dialects.base import usage_patch
from gateway.dialects.names import Api
from gateway.dispatch.attempt import Attempt, SingleLeg
from gateway.dispatch.context import Dispatch
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.pd.attempt import PdAttempt, PdRunner
from gateway.dispatch.pd.mooncake import MOONCAKE
from gateway.dispatch.pd.nixl import NIXL
from gateway.dispatch.pd.sglang import SGLANG
from gateway.dispatch.steps import decide, engine_body, prefill_ticket, served_name
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import RoutingPolicy
from gateway.state import AppState


class PoolKind(Protocol):
    """Makes one attempt of a request (`dispatch`, in `dispatch.pool`) among `workers`, the pool's
    candidates with room not yet tried, with `policy` (the pool's policy) and `match` (worker
    URL -> share of the prompt it holds, {} without affinity). Synchronous: nothing awaits
    between the room seen and the slot the attempt takes, so the room seen is the room taken."""

    def attempt(self, dispatch: Dispatch, policy: RoutingPolicy, workers: list[Worker],
                match: Mapping[str, float]) -> Attempt: ...


class Aggregated:
    """A pool whose workers each serve whole requests: one worker, one leg per attempt."""

    __slots__ = ()

    def attempt(self, dispatch: Dispatch, policy: RoutingPolicy, workers: list[Worker],
                match: Mapping[str, float]) -> Attempt:
        """The policy's choice (`steps.decide`) and its engine body (with the usage patch on when
        a stream's client did not ask for usage and the engine supports it: its tokens are
        counted anyway, backends/patches.py)."""
        request, pool, state = dispatch.request, dispatch.pool, dispatch.state
        decision = decide(policy, request, workers, match, state.prefill)
        worker = decision.worker
        patch_usage = usage_patch(request, worker.engine)
        body = engine_body(dispatch.bodies, dispatch.payload, dispatch.api, pool,
                           served_name(pool, request, state.config), worker, patch_usage, request.adapter)
        matched = match.get(worker.url, 0.0) if policy.uses_affinity else None
        return SingleLeg(state, dispatch.api, pool, worker, decision.reason, matched, body, request,
                         dispatch.ledger, patch_usage, prefill_ticket(state.prefill, policy, request, worker, match))


class Disaggregated:
    """A prefill/decode pool: each attempt takes a prefill worker (picked by `policy`, the pool's
    prefill policy, with `match`: the prefix cache lives on the prefill workers) and a decode
    worker (among `workers`, the decode candidates with room, picked by the decode policy), and
    runs the two-leg attempt (`dispatch/pd/attempt.py`) with the pool's protocol runner.
    `dispatch.choose_pool` made sure a prefill worker with room exists."""

    __slots__ = ("_runner",)

    def __init__(self, runner: PdRunner) -> None:
        self._runner = runner

    def attempt(self, dispatch: Dispatch, policy: RoutingPolicy, workers: list[Worker],
                match: Mapping[str, float]) -> Attempt:
        """Both phases' choices (`steps.decide`), their route-reason metric, and the attempt. The
        route reason is `prefill:<reason>,decode:<reason>`."""
        request, pool, state = dispatch.request, dispatch.pool, dispatch.state
        registry = state.registry
        prefills = registry.gates[pool.name].with_room(registry.candidates(pool.name, dispatch.tried, "prefill",
                                                                             request.adapter))
        prefill = decide(policy, request, prefills, match, state.prefill)  # no ticket: rates stay at the prior
        decode = decide(state.policies.policy(pool.name, "decode"), request, workers, {})
        dispatch.ledger.pd_routed(pool.name, prefill.reason, decode.reason)
        worker = decode.worker
        patch_usage = usage_patch(request, worker.engine)
        body = engine_body(dispatch.bodies, dispatch.payload, dispatch.api, pool,
                           served_name(pool, request, state.config), worker, patch_usage, request.adapter)
        matched = match.get(prefill.worker.url, 0.0) if policy.uses_affinity else None
        return PdAttempt(self._runner, state, dispatch.api, pool, worker, prefill.worker,
                         f"prefill:{prefill.reason},decode:{decode.reason}", prefill.reason, matched, body,
                         request, dispatch.ledger, patch_usage)

    def pair(self, state: AppState, api: Api, pool: PoolConfig, decode: Worker, prefill: Worker, reason: str,
             body: bytes, request: RoutingRequest, ledger: Ledger, strip_usage: bool) -> PdAttempt:
        """A two-leg attempt on a pair the caller chose (a migration's fresh pair,
        `gateway/dispatch/migration.py`): `body` is the decode worker's engine body, without the
        protocol's fields; the runner adds fresh ones (a new bootstrap room, KV handle or transfer
        id), as for every attempt. Route reason `reason` for both phases."""
        return PdAttempt(self._runner, state, api, pool, decode, prefill, reason, reason, None, body, request,
                         ledger, strip_usage)


AGGREGATED = Aggregated()
PD_KINDS: dict[str, Disaggregated] = {"sglang": Disaggregated(SGLANG), "vllm-nixl": Disaggregated(NIXL),
                                 "vllm-mooncake": Disaggregated(MOONCAKE)}

RESPONSE_AFFINITY = "response_affinity"
"""The route reason of a request pinned to one worker: a Responses follow-up sent to the worker that
stores its history (`routing/response_affinity.py`)."""


class Pinned:
    """A request only one worker can serve (`Dispatch.pinned`, passed as the only one of `workers`):
    its attempt goes there whatever the pool's policy says, with the route reason `response_affinity`."""

    __slots__ = ()

    def attempt(self, dispatch: Dispatch, policy: RoutingPolicy, workers: list[Worker],
                match: Mapping[str, float]) -> Attempt:
        """A SingleLeg on `workers[0]` (the usage patch as `Aggregated` decides it)."""
        request, pool, state = dispatch.request, dispatch.pool, dispatch.state
        worker = workers[0]
        patch_usage = usage_patch(request, worker.engine)
        body = engine_body(dispatch.bodies, dispatch.payload, dispatch.api, pool,
                           served_name(pool, request, state.config), worker, patch_usage, request.adapter)
        return SingleLeg(state, dispatch.api, pool, worker, RESPONSE_AFFINITY, None, body, request,
                         dispatch.ledger, patch_usage)


PINNED = Pinned()


def kind_of(pool: PoolConfig) -> PoolKind:
    """The kind of `pool` (a PoolConfig): `Disaggregated` with the protocol of its
    `disaggregation.mode`, else `Aggregated`."""
    pd = pool.disaggregation
    return AGGREGATED if pd is None else PD_KINDS[pd.mode]
