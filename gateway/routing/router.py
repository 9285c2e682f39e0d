"""The router: one policy instance per pool, built and validated at start-up."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.routing.policy import RoutingPolicy
from gateway.routing.registry import build_policy


class Router:
    """Holds each pool's policy. Raises ValueError at construction for an unknown policy name."""

    def __init__(self, config: GatewayConfig) -> None:
        self._policies: dict[str, RoutingPolicy] = {p.name: build_policy(p.policy, p.policy_params)
                                                  for p in config.pools}

    def policy(self, pool: str) -> RoutingPolicy:
        return self._policies[pool]
