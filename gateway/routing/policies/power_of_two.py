"""power_of_two: two random candidates, the less loaded one wins ("power of two choices").

Algorithm: sample two distinct candidates uniformly; take the one with the lower `load` (the
first on a tie). Spreads load almost as well as least_load without herding every replica onto
the same idle worker. Parameters: `seed` (int or null) for a reproducible sequence.
"""

from __future__ import annotations

import random

from pydantic import Field

from gateway.config_base import Section
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision
from gateway.routing.prefill import PrefillModel


class PowerOfTwoParams(Section):
    """`policy_params` of `power_of_two` (gateway/routing/policies/power_of_two.py)."""

    seed: int | None = Field(default=None, description="random seed for a reproducible sequence; null: random")


class PowerOfTwoPolicy:
    """Best of two random choices."""

    name = "power_of_two"
    uses_affinity = False
    prefill_model: PrefillModel | None = None
    Params = PowerOfTwoParams

    def __init__(self, params: PowerOfTwoParams | None = None) -> None:
        self._random = random.Random((params or PowerOfTwoParams()).seed)

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0].worker, "power_of_two")
        a, b = self._random.sample(candidates, 2)
        return Decision((a if a.load <= b.load else b).worker, "power_of_two")
