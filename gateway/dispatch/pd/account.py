"""The accounting of one PD attempt, in one place: the attempt, its prefill leg and its deferred
stream report facts here (the prefill was sent, answered, succeeded, failed late; a leg failed
with its role; the stream was committed, or failed after that) and `PdAccount` turns them into
the request ledger's facts (`gateway/dispatch/ledger.py`, the only writer of the record, the PD
metrics and the prefill worker's passive-health verdicts). Nothing else in `gateway/dispatch/pd/`
reports to the ledger (the
decode leg's own are the single-leg relay's, `gateway/dispatch/attempt.py`; the attempt's
outcome is the dispatch's, `gateway/dispatch/service.py`)."""

from __future__ import annotations

from typing import Literal

from gateway.backends.worker import Worker
from gateway.dispatch.ledger import Ledger
from gateway.streaming import RETRYABLE, AttemptFailed, Outcome

Role = Literal["prefill", "decode"]


class PdAccount:
    """The facts of one PD attempt in pool `pool` (a name), reported to the request's `ledger`."""

    __slots__ = ("_ledger", "_pool")

    def __init__(self, ledger: Ledger, pool: str) -> None:
        self._ledger = ledger
        self._pool = pool

    @property
    def ledger(self) -> Ledger:
        """The request's ledger (the decode leg reports its own facts there)."""
        return self._ledger

    def attempt_started(self, prefill: Worker) -> None:
        """The attempt runs with `prefill` as its prefill worker (the access log's `prefill_worker`)."""
        self._ledger.prefill_chosen(prefill)

    def prefill_sent(self, prefill: Worker) -> None:
        """The prefill leg is about to be sent: a client hang-up before it answers is held against `prefill`."""
        self._ledger.prefill_sent(prefill)

    def prefill_answered(self, prefill: Worker) -> None:
        """`prefill` sent the leg's response headers: it is alive (`Worker.answered_at`), no longer pending."""
        self._ledger.prefill_answered(prefill)

    def prefill_succeeded(self, prefill: Worker) -> None:
        """`prefill` answered its leg whole (passive health: a success)."""
        self._ledger.worker_succeeded(prefill)

    def leg_failed(self, role: Role, outcome: Outcome) -> None:
        """A leg of role `role` failed with `outcome` (`kimi_gateway_pd_leg_failures_total`); the
        dispatch judges the worker (`PdAttempt.failed_worker`)."""
        self._ledger.leg_failed(self._pool, role, outcome)

    def prefill_failed_late(self, prefill: Worker, failure: AttemptFailed) -> None:
        """The prefill leg failed after the decode stream was committed: no dispatch judges it, so
        count it and hold it against `prefill` here."""
        self.leg_failed("prefill", failure.outcome)
        self._ledger.worker_failed(prefill, f"prefill leg: {failure.detail}")

    def prefill_phases(self, started: float, done_at: float) -> None:
        """The prefill leg ran from `started` to `done_at` (perf_counter s): its time, and the KV
        hand-off (the prefill answer to the decode leg's first byte) when the prefill answered first."""
        self._ledger.pd_phases(self._pool, started, done_at)

    def committed(self) -> None:
        """The client's stream was committed (200) before its decode leg opened."""
        self._ledger.accepted(200)

    def failed_after_commit(self, exc: Exception, worker: Worker) -> None:
        """A committed stream's legs failed before its first content (`exc`), against `worker`:
        the request's outcome, and the worker's verdict unless the failure was the request's doing."""
        self._ledger.stream_broken(str(exc))
        if not isinstance(exc, AttemptFailed) or exc.outcome in RETRYABLE:
            self._ledger.worker_failed(worker, f"after the stream was committed: {exc}")
