"""Policy names → classes. Adding a policy: one module in `policies/` and one line here."""

from __future__ import annotations

from collections.abc import Callable

from gateway.routing.policies.least_load import LeastLoadPolicy
from gateway.routing.policies.round_robin import RoundRobinPolicy
from gateway.routing.policy import RoutingPolicy

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "least_load": LeastLoadPolicy,
    "round_robin": RoundRobinPolicy,
}


def build_policy(name: str) -> RoutingPolicy:
    """A new policy instance; ValueError naming the known policies for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
