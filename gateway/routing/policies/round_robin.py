"""round_robin: candidates in turn, ignoring load and prefixes.

Algorithm: a counter advances on every choice; the choice is `candidates[counter % len]`.
Parameters: none.
"""

from __future__ import annotations

from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, NoParams
from gateway.routing.prefill import PrefillModel


class RoundRobinPolicy:
    """Cycles through the candidates."""

    name = "round_robin"
    uses_affinity = False
    prefill_model: PrefillModel | None = None
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self._counter = 0

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        choice = candidates[self._counter % len(candidates)]
        self._counter += 1
        return Decision(choice.worker, "round_robin")
