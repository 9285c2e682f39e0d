"""least_load: the candidate with the fewest requests on its engine.

Algorithm: minimise `load` (engine running + waiting + requests this replica started since the
last scrape; this replica's in-flight count when the engine exports no metrics); ties rotate.
Parameters: none.
"""

from __future__ import annotations

from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, NoParams, TieBreaker
from gateway.routing.prefill import PrefillModel


class LeastLoadPolicy:
    """Fewest requests wins; ties are broken round-robin."""

    name = "least_load"
    uses_affinity = False
    prefill_model: PrefillModel | None = None
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self._ties = TieBreaker()

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        return Decision(self._ties.least_loaded(candidates).worker, "least_load")
