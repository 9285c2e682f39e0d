"""The accounting of one PD attempt, in one place: the attempt, its prefill leg and its deferred
stream report facts here (the prefill was sent, answered, succeeded, failed late; a leg failed
with its role; the stream was committed, or failed after that) and `PdAccount` writes what they
mean: the request record's PD fields, the PD metrics and the prefill worker's passive-health
verdicts. Nothing else in `gateway/dispatch/pd/` writes the record, a metric or a verdict (the
decode leg's own are the single-leg relay's, `gateway/dispatch/attempt.py`; the attempt's
outcome is the dispatch's, `gateway/dispatch/service.py`)."""

from __future__ import annotations

import time
from typing import Literal

from gateway.backends.worker import Worker
from gateway.record import RequestOutcome, RequestRecord
from gateway.state import AppState
from gateway.streaming import RETRYABLE, AttemptFailed, Outcome

Role = Literal["prefill", "decode"]


class PdAccount:
    """The facts of one PD attempt of `record`'s request in pool `pool` (a name), written to the
    record, `state.metrics` and `state.registry`."""

    __slots__ = ("_metrics", "_pool", "_record", "_registry")

    def __init__(self, state: AppState, pool: str, record: RequestRecord) -> None:
        self._metrics = state.metrics
        self._registry = state.registry
        self._pool = pool
        self._record = record

    def attempt_started(self, prefill: Worker) -> None:
        """The attempt runs with `prefill` as its prefill worker (the access log's `prefill_worker`)."""
        self._record.prefill_worker = prefill.id

    def prefill_sent(self, prefill: Worker) -> None:
        """The prefill leg is about to be sent: a client hang-up before it answers is held against `prefill`."""
        self._record.prefill_pending = prefill

    def prefill_answered(self, prefill: Worker) -> None:
        """`prefill` sent the leg's response headers: it is alive (`Worker.answered_at`), no longer pending."""
        prefill.answered_at = time.perf_counter()
        if self._record.prefill_pending is prefill:
            self._record.prefill_pending = None

    def prefill_succeeded(self, prefill: Worker) -> None:
        """`prefill` answered its leg whole (passive health: a success)."""
        self._registry.request_succeeded(prefill)

    def leg_failed(self, role: Role, outcome: Outcome) -> None:
        """A leg of role `role` failed with `outcome` (`kimi_gateway_pd_leg_failures_total`); the
        dispatch judges the worker (`PdAttempt.failed_worker`)."""
        self._metrics.pd_leg_failures.labels(self._pool, role, outcome).inc()

    def prefill_failed_late(self, prefill: Worker, failure: AttemptFailed) -> None:
        """The prefill leg failed after the decode stream was committed: no dispatch judges it, so
        count it and hold it against `prefill` here."""
        self.leg_failed("prefill", failure.outcome)
        self._registry.request_failed(prefill, f"prefill leg: {failure.detail}")

    def prefill_phases(self, started: float, done_at: float) -> None:
        """The prefill leg ran from `started` to `done_at` (perf_counter s): its time, and the KV
        hand-off (the prefill answer to the decode leg's first byte) when the prefill answered first."""
        self._metrics.pd_prefill_seconds.labels(self._pool).observe(done_at - started)
        first = self._record.first_byte_at
        if first is not None and first >= done_at:
            self._metrics.pd_handoff_seconds.labels(self._pool).observe(first - done_at)

    def committed(self) -> None:
        """The client's stream was committed (200) before its decode leg opened."""
        self._record.status = 200

    def failed_after_commit(self, exc: Exception, worker: Worker) -> None:
        """A committed stream's legs failed before its first content (`exc`), against `worker`:
        the request's outcome, and the worker's verdict unless the failure was the request's doing."""
        self._record.outcome = RequestOutcome.UPSTREAM_ERROR
        self._record.error = str(exc)
        if not isinstance(exc, AttemptFailed) or exc.outcome in RETRYABLE:
            self._registry.request_failed(worker, f"after the stream was committed: {exc}")
