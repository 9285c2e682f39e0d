"""Pool kinds: what makes a pool's attempts. The dispatch loop asks the pool's kind for one
attempt among the candidates with room and runs it; it knows nothing of legs.

`Aggregated` (every pool today): the pool's policy picks one worker, whose attempt is a
`SingleLeg`. A prefill/decode pool (issue 13) adds its kind here, returning a two-leg attempt
(see `attempt.py`'s module docstring), and `kind_of` picks it from the pool's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.backends.worker import Worker
from gateway.config import PoolConfig
from gateway.dispatch.attempt import Attempt, SingleLeg
from gateway.dispatch.context import Dispatch
from gateway.dispatch.steps import decide, engine_body
from gateway.routing.policy import RoutingPolicy


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
        decision = decide(policy, request, workers, match)
        worker = decision.worker
        patch_usage = request.stream and not request.include_usage and worker.engine.supports_include_usage
        body = engine_body(dispatch.bodies, dispatch.payload, dispatch.api,
                           pool.served_model_name or state.config.model.name, worker, patch_usage)
        matched = match.get(worker.url, 0.0) if policy.uses_affinity else None
        return SingleLeg(state, dispatch.api, pool, worker, decision.reason, matched, body, request,
                         dispatch.record, patch_usage)


AGGREGATED = Aggregated()

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
        patch_usage = request.stream and not request.include_usage and worker.engine.supports_include_usage
        body = engine_body(dispatch.bodies, dispatch.payload, dispatch.api,
                           pool.served_model_name or state.config.model.name, worker, patch_usage)
        return SingleLeg(state, dispatch.api, pool, worker, RESPONSE_AFFINITY, None, body, request,
                         dispatch.record, patch_usage)


PINNED = Pinned()


def kind_of(pool: PoolConfig) -> PoolKind:
    """The kind of `pool` (a PoolConfig): aggregated for every pool until PD pools exist."""
    return AGGREGATED
