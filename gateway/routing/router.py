"""The router: one policy instance per pool, built and validated at start-up and on a reload."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.config import GatewayConfig, PoolConfig
from gateway.routing.policy import RoutingPolicy
from gateway.routing.registry import build_policy


class Router:
    """Holds each pool's policy. Raises ValueError at construction for an unknown policy name."""

    def __init__(self, config: GatewayConfig) -> None:
        self._policies: dict[str, RoutingPolicy] = {p.name: build_policy(p.policy, p.policy_params)
                                                  for p in config.pools}
        self._built: dict[str, tuple[str, dict[str, object]]] = {p.name: (p.policy, p.policy_params)
                                                                 for p in config.pools}

    def policy(self, pool: str) -> RoutingPolicy:
        return self._policies[pool]

    def update(self, pools: Sequence[PoolConfig]) -> None:
        """After a reload: a new policy for a pool that is new or whose policy or params changed;
        the others keep theirs (and its state, e.g. a round-robin position). Swaps in a new dict.
        Raises ValueError / pydantic.ValidationError as `build_policy` does (nothing is changed then)."""
        policies: dict[str, RoutingPolicy] = {}
        for pool in pools:
            same = self._built.get(pool.name) == (pool.policy, pool.policy_params)
            policies[pool.name] = self._policies[pool.name] if same else build_policy(pool.policy, pool.policy_params)
        self._policies = policies
        self._built = {p.name: (p.policy, p.policy_params) for p in pools}
