"""The routing-policy interface: a pure, synchronous choice of one worker among candidates.

I/O happens outside: before `select`, the service gathers each candidate's load (scraped from
the engine) and its affinity match (from the store); after it, the choice is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from gateway.backends.worker import Worker
from gateway.config_base import Section
from gateway.routing.features import RoutingRequest
from gateway.routing.prefill import PrefillModel


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker the request may go to, with what policies compare.

    `load` is in requests (engine running + waiting + started here since the last scrape);
    `kv_usage` is the engine's KV-cache use 0..1 (None if not exported); `match` is the share of
    the prompt (0..1) whose prefix this worker holds per the affinity store, `matched_tokens` the
    same in estimated tokens. Only for a policy with a `prefill_model` (else 0): `queued_tokens`,
    the prefill work ahead of the request there (tokens), and `prefill_rate`, the worker's
    estimated prefill rate (tokens/s), `decoding` the requests decoding there (estimated, requests)
    and `recent_tokens` the uncached tokens this replica sent it lately (decayed, tokens); see
    gateway/routing/prefill.py. `session`: this worker served
    the request's session last (its session key, per the affinity store): where a turn that shares
    no cached prefix yet goes, load permitting.
    """

    worker: Worker
    load: float
    kv_usage: float | None = None
    match: float = 0.0
    matched_tokens: int = 0
    queued_tokens: float = 0.0
    prefill_rate: float = 0.0
    session: bool = False
    decoding: float = 0.0
    recent_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker and why (`reason` is a bounded metric label, e.g. `affinity`)."""

    worker: Worker
    reason: str


class NoParams(Section):
    """`policy_params` of a policy without parameters: any key is an error."""


class RoutingPolicy(Protocol):
    """A policy picks one of `candidates` (never empty: healthy, untried workers) for `request`.

    `prefill_model` is None but for a cost-aware policy: then the dispatch fills each candidate's
    `queued_tokens` and `prefill_rate` with it and feeds it each request's observed TTFT
    (gateway/routing/prefill.py); the policy itself stays a pure function of its candidates."""

    name: ClassVar[str]
    uses_affinity: ClassVar[bool]
    prefill_model: PrefillModel | None

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision: ...


class TieBreaker:
    """Least load with ties broken in rotation, so idle workers share work instead of worker 0."""

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = 0

    def least_loaded(self, candidates: list[Candidate]) -> Candidate:
        n = len(candidates)
        start = self._counter % n
        self._counter += 1
        best = min(range(n), key=lambda i: (candidates[(start + i) % n].load, i))
        return candidates[(start + best) % n]
