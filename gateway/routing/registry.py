"""Policy names → classes. Adding a policy: one module in `policies/`, one line here and one in config.POLICY_PARAMS.

Each policy class has `name`, `uses_affinity`, `prefill_model` (None but for a cost-aware policy),
a pydantic `Params` model (its parameters, validated at start-up from the pool's `policy_params`;
defined in gateway/config.py's `POLICY_PARAMS`, so a config is checked without importing routing
code) and `select(request, candidates)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import POLICY_PARAMS
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


if {name: cls.Params for name, cls in POLICIES.items()} != POLICY_PARAMS:  # pragma: no cover - a coding error
    raise ImportError("gateway.config.POLICY_PARAMS and gateway.routing.registry.POLICIES disagree")


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
