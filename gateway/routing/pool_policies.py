"""Pool policies: one policy instance per pool (two for a prefill/decode pool: one per role), built and
validated at start-up and on a reload."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.backends.pool_params import PoolConfig
from gateway.config import GatewayConfig
from gateway.routing.policy import RoutingPolicy
from gateway.routing.registry import build_policy

PolicySpec = tuple[str, dict[str, Any]]


def _specs(pool: PoolConfig) -> dict[str | None, PolicySpec]:
    """Role -> (policy name, params) of a pool: role None is the policy the dispatch loop asks for
    (an aggregated pool's `policy`; a PD pool's prefill policy, whose affinity lookup finds the
    prefill workers holding the prompt's prefix), "decode" a PD pool's decode policy."""
    pd = pool.disaggregation
    if pd is None:
        return {None: (pool.policy, pool.policy_params)}
    return {None: (pd.prefill_policy, pd.prefill_policy_params), "decode": (pd.decode_policy, pd.decode_policy_params)}


class PoolPolicies:
    """Holds each pool's policies. Raises ValueError at construction for an unknown policy name."""

    def __init__(self, config: GatewayConfig) -> None:
        self._built: dict[tuple[str, str | None], PolicySpec] = {
            (p.name, role): spec for p in config.pools for role, spec in _specs(p).items()}
        self._policies: dict[tuple[str, str | None], RoutingPolicy] = {
            key: build_policy(*spec) for key, spec in self._built.items()}

    def policy(self, pool: str, role: str | None = None) -> RoutingPolicy:
        """The policy of `pool` (a PD pool's prefill policy), or of its `role` ("decode")."""
        return self._policies[(pool, role)]

    def update(self, pools: Sequence[PoolConfig]) -> None:
        """After a reload: a new policy for a pool that is new or whose policy or params changed;
        the others keep theirs (and its state, e.g. a round-robin position). Swaps in a new dict.
        Raises ValueError / pydantic.ValidationError as `build_policy` does (nothing is changed then)."""
        built = {(p.name, role): spec for p in pools for role, spec in _specs(p).items()}
        policies: dict[tuple[str, str | None], RoutingPolicy] = {}
        for key, spec in built.items():
            same = self._built.get(key) == spec
            policies[key] = self._policies[key] if same else build_policy(*spec)
        self._policies = policies
        self._built = built
