"""ttft_cost: the candidate with the lowest predicted time to first token, with a hysteresis that
keeps a conversation on its cache owner.

Algorithm: for each candidate, predicted TTFT (seconds) =
    (queued prefill tokens on the worker + the request's uncached tokens there) / the worker's prefill rate
where the uncached tokens are the estimated prompt tokens minus the prefix the worker holds per
the affinity store (`matched_tokens`), the queued tokens are this replica's requests there still
in prefill plus the other requests its engine reports, in tokens, and the rate (tokens/s) is
learned per worker from observed TTFTs, bounded and decaying to the pool's rate (both estimated in
gateway/routing/prefill.py and handed in on each `Candidate` by the dispatch).

1. Cache owner first: the candidate with the longest match (at least `owner_min_tokens`) keeps the
   request while its prediction exceeds the lowest by no more than
   `stay_s` + `prefix_value` x (its matched tokens / its rate), reason `affinity`. Moving a
   conversation recomputes its prefix elsewhere (in this request's prediction) and also leaves the
   owner's copy unused for its later turns and fills a second cache with it: on the trace replay,
   moving whenever the prediction was lower cost a quarter of the hit ratio (0.19 vs 0.26 in the
   virtual-time evaluator), which the later turns paid for in prefill work; with `prefix_value` 20
   the hit ratio matches SGLang's cache_aware (loadtest/README.md, "TTFT-aware policy").
2. Otherwise the lowest prediction wins; predictions within `tie_tolerance` of it count as equal,
   and among those the longest cached prefix wins, then the least-loaded worker (ties rotate).
   Reasons: `affinity` (the winner holds the longest prefix any candidate holds), `cost` (another
   holds a longer one, but waiting there would take longer), `no_match` (no candidate holds any).
   Without a cache owner, the candidate that served the request's session last (its session key:
   gateway/routing/features.py `session_hint`) wins if it is among the tied: reason `session`.

Parameters (gateway/config.py `TtftCostParams`): `prior_rate` (tokens/s, default 10,000),
`min_rate` / `max_rate` (tokens/s, 100 / 1,000,000), `half_life_s` (seconds, 30), `prior_tokens`
(tokens, 4,096), `request_tokens` (tokens, 1,024), `tie_tolerance` (fraction, 0.1),
`prefix_value` (multiples of the owner's prefix prefill time, 20), `stay_s` (seconds, 0),
`owner_min_tokens` (tokens, 1,024: a short shared system prompt makes no owner), `base_ttft_s`
(seconds, 0).
"""

from __future__ import annotations

from gateway.config import TtftCostParams
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, TieBreaker
from gateway.routing.prefill import PrefillModel


class TtftCostPolicy:
    """Lowest predicted TTFT wins; near-ties go to the longest cached prefix."""

    name = "ttft_cost"
    uses_affinity = True
    Params = TtftCostParams

    def __init__(self, params: TtftCostParams | None = None) -> None:
        self.params = params or TtftCostParams()
        self.prefill_model: PrefillModel | None = PrefillModel(self.params)
        self._ties = TieBreaker()

    def predicted_ttft(self, request: RoutingRequest, candidate: Candidate) -> float:
        """Seconds to the first token on `candidate` (without `base_ttft_s`, the same everywhere)."""
        uncached = request.prompt_tokens - candidate.matched_tokens
        work = candidate.queued_tokens + (uncached if uncached > 0 else 0)
        return work / (candidate.prefill_rate or self.params.prior_rate)

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        p = self.params
        predicted = [self.predicted_ttft(request, c) for c in candidates]
        lowest = min(predicted)
        owner = max(range(len(candidates)), key=lambda i: candidates[i].matched_tokens)
        held = candidates[owner].matched_tokens
        if held >= max(p.owner_min_tokens, 1):
            keep = p.stay_s + p.prefix_value * held / (candidates[owner].prefill_rate or p.prior_rate)
            if predicted[owner] <= lowest + keep:
                return Decision(candidates[owner].worker, "affinity")
        limit = lowest * (1.0 + p.tie_tolerance)
        if held < max(p.owner_min_tokens, 1):  # no cache owner: the session's worker, if its wait ties the best
            for candidate, seconds in zip(candidates, predicted, strict=True):
                if candidate.session and seconds <= limit:
                    return Decision(candidate.worker, "session")
        best: list[Candidate] = []
        best_match = -1
        longest = 0
        for candidate, seconds in zip(candidates, predicted, strict=True):
            matched = candidate.matched_tokens
            longest = max(longest, matched)
            if seconds > limit or matched < best_match:
                continue
            if matched > best_match:
                best_match, best = matched, [candidate]
            else:
                best.append(candidate)
        chosen = best[0] if len(best) == 1 else self._ties.least_loaded(best)
        if longest <= 0:
            return Decision(chosen.worker, "no_match")
        return Decision(chosen.worker, "affinity" if chosen.matched_tokens >= longest else "cost")
