"""least_load: the candidate with the fewest open requests from this replica.

Algorithm: minimise `in_flight`; ties rotate (a counter offsets the start) so idle pools spread
work instead of piling it on worker 0. Parameters: none.
"""

from __future__ import annotations

from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Decision


class LeastLoadPolicy:
    """Fewest in-flight requests wins; ties are broken round-robin."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = 0

    def select(self, request: RoutingRequest, candidates: list[Worker]) -> Decision:
        n = len(candidates)
        start = self._counter % n
        self._counter += 1
        best = min(range(n), key=lambda i: (candidates[(start + i) % n].in_flight, i))
        return Decision(candidates[(start + best) % n], "least_load")
