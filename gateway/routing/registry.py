"""Policy names → classes, and so → their `policy_params` models (`POLICY_PARAMS`, which the pool
config checks `policy_params` with). Adding a policy: one module in `policies/` and one entry in
`POLICIES` below (gateway/routing/policies/__init__.py says what the module holds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from gateway.routing.policies.least_load import LeastLoadPolicy
from gateway.routing.policies.power_of_two import PowerOfTwoPolicy
from gateway.routing.policies.prefix_affinity import PrefixAffinityPolicy
from gateway.routing.policies.round_robin import RoundRobinPolicy
from gateway.routing.policies.session import SessionPolicy
from gateway.routing.policies.ttft_cost import TtftCostPolicy
from gateway.routing.policy import RoutingPolicy

POLICIES: dict[str, Any] = {
    cls.name: cls
    for cls in (PrefixAffinityPolicy, LeastLoadPolicy, PowerOfTwoPolicy, RoundRobinPolicy, SessionPolicy,
                TtftCostPolicy)
}
"""Every routing policy's name (`policy:` in a pool) → its class."""

POLICY_PARAMS: dict[str, type[BaseModel]] = {name: cls.Params for name, cls in POLICIES.items()}
"""Every routing policy's name → the pydantic model of its `policy_params`."""


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> RoutingPolicy:
    """A new policy instance with validated params.

    Raises ValueError naming the known policies for an unknown name, pydantic.ValidationError for
    bad params.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    policy: RoutingPolicy = cls(cls.Params.model_validate(dict(params or {})))
    return policy
