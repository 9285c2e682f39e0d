"""round_robin: candidates in turn, ignoring load and prefixes.

Algorithm: a counter advances on every choice; the choice is `candidates[counter % len]`.
Parameters: none.
"""

from __future__ import annotations

from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Decision


class RoundRobinPolicy:
    """Cycles through the candidates."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def select(self, request: RoutingRequest, candidates: list[Worker]) -> Decision:
        worker = candidates[self._counter % len(candidates)]
        self._counter += 1
        return Decision(worker, "round_robin")
