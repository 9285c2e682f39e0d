"""prefix_affinity: send a request to the worker that holds the longest prefix of its prompt.

Algorithm:
1. Among candidates, the one with the longest affinity match (from the store, as a share of the
   prompt and in tokens) is the affinity worker. A match shorter than `min_match_tokens` or
   `min_match_ratio` does not count (a system prompt shared by every request must not pull all
   traffic to one worker) → reason `no_match`, least-loaded candidate.
2. Load guard (SGLang's cache_aware balance test, with KV usage as a second signal): the
   affinity worker is taken unless the pool is imbalanced against it — its load exceeds the
   least-loaded candidate's by more than `balance_abs` requests AND is above `balance_rel` times
   it — or its KV-cache usage is above `kv_usage_max` while another candidate is below. Then the
   least-loaded candidate wins (reason `load_guard`) and, once it serves the request, becomes the
   prefix's new owner. Otherwise reason `affinity`.
3. No match, but the request has a session key (`X-Session-ID`, Codex's `session_id` header,
   `prompt_cache_key`, `metadata.user_id`, `user`: gateway/routing/features.py `session_hint`) and
   a candidate served that session last: it gets the request unless the load guard of step 2 holds
   against it (reason `session`), so a conversation's turn that shares no cached block yet (a new
   system prompt, a first turn after a compaction) stays where its session's earlier turns went.
Ties in load rotate among candidates.

Parameters: `min_match_tokens` (tokens, default 1024), `min_match_ratio` (0..1, default 0.0),
`balance_abs` (requests, default 8), `balance_rel` (ratio, default 1.5), `kv_usage_max` (0..1,
default 0.95).
"""

from __future__ import annotations

from pydantic import Field

from gateway.config_base import Section
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, TieBreaker
from gateway.routing.prefill import PrefillModel


class PrefixAffinityParams(Section):
    """`policy_params` of `prefix_affinity` (gateway/routing/policies/prefix_affinity.py)."""

    min_match_tokens: int = Field(default=1024, ge=0, description="tokens; a shorter cached prefix does not count")
    min_match_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of the prompt a cached prefix must cover to count")
    balance_abs: float = Field(
        default=8.0, ge=0.0, description="requests the affinity worker may carry beyond the least-loaded one")
    balance_rel: float = Field(
        default=1.5, ge=1.0, description="...and times the least-loaded one's load (both must be exceeded)")
    kv_usage_max: float = Field(
        default=0.95, gt=0.0, le=1.0, description="KV-cache usage above which the affinity worker is skipped")


class PrefixAffinityPolicy:
    """Longest cached prefix first, unless that worker is overloaded relative to the pool."""

    name = "prefix_affinity"
    uses_affinity = True
    prefill_model: PrefillModel | None = None
    Params = PrefixAffinityParams

    def __init__(self, params: PrefixAffinityParams | None = None) -> None:
        self.params = params or PrefixAffinityParams()
        self._ties = TieBreaker()

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        p = self.params
        best = max(candidates, key=lambda c: c.match)
        if best.matched_tokens < max(p.min_match_tokens, 1) or best.match < p.min_match_ratio:
            session = next((c for c in candidates if c.session), None)
            if session is not None and not self._overloaded(session, candidates):
                return Decision(session.worker, "session")
            return Decision(self._ties.least_loaded(candidates).worker, "no_match")
        if self._overloaded(best, candidates):
            others = [c for c in candidates if c is not best]
            return Decision(self._ties.least_loaded(others).worker, "load_guard")
        return Decision(best.worker, "affinity")

    def _overloaded(self, chosen: Candidate, candidates: list[Candidate]) -> bool:
        """The load guard: the pool is imbalanced against `chosen`, or its KV cache is full while
        another candidate's is not."""
        p = self.params
        least_load = min(c.load for c in candidates)
        imbalanced = chosen.load - least_load > p.balance_abs and chosen.load > least_load * p.balance_rel
        return imbalanced or (chosen.kv_usage is not None and chosen.kv_usage > p.kv_usage_max
                              and any(c.kv_usage is None or c.kv_usage <= p.kv_usage_max for c in candidates))
