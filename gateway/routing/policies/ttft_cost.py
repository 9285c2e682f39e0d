"""ttft_cost: the candidate with the lowest cost, its predicted time to first token plus what its
prefill costs the requests already decoding there, with a hysteresis that keeps a conversation on
its cache owner.

Algorithm: for each candidate, with U the request's uncached tokens there (the estimated prompt
tokens minus the prefix the worker holds per the affinity store, `matched_tokens`) and R the
worker's prefill rate (tokens/s), the cost in seconds is
    predicted TTFT     (queued prefill tokens on the worker + U) / R
  + chunk interference `decode_weight` x (requests decoding there) x U / R
  + prefill balance    `balance_weight` x (uncached tokens this replica sent the worker lately
                       - the least any candidate was sent) / R
The queued tokens are this replica's requests there still in prefill plus the other requests its
engine reports, in tokens (each at this replica's mean request there, or to the pool for a worker
it sent nothing yet); the decoding requests are its load less its waiting requests and this
replica's requests in prefill; "lately" decays with `recent_half_life_s`; the rate is learned per
worker from observed TTFTs, bounded and decaying to the pool's rate (all estimated in
gateway/routing/prefill.py and handed in on each `Candidate` by the dispatch).

Why the last two terms: an engine with chunked prefill (vLLM's `max_num_batched_tokens`, SGLang's
`chunked_prefill_size`) runs each prefill chunk in the same step as its running requests' decodes,
so a step with a full chunk is a prefill chunk's time long for every decoding request there: U / R
seconds of prefill slow each of them by about that much. Sending each request where it starts
soonest piles prefill on a few workers at low load (their decodes carry the chunks) and never
gives a worker that looks a little slower a request to show otherwise; the balance term makes a
worker's recent prefill beyond the least-fed one's cost its own time, so every healthy worker
gets traffic (a constant offset in what the engines report, the same on every worker, changes no
choice) and prefill evens out (loadtest/README.md, "Prefill balance and chunk interference").

1. Cache owner first: the candidate with the longest match (at least `owner_min_tokens`) keeps the
   request while its cost exceeds the lowest by no more than
   `stay_s` + `prefix_value` x (its matched tokens / its rate), reason `affinity`. Moving a
   conversation recomputes its prefix elsewhere (in this request's prediction) and also leaves the
   owner's copy unused for its later turns and fills a second cache with it: on the trace replay,
   moving whenever the prediction was lower cost a quarter of the hit ratio (0.19 vs 0.26 in the
   virtual-time evaluator), which the later turns paid for in prefill work; with `prefix_value` 20
   the hit ratio matches SGLang's cache_aware (loadtest/README.md, "TTFT-aware policy").
2. Otherwise the lowest cost wins; costs within `tie_tolerance` of it count as equal,
   and among those the longest cached prefix wins, then the least-loaded worker (ties rotate).
   Reasons: `affinity` (the winner holds the longest prefix any candidate holds), `cost` (another
   holds a longer one, but waiting there would take longer), `no_match` (no candidate holds any).
   Without a cache owner, the candidate that served the request's session last (its session key:
   gateway/routing/features.py `session_hint`) wins if it is among the tied: reason `session`.

Parameters (`TtftCostParams` below): `prior_rate` (tokens/s, default 10,000),
`min_rate` / `max_rate` (tokens/s, 100 / 1,000,000), `half_life_s` (seconds, 30), `prior_tokens`
(tokens, 4,096), `request_tokens` (tokens, 1,024), `tie_tolerance` (fraction, 0.1),
`prefix_value` (multiples of the owner's prefix prefill time, 20), `stay_s` (seconds, 0),
`owner_min_tokens` (tokens, 1,024: a short shared system prompt makes no owner), `base_ttft_s`
(seconds, 0), `decode_weight` (per decoding request, 0.1), `balance_weight` (0.5),
`recent_half_life_s` (seconds, 2).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.config_base import Section
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, TieBreaker
from gateway.routing.prefill import PrefillModel


class TtftCostParams(Section):
    """`policy_params` of `ttft_cost` (gateway/routing/policies/ttft_cost.py; the rate estimate:
    gateway/routing/prefill.py). Tokens are the gateway's estimated prompt tokens."""

    prior_rate: float = Field(
        default=10_000.0, gt=0, description="tokens/s; a worker's prefill rate before (and long after) any "
        "observation: an order of magnitude for one 8-GPU node of a large MoE model, replaced by measurement")
    min_rate: float = Field(default=100.0, gt=0, description="tokens/s; the estimate never goes below")
    max_rate: float = Field(default=1_000_000.0, gt=0, description="tokens/s; ...nor above")
    half_life_s: float = Field(
        default=30.0, gt=0, description="seconds after which an observation counts half: the estimate follows "
        "a worker that slows down or recovers, and one that gets no traffic returns to its pool's rate (a pool "
        "with none to `prior_rate`)")
    prior_tokens: float = Field(
        default=4096.0, gt=0, description="tokens; the prior weighs as much as this much prefill observed at "
        "`prior_rate`")
    request_tokens: float = Field(
        default=1024.0, ge=0, description="tokens of prefill work one engine-reported request that this replica "
        "did not send stands for, until this replica's own requests to the worker give a mean")
    tie_tolerance: float = Field(
        default=0.1, ge=0, description="costs within this fraction of the lowest are equal; among them "
        "the longest cached prefix wins")
    prefix_value: float = Field(
        default=20.0, ge=0, description="the cache owner (longest match) keeps the request while its cost "
        "exceeds the lowest by less than this many times the owner's prefill time of the matched prefix "
        "(plus `stay_s`): moving recomputes the prefix elsewhere and leaves the owner's copy unused")
    stay_s: float = Field(default=0.0, ge=0, description="seconds of predicted TTFT the cache owner may exceed "
                          "the lowest by and keep the request (with `prefix_value`)")
    owner_min_tokens: int = Field(
        default=1024, ge=0, description="tokens; a shorter longest match makes no cache owner for `stay_s` and "
        "`prefix_value` (a system prompt shared by all must not pin traffic)")
    base_ttft_s: float = Field(
        default=0.0, ge=0, description="seconds of every TTFT that no prefill explains (network, scheduling, "
        "the first decode step), taken off each observation before the rate is fitted")
    decode_weight: float = Field(
        default=0.1, ge=0, description="seconds of cost per second of the request's own prefill (at the worker's "
        "rate) and per request decoding on the worker: the decode steps its prefill chunks lengthen")
    balance_weight: float = Field(
        default=0.5, ge=0, description="seconds of cost per second of prefill (at the worker's rate) that this "
        "replica sent the worker lately beyond what it sent the least-fed candidate: prefill evens out, and no "
        "healthy worker is left without traffic")
    recent_half_life_s: float = Field(
        default=2.0, gt=0, description="seconds after which a token sent to a worker counts half in its recent "
        "prefill (`balance_weight`)")

    @model_validator(mode="after")
    def _ordered(self) -> TtftCostParams:
        if not self.min_rate <= self.prior_rate <= self.max_rate:
            raise ValueError("want min_rate <= prior_rate <= max_rate")
        return self


class TtftCostPolicy:
    """Lowest cost (predicted TTFT, chunk interference, prefill balance) wins; near-ties go to the
    longest cached prefix."""

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

    def cost(self, request: RoutingRequest, candidate: Candidate, least_recent: float) -> float:
        """Seconds (see the module docstring): the predicted TTFT, plus `decode_weight` x the
        decoding requests there x the request's own prefill time, plus `balance_weight` x the
        prefill time of what this replica sent the worker lately beyond `least_recent` (tokens,
        the least any candidate was sent)."""
        p = self.params
        rate = candidate.prefill_rate or p.prior_rate
        uncached = max(request.prompt_tokens - candidate.matched_tokens, 0)
        return ((candidate.queued_tokens + uncached * (1.0 + p.decode_weight * candidate.decoding)
                 + p.balance_weight * (candidate.recent_tokens - least_recent)) / rate)

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        p = self.params
        least_recent = min(c.recent_tokens for c in candidates)
        costs = [self.cost(request, c, least_recent) for c in candidates]
        lowest = min(costs)
        owner = max(range(len(candidates)), key=lambda i: candidates[i].matched_tokens)
        held = candidates[owner].matched_tokens
        if held >= max(p.owner_min_tokens, 1):
            keep = p.stay_s + p.prefix_value * held / (candidates[owner].prefill_rate or p.prior_rate)
            if costs[owner] <= lowest + keep:
                return Decision(candidates[owner].worker, "affinity")
        limit = lowest * (1.0 + p.tie_tolerance)
        if held < max(p.owner_min_tokens, 1):  # no cache owner: the session's worker, if its wait ties the best
            for candidate, seconds in zip(candidates, costs, strict=True):
                if candidate.session and seconds <= limit:
                    return Decision(candidate.worker, "session")
        best: list[Candidate] = []
        best_match = -1
        longest = 0
        for candidate, seconds in zip(candidates, costs, strict=True):
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
