"""ttft_cost: the policy's choices from predicted TTFTs, and the per-worker prefill estimate
(queued tokens, learned rate) it is fed with. No sockets: synthetic candidates and a synthetic clock."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
from pydantic import ValidationError

from gateway.backends.capacity import PoolGate
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dispatch.steps import decide, prefill_ticket
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.features import RoutingRequest
from gateway.routing.policies.ttft_cost import TtftCostParams
from gateway.routing.policy import Candidate
from gateway.routing.prefill import PrefillEstimator, PrefillModel, WorkerPrefill
from gateway.routing.registry import build_policy
from gateway.streaming import Holding

PROMPT = 10_000
REQUEST = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=PROMPT, output_tokens=None, stream=True,
                         modalities=frozenset({"text"}), estimate_method="bytes")


def worker(i: int) -> Worker:
    return Worker("p", i, f"http://w{i}:1", ENGINES["vllm"])


def candidate(i: int, queued: float = 0.0, rate: float = 10_000.0, matched: int = 0, load: float = 0.0) -> Candidate:
    """Worker w<i> with `queued` tokens ahead, a prefill `rate` (tokens/s) and `matched` cached tokens."""
    return Candidate(worker(i), load, None, matched / PROMPT, matched, queued, rate)


def choice(candidates: list[Candidate], params: dict[str, object] | None = None) -> tuple[int, str]:
    decision = build_policy("ttft_cost", params).select(REQUEST, candidates)
    return decision.worker.index, decision.reason


# -- the policy ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("candidates", "params", "expected"), [
    pytest.param([candidate(0, queued=20_000), candidate(1, rate=5_000)], {}, (1, "no_match"),
                 id="lower predicted TTFT: 3 s on a busy fast worker vs 2 s on an idle slow one"),
    pytest.param([candidate(0, queued=5_000), candidate(1, rate=5_000)], {}, (0, "no_match"),
                 id="...and the other way round: 1.5 s vs 2 s"),
    pytest.param([candidate(0, queued=3_000), candidate(1, queued=3_000, matched=8_000)], {}, (1, "affinity"),
                 id="equal queues: the long cache match wins"),
    pytest.param([candidate(0, matched=9_000, queued=50_000), candidate(1)], {"prefix_value": 0}, (1, "cost"),
                 id="a heavily queued cache owner loses to an idle worker: 5.1 s of wait vs 1 s of recompute"),
    pytest.param([candidate(0, matched=9_000, queued=200_000), candidate(1)], {}, (1, "cost"),
                 id="by default once the extra wait passes 20 x the prefix's prefill: 20.1 s vs 1 s + 18 s"),
    pytest.param([candidate(0, matched=9_000, queued=5_000), candidate(1)], {}, (0, "affinity"),
                 id="a lightly queued cache owner keeps its prefix: 0.6 s vs 1 s"),
    pytest.param([candidate(0, matched=500), candidate(1, rate=11_000)], {}, (0, "affinity"),
                 id="within the tie tolerance the cache owner wins: 0.95 s vs 0.91 s"),
    pytest.param([candidate(0, matched=500), candidate(1, rate=12_000)], {}, (1, "cost"),
                 id="beyond the tolerance it does not: 0.95 s vs 0.83 s"),
    pytest.param([candidate(0, matched=500), candidate(1, rate=12_000)], {"tie_tolerance": 0.2}, (0, "affinity"),
                 id="a wider tolerance keeps it"),
    pytest.param([candidate(0, rate=0.0, queued=5_000), candidate(1, rate=0.0)], {}, (1, "no_match"),
                 id="a candidate without a rate is costed at the prior"),
])
def test_ttft_cost_choices(candidates: list[Candidate], params: dict[str, object],
                           expected: tuple[int, str]) -> None:
    assert choice(candidates, params) == expected


@pytest.mark.parametrize(("params", "expected"), [
    pytest.param({"prefix_value": 0}, (1, "cost"), id="no hysteresis: 5.1 s on the owner vs 1 s elsewhere moves"),
    pytest.param({"prefix_value": 4}, (1, "cost"),
                 id="4 x the prefix's 0.9 s of prefill: 5.1 s is beyond 1 s + 3.6 s, it moves"),
    pytest.param({"prefix_value": 5}, (0, "affinity"), id="5 x: within 1 s + 4.5 s, the owner keeps it"),
    pytest.param({"prefix_value": 0, "stay_s": 4.2}, (0, "affinity"), id="4.2 s of stay: within"),
    pytest.param({"prefix_value": 0, "stay_s": 4.0}, (1, "cost"), id="4.0 s of stay: beyond"),
])
def test_the_cache_owner_keeps_a_request_within_its_hysteresis(params: dict[str, object],
                                                                 expected: tuple[int, str]) -> None:
    assert choice([candidate(0, matched=9_000, queued=50_000), candidate(1)], params) == expected


def test_a_match_below_owner_min_tokens_makes_no_owner() -> None:
    # The shared 900 tokens would be any conversation's (a system prompt): no hysteresis for them.
    cands = [candidate(0, matched=900, queued=20_000), candidate(1)]
    assert choice(cands, {"stay_s": 100.0}) == (1, "cost")
    assert choice(cands, {"stay_s": 100.0, "owner_min_tokens": 500}) == (0, "affinity")


def test_idle_equal_workers_share_the_work_in_rotation() -> None:
    policy = build_policy("ttft_cost")
    candidates = [candidate(i) for i in range(3)]
    assert Counter(policy.select(REQUEST, candidates).worker.index for _ in range(30)) == {0: 10, 1: 10, 2: 10}


def test_a_hot_prefix_moves_on_once_its_owners_queue_outweighs_the_recompute() -> None:
    # Every request shares 9,000 of its 10,000 tokens with w0's cache; each request sent adds its
    # uncached tokens to its worker's queue (nothing finishes). w0 takes requests while its queue
    # costs less than recomputing the 9,000 tokens elsewhere; then the others get them too.
    policy = build_policy("ttft_cost", {"prefix_value": 0})
    queued = [0.0, 0.0, 0.0]
    sent = Counter[int]()
    for _ in range(30):
        cands = [candidate(0, queued=queued[0], matched=9_000), candidate(1, queued=queued[1]),
                 candidate(2, queued=queued[2])]
        index = policy.select(REQUEST, cands).worker.index
        queued[index] += PROMPT - cands[index].matched_tokens
        sent[index] += 1
    assert sent[0] >= 10 and sent[1] > 0 and sent[2] > 0
    others = min(queued[1], queued[2]) + PROMPT  # the next request's work on the better other worker
    assert queued[0] + 1_000 <= others * 1.1 + 1_000  # w0's queue never ran past the tolerance
def test_params_are_validated() -> None:
    with pytest.raises(ValidationError, match="min_rate <= prior_rate <= max_rate"):
        build_policy("ttft_cost", {"prior_rate": 50.0})
    with pytest.raises(ValidationError):
        build_policy("ttft_cost", {"half_life_s": 0})
    with pytest.raises(ValueError, match="for policy ttft_cost"):
        PoolConfig.model_validate({"name": "p", "engine": "vllm", "workers": ["http://w:1"],
                                   "max_context_tokens": 1000, "policy": "ttft_cost",
                                   "policy_params": {"tie_tolerance": -1}})


# -- the rate estimate -----------------------------------------------------------------------------------

def model(**params: float) -> PrefillModel:
    return PrefillModel(TtftCostParams.model_validate(params))


def feed(m: PrefillModel, state: WorkerPrefill, rate: float, start: float, count: int,
         base: float = 0.0, every: float = 0.5, seed: int = 1) -> float:
    """`count` observations of prompts of 500..20,000 tokens at `rate` tokens/s (plus `base`
    seconds), one every `every` seconds from `start`; returns the time of the last."""
    rng = random.Random(seed)
    now = start
    for _ in range(count):
        work = rng.uniform(500, 20_000)
        now += every
        m.observe(state, work, base + work / rate, now)
    return now


def test_the_rate_is_the_prior_before_any_observation() -> None:
    assert model(prior_rate=7_000).rate(WorkerPrefill(), 123.0) == 7_000


@pytest.mark.parametrize("true_rate", [800.0, 3_000.0, 60_000.0])
def test_the_rate_converges_to_the_workers_true_rate(true_rate: float) -> None:
    m, state = model(), WorkerPrefill()
    now = feed(m, state, true_rate, 0.0, 100)
    # within 5 %: the prior (4,096 tokens at 10,000 tokens/s: 0.4 s) still weighs a little against
    # the ~10 s of decayed prefill time a fast worker shows here
    assert m.rate(state, now) == pytest.approx(true_rate, rel=0.05)


def test_a_known_fixed_latency_is_taken_off_before_fitting() -> None:
    state, with_base, without = WorkerPrefill(), model(base_ttft_s=0.5), model()
    now = feed(with_base, state, 3_000.0, 0.0, 100, base=0.5)
    assert with_base.rate(state, now) == pytest.approx(3_000.0, rel=0.02)
    biased = WorkerPrefill()
    now = feed(without, biased, 3_000.0, 0.0, 100, base=0.5)
    assert without.rate(biased, now) < 2_800.0  # unaccounted latency reads as a slower prefill


def test_the_rate_follows_a_worker_that_slows_down() -> None:
    m, state = model(half_life_s=10.0), WorkerPrefill()
    now = feed(m, state, 20_000.0, 0.0, 60)
    now = feed(m, state, 2_000.0, now, 60, seed=2)  # 30 s = 3 half-lives later
    assert m.rate(state, now) == pytest.approx(2_000.0, rel=0.15)


def test_the_rate_stays_within_its_bounds() -> None:
    bounds = {"min_rate": 500.0, "max_rate": 50_000.0, "prior_rate": 5_000.0}
    m_fast, m_slow = model(**bounds), model(**bounds)
    fast, slow = WorkerPrefill(), WorkerPrefill()
    now = feed(m_fast, fast, 1e9, 0.0, 50)
    feed(m_slow, slow, 1.0, 0.0, 50)
    assert m_fast.rate(fast, now) == 50_000.0 == m_fast.pool_rate(now)
    assert m_slow.rate(slow, now) == 500.0 == m_slow.pool_rate(now)


def test_an_unobserved_worker_returns_to_its_pools_rate_not_the_prior() -> None:
    # The prior (10,000 tokens/s) is 8x below the pool's engines: a worker whose samples aged must
    # look like its pool again, or it would look slow, get no traffic and never be measured again.
    m, quiet, busy = model(prior_rate=10_000.0, half_life_s=30.0), WorkerPrefill(), WorkerPrefill()
    now = feed(m, quiet, 60_000.0, 0.0, 40)
    measured_at = now
    now = feed(m, busy, 80_000.0, now, 400, every=1.5)
    assert m.rate(quiet, measured_at) == pytest.approx(60_000.0, rel=0.05)
    pool = m.pool_rate(now)  # ~72,000: busy's 80,000 pulled a little toward the prior's pseudo-sample
    assert 60_000.0 < pool < 80_000.0
    assert m.rate(quiet, now) == pytest.approx(pool, rel=0.01)  # 600 s later: the pool's, not 10,000


def test_an_unobserved_pool_decays_back_to_the_prior() -> None:
    m, state = model(prior_rate=10_000.0, half_life_s=30.0), WorkerPrefill()
    now = feed(m, state, 1_000.0, 0.0, 40)
    measured = m.rate(state, now)
    assert measured == pytest.approx(1_000.0, rel=0.05)
    later = [m.rate(state, now + t) for t in (30.0, 60.0, 120.0, 600.0)]
    assert measured < later[0] < later[1] < later[2] < later[3]  # steadily back toward the prior
    assert later[3] == pytest.approx(10_000.0, rel=0.005)


def test_observations_without_time_beyond_the_fixed_latency_are_skipped() -> None:
    m, state = model(base_ttft_s=0.1), WorkerPrefill()
    m.observe(state, 5_000.0, 0.05, 1.0)
    assert (state.tokens, state.seconds) == (0.0, 0.0)


# -- queued work and tickets -----------------------------------------------------------------------------

def test_a_ticket_counts_its_uncached_tokens_until_the_first_byte_then_feeds_the_rate() -> None:
    m, estimator, w = model(prior_tokens=1.0), PrefillEstimator(), worker(0)
    first = estimator.start(w, m, 4_000.0, observe=True, now=10.0)
    second = estimator.start(w, m, 6_000.0, observe=True, now=10.0)
    state = estimator.of(w)
    assert state.pending == 10_000.0
    first.first_byte(10.5)  # 4,000 tokens in 0.5 s
    assert state.pending == 6_000.0
    assert m.rate(state, 10.5) == pytest.approx(8_000.0, rel=0.01)
    first.close()  # after its first byte, releasing the slot changes nothing
    assert state.pending == 6_000.0
    second.close()  # failed before its first byte: no longer pending, nothing observed
    second.first_byte(99.0)
    assert state.pending == 0.0 and state.tokens == pytest.approx(4_000.0)


def test_a_non_streamed_requests_first_byte_releases_it_without_an_observation() -> None:
    m, estimator, w = model(), PrefillEstimator(), worker(0)
    estimator.start(w, m, 4_000.0, observe=False, now=1.0).first_byte(9.0)
    assert (estimator.of(w).pending, estimator.of(w).seconds) == (0.0, 0.0)


def test_queued_work_counts_other_replicas_requests_at_this_replicas_mean_request() -> None:
    m, estimator, w = model(request_tokens=1_000.0), PrefillEstimator(), worker(0)
    state = estimator.of(w)
    w.engine_running, w.engine_waiting, w.in_flight_at_scrape = 2.0, 1.0, 0
    assert estimator.queued(w, state, m, w.load()) == 3 * 1_000.0  # nothing of ours seen yet: request_tokens
    estimator.start(w, m, 2_000.0, observe=True, now=0.0)
    w.in_flight = 1  # our request, not yet in the scraped figures
    assert estimator.queued(w, state, m, w.load()) == 2_000.0 + 3 * 2_000.0


def test_a_released_lease_closes_its_ticket_and_a_gone_worker_is_forgotten() -> None:
    m, estimator, w = model(), PrefillEstimator(), worker(0)
    gate = PoolGate(PoolConfig.model_validate({"name": "p", "engine": "vllm", "workers": ["http://w0:1"],
                                               "max_context_tokens": 1000}))
    holding = Holding()
    holding.lease(w, GatewayMetrics(), gate, prefill=estimator.start(w, m, 3_000.0, observe=True, now=0.0))
    assert estimator.of(w).pending == 3_000.0
    asyncio.run(holding.aclose())  # the attempt failed, or its client left, before the first byte
    assert estimator.of(w).pending == 0.0
    estimator.worker_gone(w)
    assert len(estimator) == 0


def test_decide_feeds_the_estimate_and_a_sent_request_steers_the_next_one() -> None:
    # The queue alone (the balance term, which the tickets feed too, is tested on its own below).
    policy, estimator = build_policy("ttft_cost", {"balance_weight": 0}), PrefillEstimator()
    model_ = policy.prefill_model
    assert model_ is not None
    a, b = worker(0), worker(1)
    # a measured fast and b slow just now (decide reads the rates at time.perf_counter())
    now = time.perf_counter()
    model_.observe(estimator.of(a), 50_000.0, 1.0, now)
    model_.observe(estimator.of(b), 50_000.0, 25.0, now)
    rate_a, rate_b = model_.rate(estimator.of(a), now), model_.rate(estimator.of(b), now)
    assert rate_a > 10 * rate_b
    first = decide(policy, REQUEST, [a, b], {}, estimator)
    assert first.worker is a
    ticket = prefill_ticket(estimator, policy, REQUEST, a, {})
    assert ticket is not None and estimator.of(a).pending == PROMPT
    # the queue that makes a as slow as b (b's wait for the prompt, at a's rate), less 10,000 tokens...
    even = PROMPT / rate_b * rate_a - PROMPT
    estimator.start(a, model_, even - 2 * PROMPT, observe=True, now=0.0)
    assert decide(policy, REQUEST, [a, b], {}, estimator).worker is a
    # ...and 10,000 more
    estimator.start(a, model_, 2 * PROMPT, observe=True, now=0.0)
    assert decide(policy, REQUEST, [a, b], {}, estimator).worker is b
    assert prefill_ticket(estimator, build_policy("least_load"), REQUEST, a, {}) is None


# -- chunk interference, prefill balance, engines' constant offsets (issue 37 item 16) ------------------

def test_a_prefill_costs_the_requests_decoding_there() -> None:
    # Equal idle workers, w0 with 20 requests decoding: 1 s of prefill there lengthens 20 decodes'
    # steps (cost 1 + 0.1 x 20 = 3 s against 1 s).
    busy = Candidate(worker(0), 20.0, None, 0.0, 0, 0.0, 10_000.0, decoding=20.0)
    assert choice([busy, candidate(1, load=20.0)]) == (1, "no_match")
    # ...unless the weight is 0: a tie, and the least loaded wins.
    assert choice([busy, candidate(1, load=21.0)], {"decode_weight": 0}) == (0, "no_match")


def test_prefill_sent_lately_beyond_the_least_fed_worker_costs_its_time() -> None:
    fed = Candidate(worker(0), 0.0, None, 0.0, 0, 0.0, 10_000.0, recent_tokens=50_000.0)
    assert choice([fed, candidate(1)]) == (1, "no_match")  # 1 s + 0.5 x 5 s against 1 s
    # What every candidate was sent alike costs nothing: a tie, in rotation.
    even = [Candidate(worker(i), 0.0, None, 0.0, 0, 0.0, 10_000.0, recent_tokens=50_000.0) for i in range(2)]
    policy = build_policy("ttft_cost")
    assert Counter(policy.select(REQUEST, even).worker.index for _ in range(4)) == {0: 2, 1: 2}
    # A cache owner keeps its conversation while the balance costs less than the prefix is worth.
    owner = Candidate(worker(0), 0.0, None, 0.9, 9_000, 0.0, 10_000.0, recent_tokens=50_000.0)
    assert choice([owner, candidate(1)]) == (0, "affinity")


def test_recent_prefill_decays_with_its_half_life() -> None:
    m, estimator, w = model(recent_half_life_s=2.0), PrefillEstimator(), worker(0)
    estimator.start(w, m, 8_000.0, observe=False, now=10.0)
    state = estimator.of(w)
    assert m.recent(state, 10.0) == pytest.approx(8_000.0)
    assert m.recent(state, 12.0) == pytest.approx(4_000.0)
    estimator.start(w, m, 1_000.0, observe=False, now=12.0)
    assert m.recent(state, 14.0) == pytest.approx(2_500.0)
    assert m.recent(state, 11.0) == pytest.approx(5_000.0)  # a clock read before the last send: no decay


def test_another_replicas_requests_on_a_worker_not_yet_used_cost_the_pools_mean() -> None:
    # A worker this replica sent nothing yet prices an engine-reported request like its peers do
    # (the pool's mean), not at `request_tokens`: a constant offset in the engines' figures is the
    # same on every worker.
    m, estimator, used, unused = model(request_tokens=1_000.0), PrefillEstimator(), worker(0), worker(1)
    estimator.start(used, m, 200.0, observe=False, now=0.0).close()
    for w in (used, unused):
        w.engine_running, w.engine_waiting, w.in_flight_at_scrape = 1.0, 0.0, 0
    assert estimator.queued(unused, estimator.of(unused), m, unused.load()) == 200.0
    assert estimator.queued(used, estimator.of(used), m, used.load()) == 200.0


def test_decoding_requests_are_the_load_less_waiting_and_this_replicas_prefills() -> None:
    m, estimator, w = model(), PrefillEstimator(), worker(0)
    w.engine_running, w.engine_waiting, w.in_flight_at_scrape = 6.0, 2.0, 0
    estimator.start(w, m, 500.0, observe=False, now=0.0)
    w.in_flight = 1  # ours, in prefill, not yet in the scraped figures
    assert estimator.decoding(w, estimator.of(w), w.load()) == 9.0 - 2.0 - 1.0
    prefill_worker = Worker("pd", 0, "http://p0:1", ENGINES["vllm"], role="prefill")
    prefill_worker.engine_running = 6.0
    assert estimator.decoding(prefill_worker, estimator.of(prefill_worker), prefill_worker.load()) == 0.0


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_every_worker_gets_traffic_one_request_at_a_time(offset: float) -> None:
    """Three equal workers faster than the prior rate, one short request at a time (each done
    before the next), each engine reporting `offset` requests more than it runs (one that counts
    its own metrics scrape). The worker that took the first request is measured fast at once, and
    the others, never measured, stay at the slower pool rate: without the balance every request
    would go to the first. With it each gets a share."""
    policy, estimator = build_policy("ttft_cost"), PrefillEstimator()
    model_ = policy.prefill_model
    assert model_ is not None
    workers = [worker(i) for i in range(3)]
    for w in workers:
        w.engine_running, w.engine_waiting, w.in_flight_at_scrape = offset, 0.0, 0
    short = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=100, output_tokens=2, stream=True,
                           modalities=frozenset({"text"}), estimate_method="bytes")
    served = Counter[int]()
    for _ in range(60):
        chosen = decide(policy, short, workers, {}, estimator).worker
        served[chosen.index] += 1
        now = time.perf_counter()
        ticket = estimator.start(chosen, model_, 100.0, observe=True, now=now)
        ticket.first_byte(now + 0.004)  # 25,000 tokens/s of the request's own prefill
        ticket.close()
    assert min(served[i] for i in range(3)) >= 10, served
