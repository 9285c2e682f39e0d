"""session: the same session key always goes to the same worker (consistent hashing).

Algorithm: rendezvous (highest-random-weight) hashing — each candidate scores
xxh3_64(session key + worker URL) and the highest score wins, so removing a worker only moves
the sessions that were on it. The key is the request's session hint (`X-Session-ID`, Codex's
`session_id` / `session-id` header, the body's `prompt_cache_key`, Anthropic's `metadata.user_id`,
`user`, in that order: gateway/routing/features.py `session_hint`) scoped to its API key; requests
without one go to the least-loaded candidate. Parameters: none.
"""

from __future__ import annotations

import xxhash

from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, NoParams, TieBreaker
from gateway.routing.prefill import PrefillModel


class SessionPolicy:
    """Sticky sessions by rendezvous hashing."""

    name = "session"
    uses_affinity = False
    prefill_model: PrefillModel | None = None
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self._ties = TieBreaker()

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        key = request.session_key
        if not key:
            return Decision(self._ties.least_loaded(candidates).worker, "no_session")
        best = max(candidates, key=lambda c: xxhash.xxh3_64_intdigest(f"{key}\x00{c.worker.url}".encode()))
        return Decision(best.worker, "session")
