"""The routing-policy interface: a pure, synchronous choice of one worker among candidates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and why (`reason` is a bounded metric label, e.g. `least_load`)."""

    worker: Worker
    reason: str


class RoutingPolicy(Protocol):
    """A policy picks one of `candidates` (never empty, all healthy and untried) for `request`.

    It must not do I/O: data it needs (affinity, load) is gathered before and passed in.
    """

    name: str

    def select(self, request: RoutingRequest, candidates: list[Worker]) -> Decision: ...
