"""Prefill work queued on each worker and each worker's prefill rate, for the cost-aware policy
(`policies/ttft_cost.py`).

Units: tokens are the gateway's estimated prompt tokens (`routing/tokens.py`; an estimate that is
off by a constant factor only rescales every rate), times `time.perf_counter()` seconds, rates
tokens/s.

Queued prefill work on a worker (tokens, `PrefillEstimator.queued`): the uncached prompt tokens of
this replica's requests sent there whose first byte has not come back yet (`pending`), plus the
requests its engine reports beyond this replica's in-flight ones (other replicas' requests: scraped
running + waiting, `Worker.load()`, minus `in_flight`) times the mean uncached tokens of this
replica's requests to it (`mean_request`: a moving average over about the last 16), or, for a worker
this replica sent nothing yet, of its requests to the pool (`PrefillModel.mean_request`; the
policy's `request_tokens` before any). So a constant offset in what every engine reports (an engine
that counts its own metrics scrape as running) costs every worker alike. This replica's requests
that already streamed their first token are decoding: they add no prefill work.

Decoding requests on a worker (`PrefillEstimator.decoding`): its load less the engine's waiting
requests and this replica's requests still in prefill there (what a prefill chunk sent there slows
down). Recent prefill (`PrefillModel.recent`, tokens): the uncached tokens this replica sent the
worker, decayed with the policy's `recent_half_life_s` (the policy's prefill balance).

Prefill rate (tokens/s, `PrefillModel.rate`), learned online: a streamed request whose first byte
came T seconds after it was sent, with W0 tokens queued ahead of it and U uncached tokens of its
own, says the worker prefilled W = W0 + U tokens in T - `base_ttft_s` seconds (the model
TTFT ≈ base + (queued + uncached) / rate). The estimate is a ratio of time-decayed sums, with the
pool's rate as one pseudo-observation that never decays:

    rate = (Σ d·W + prior_tokens) / (Σ d·(T - base) + prior_tokens / pool_rate),  d = 2^(-age / half_life_s)
    pool_rate = (Σ_pool d·W + prior_tokens) / (Σ_pool d·(T - base) + prior_tokens / prior_rate)

clamped to [min_rate, max_rate], where Σ_pool sums the observations of every worker of the policy's
pool. A ratio of sums weighs long prefills most (a short one is mostly fixed latency); the decay
lets it follow a worker that slows down, and brings a worker that gets no traffic back to its
pool's rate, so a worker once measured slow is tried again. (Back to the fixed `prior_rate`
instead, a worker an order of magnitude faster than the prior looked slow as soon as its samples
aged, got no more traffic and so no new samples: the replay's first live run left two of eight
workers with 2-5 % of the prefill work.) State: five floats
per worker (and the recent prefill's two, the pending count), dropped when the worker leaves its
pool (`worker_gone`); no history is kept.

Assumed engine: one prefill rate shared by its queue, served first come first served (vLLM's
FCFS scheduler with chunked prefill; SGLang's default longest-prefix-first order reorders it).
Decoding requests are not costed: their share of the engine's steps shows in the learned rate.
An engine that prefills requests side by side at a per-request speed (the replay simulator's
`max_num_seqs` slots before issue 14) breaks the model: work ahead does not delay a request
there, so its samples read faster the more is queued, and traffic herds onto such a worker.
"""

from __future__ import annotations

import math
from typing import Protocol

from gateway.backends.worker import Worker


class PrefillParams(Protocol):
    """The parameters a `PrefillModel` reads (`TtftCostParams` of gateway/routing/policies/ttft_cost.py):
    rates in tokens/s, `half_life_s` and `base_ttft_s` in seconds, the token weights in tokens."""

    @property
    def prior_rate(self) -> float: ...
    @property
    def min_rate(self) -> float: ...
    @property
    def max_rate(self) -> float: ...
    @property
    def half_life_s(self) -> float: ...
    @property
    def prior_tokens(self) -> float: ...
    @property
    def request_tokens(self) -> float: ...
    @property
    def base_ttft_s(self) -> float: ...
    @property
    def recent_half_life_s(self) -> float: ...

MEAN_REQUEST_WEIGHT = 1.0 / 16.0
"""Weight of the newest request in `WorkerPrefill.mean_request` (a mean over about 16 requests)."""


class WorkerPrefill:
    """One worker's prefill state: `pending` tokens of this replica's requests still in prefill
    (`pending_requests` of them), `mean_request` tokens per request (< 0: none seen yet), `tokens`
    and `seconds` the decayed sums of observed prefill work and time as of `at` (perf_counter
    seconds), `sent` the decayed sum of uncached tokens sent to it as of `sent_at`."""

    __slots__ = ("at", "mean_request", "pending", "pending_requests", "seconds", "sent", "sent_at", "tokens")

    def __init__(self) -> None:
        self.pending = 0.0
        self.pending_requests = 0
        self.mean_request = -1.0
        self.tokens = 0.0
        self.seconds = 0.0
        self.at = 0.0
        self.sent = 0.0
        self.sent_at = 0.0


class PrefillModel:
    """How a pool's rates are estimated (`PrefillParams`: the policy's validated `TtftCostParams`):
    the prior, its weight, the bounds, the decay and the fixed latency. Built once per policy
    instance; shared by the policy's candidates and its requests' observations."""

    __slots__ = ("base_s", "max_rate", "min_rate", "per_second", "pool", "prior_rate", "prior_seconds",
                 "prior_tokens", "recent_per_second", "request_tokens")

    def __init__(self, params: PrefillParams) -> None:
        self.prior_rate = params.prior_rate
        self.min_rate = params.min_rate
        self.max_rate = params.max_rate
        self.per_second = math.log(2.0) / params.half_life_s  # decay constant, 1/s
        self.prior_tokens = params.prior_tokens
        self.prior_seconds = params.prior_tokens / params.prior_rate
        self.request_tokens = params.request_tokens
        self.base_s = params.base_ttft_s
        self.recent_per_second = math.log(2.0) / params.recent_half_life_s
        self.pool = WorkerPrefill()
        """Every observation of the pool's workers, decayed alike: the prior each worker returns to."""

    def rate(self, state: WorkerPrefill, now: float) -> float:
        """The worker's prefill rate at `now` (tokens/s), within [min_rate, max_rate]: its own decayed
        observations plus `prior_tokens` of work at the pool's rate (`pool_rate`)."""
        pool = self.pool_rate(now)
        if not state.seconds:
            return pool
        decay = math.exp(-self.per_second * (now - state.at))
        rate = (state.tokens * decay + self.prior_tokens) / (state.seconds * decay + self.prior_tokens / pool)
        return min(max(rate, self.min_rate), self.max_rate)

    def pool_rate(self, now: float) -> float:
        """The rate of every observation in the pool together, with the fixed prior (`prior_rate`)
        as the pseudo-observation (tokens/s, within [min_rate, max_rate])."""
        pool = self.pool
        if not pool.seconds:
            return self.prior_rate
        decay = math.exp(-self.per_second * (now - pool.at))
        rate = (pool.tokens * decay + self.prior_tokens) / (pool.seconds * decay + self.prior_seconds)
        return min(max(rate, self.min_rate), self.max_rate)

    def mean_request(self, state: WorkerPrefill) -> float:
        """Tokens one engine-reported request of another replica stands for on the worker of
        `state`: this replica's mean request there, else its mean request to the pool (a worker it
        sent nothing yet is priced like the others, not at a constant that may differ from them
        all), else `request_tokens`."""
        mean = state.mean_request
        if mean >= 0:
            return mean
        mean = self.pool.mean_request
        return mean if mean >= 0 else self.request_tokens

    def recent(self, state: WorkerPrefill, now: float) -> float:
        """The uncached tokens this replica sent the worker lately (tokens, decayed with
        `recent_half_life_s`)."""
        if not state.sent:
            return 0.0
        return state.sent * math.exp(-self.recent_per_second * max(now - state.sent_at, 0.0))

    def sent(self, state: WorkerPrefill, tokens: float, now: float) -> None:
        """`tokens` uncached tokens go to the worker of `state` now (`recent`)."""
        state.sent = self.recent(state, now) + tokens
        state.sent_at = now

    def observe(self, state: WorkerPrefill, work: float, seconds: float, now: float) -> None:
        """Fold in one observation: `work` tokens of prefill (queued ahead + the request's own
        uncached) took `seconds` to the first byte. Seconds not above `base_ttft_s` say nothing
        about the rate and are skipped. The pool's state takes it too."""
        seconds -= self.base_s
        if seconds <= 0.0 or work < 0.0:
            return
        for target in (state, self.pool):
            decay = math.exp(-self.per_second * (now - target.at)) if target.seconds else 0.0
            target.tokens = target.tokens * decay + work
            target.seconds = target.seconds * decay + seconds
            target.at = now


class PrefillTicket:
    """One attempt's prefill on its worker: its `uncached` tokens count as pending there from its
    creation until its first byte (`first_byte`, which also feeds the rate with the observed
    time when `observe`: a stream's first byte is its first token) or until its slot is released
    (`close`, after a failure or a client that left), whichever comes first."""

    __slots__ = ("_model", "_observe", "_open", "_queued", "_sent_at", "_state", "_uncached")

    def __init__(self, model: PrefillModel, state: WorkerPrefill, queued: float, uncached: float,
                 observe: bool, now: float) -> None:
        self._model = model
        self._state = state
        self._queued = queued
        self._uncached = uncached
        self._observe = observe
        self._sent_at = now
        self._open = True
        state.pending += uncached
        state.pending_requests += 1
        for target in (state, model.pool):
            mean = target.mean_request
            target.mean_request = uncached if mean < 0 else mean + MEAN_REQUEST_WEIGHT * (uncached - mean)
        model.sent(state, uncached, now)

    def first_byte(self, at: float) -> None:
        """The engine's first body byte came at `at` (perf_counter seconds)."""
        if self._open:
            self.close()
            if self._observe:
                self._model.observe(self._state, self._queued + self._uncached, at - self._sent_at, at)

    def close(self) -> None:
        """No more prefill pending (idempotent)."""
        if self._open:
            self._open = False
            self._state.pending = max(self._state.pending - self._uncached, 0.0)
            self._state.pending_requests = max(self._state.pending_requests - 1, 0)


class PrefillEstimator:
    """Every worker's `WorkerPrefill`, for the whole process (one in `AppState.prefill`); a
    `WorkerWatcher` of the registry so that a worker's state goes when the worker does."""

    __slots__ = ("_workers",)

    def __init__(self) -> None:
        self._workers: dict[Worker, WorkerPrefill] = {}

    def of(self, worker: Worker) -> WorkerPrefill:
        """The worker's state (created on first use)."""
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = WorkerPrefill()
        return state

    def queued(self, worker: Worker, state: WorkerPrefill, model: PrefillModel, load: float) -> float:
        """Tokens of prefill work ahead of a new request on `worker` (`load`: its `Worker.load()`)."""
        others = load - worker.in_flight
        if others <= 0.0:
            return state.pending
        return state.pending + others * model.mean_request(state)

    def decoding(self, worker: Worker, state: WorkerPrefill, load: float) -> float:
        """Requests decoding on `worker` (estimated: its load less the engine's waiting requests
        and this replica's requests still in prefill there; another replica's requests in prefill
        count as decoding); 0 on a PD pool's prefill worker, which decodes nothing."""
        if worker.role == "prefill":
            return 0.0
        return max(load - (worker.engine_waiting or 0.0) - state.pending_requests, 0.0)

    def start(self, worker: Worker, model: PrefillModel, uncached: float, observe: bool,
              now: float) -> PrefillTicket:
        """A ticket for a request about to be sent to `worker` with `uncached` prompt tokens
        (`observe`: a stream, whose first byte is its first token)."""
        state = self.of(worker)
        return PrefillTicket(model, state, self.queued(worker, state, model, worker.load()), uncached, observe, now)

    def worker_added(self, worker: Worker) -> None:
        """Nothing to do: a worker's state is made on first use."""

    def worker_gone(self, worker: Worker) -> None:
        """Forget the worker (an open ticket keeps its own reference and closes harmlessly)."""
        self._workers.pop(worker, None)

    def __len__(self) -> int:
        return len(self._workers)
