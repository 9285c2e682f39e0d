"""`PdAttempt`: the two-leg attempt every PD protocol shares, run by the pool's protocol runner.

`worker` is the decode worker (its answer goes to the client, its outcome is counted against
it), `prefill` the prefill worker. `run()` takes both slots into one Holding (the prefill's
outside the pool's request count) and hands the runner the pieces it orders (`PdRunner.legs`):

- `start_prefill`: the prefill leg as its own task (`PrefillLeg`) in the Holding, so the relay's
  end or a client hang-up aborts it; `prefill_answer` its answer.
- `decode`: the decode leg, the single-leg relay (`SingleLeg.serve`: held start, first-content
  wait, relay) on the decode worker with the leg's body.
- `both`: both legs at once; the decode leg's answer, unless the prefill leg fails first.
- `commit_deferred`: a stream committed before its decode leg opens (keep-alives meanwhile).

Failure roles: a prefill failure before the decode leg's first content fails the attempt against
the prefill worker (`failed_worker`; the dispatch retries with a new prefill worker and a new
room / transfer id); a decode failure against the decode worker; a prefill failure after a
committed stream (keep-alives, no content yet) aborts the decode leg, whose relay then ends with
one SSE error event, never a hang. Every record field, PD metric and prefill-health verdict goes
through the attempt's `PdAccount` (`account.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dialects.names import Api
from gateway.dispatch.answers import SSE_CONTENT_TYPE, BufferedResponse, RelayResponse
from gateway.dispatch.attempt import UPSTREAM_PATHS, Attempt, SingleLeg, budgets, hold_window, upstream_headers
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.pd.account import PdAccount
from gateway.dispatch.pd.deferred import DeferredStream, after_commit_message
from gateway.dispatch.pd.prefill import PrefillLeg, prefill_budget
from gateway.routing.features import RoutingRequest
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Holding, Outcome, UpstreamStream

Answer = BufferedResponse | RelayResponse


class PdRunner(Protocol):
    """One PD protocol: the order of an attempt's legs and their requests (`requests.py`)."""

    async def legs(self, pd: PdAttempt, holding: Holding, headers: dict[str, str]) -> Answer:
        """Run both legs of `pd` into `holding` (both slots taken) with `headers` (both legs'):
        the decode leg's answer, or AttemptFailed (its worker named by `pd.failed_worker`)."""
        ...


class PdAttempt(Attempt):
    """A two-leg attempt (see the module docstring): `runner` orders the legs, `body` is the decode
    worker's engine body, parsed once here (`self.body`, a dict the runner's builders never change)."""

    __slots__ = (
        "_account",
        "_api",
        "_failed",
        "_ledger",
        "_prefill_leg",
        "_request",
        "_runner",
        "_state",
        "_strip_usage",
        "body",
        "prefill",
        "prefill_reason",
    )

    def __init__(self, runner: PdRunner, state: AppState, api: Api, pool: PoolConfig, decode: Worker,
                 prefill: Worker, reason: str, prefill_reason: str, matched: float | None, body: bytes,
                 request: RoutingRequest, ledger: Ledger, strip_usage: bool) -> None:
        super().__init__(pool, decode, reason, matched)
        self._runner = runner
        self._state = state
        self._api = api
        self._request = request
        self._ledger = ledger
        self._strip_usage = strip_usage
        self._account = PdAccount(ledger, pool.name)
        self.body: dict[str, Any] = orjson.loads(body)
        self.prefill = prefill
        self.prefill_reason = prefill_reason
        self._failed: Worker | None = None
        self._prefill_leg: PrefillLeg | None = None

    @property
    def cache_worker(self) -> Worker:
        """The prefill worker: it holds the prompt's prefix cache."""
        return self.prefill

    def failed_worker(self, failure: AttemptFailed) -> Worker:
        """The worker of the leg that failed: the prefill worker once blamed, else the decode worker."""
        return self._failed or self.worker

    @property
    def strip_usage(self) -> bool:
        """Whether the usage patch is on (its chunk is not relayed)."""
        return self._strip_usage

    @property
    def state(self) -> AppState:
        """The gateway's state (the registry, the HTTP client a runner asks a bootstrap server with)."""
        return self._state

    @property
    def streams(self) -> bool:
        """Whether the client streams."""
        return self._request.stream

    def hold_window(self) -> float | None:
        """How long (s) a stream may still be held back before it is committed (`attempt.hold_window`)."""
        return hold_window(self._state.config.timeouts, self._ledger.record)

    async def run(self) -> Answer:
        """Take both slots (the prefill's outside the pool's request count), run the protocol's
        legs, release everything unless a stream took it."""
        state = self._state
        gate = state.registry.gates[self.pool.name]
        self._account.attempt_started(self.prefill)
        holding = Holding()
        started = state.flow.ticket(self.pool, self.worker, self._request.prompt_tokens, self._request.stream)
        self._ledger.watch_first_byte(None if started is None else started.started)
        try:
            holding.lease(self.worker, state.metrics, gate, started=started)
            holding.lease(self.prefill, state.metrics, gate, counted=False)
            result = await self._runner.legs(self, holding, upstream_headers(self.pool, self.worker, self._ledger))
            self._observe()
            return result
        finally:
            if holding:
                await holding.aclose()

    def blame_prefill(self) -> None:
        """The attempt fails against the prefill worker (`failed_worker`)."""
        self._failed = self.prefill

    def prefill_refused(self, detail: str, counted: bool) -> AttemptFailed:
        """The failure (protocol_error, to raise) of a prefill answer the decode worker must not get,
        held against the prefill worker; `counted`: as a prefill leg failure."""
        self.blame_prefill()
        if counted:
            self._account.leg_failed("prefill", Outcome.PROTOCOL_ERROR)
        return AttemptFailed(Outcome.PROTOCOL_ERROR, detail, answered=True)

    def start_prefill(self, holding: Holding, body: bytes, headers: dict[str, str]) -> PrefillLeg:
        """Open the prefill leg (its own task, sending `body`) into `holding`."""
        timeouts = self._state.config.timeouts
        timeout, _, _ = budgets(timeouts, self._request, self.pool)
        budget = prefill_budget(timeouts, self._request.prompt_tokens)
        self._account.prefill_sent(self.prefill)  # the worker a hang-up meanwhile is held against
        leg = PrefillLeg(self._state, self.pool, self.prefill, self.prefill.url + UPSTREAM_PATHS[self._api],
                         body, headers, timeout, budget, self._account)
        self._prefill_leg = leg
        return holding.opened(leg)

    async def prefill_answer(self, leg: PrefillLeg) -> bytes:
        """The prefill leg's answer; its failure is the attempt's, against the prefill worker."""
        try:
            return await leg.result()
        except AttemptFailed:
            self._prefill_failed(leg)
            raise

    def _prefill_failed(self, leg: PrefillLeg) -> AttemptFailed:
        self.blame_prefill()
        assert leg.failure is not None
        self._account.leg_failed("prefill", leg.failure.outcome)
        return leg.failure

    def _serve(self, holding: Holding, headers: dict[str, str], body: bytes) -> Awaitable[Answer]:
        """The decode leg: the single-leg relay of `body` on the decode worker, into `holding`."""
        leg = SingleLeg(self._state, self._api, self.pool, self.worker, self.reason, self.matched, body,
                        self._request, self._ledger, self._strip_usage)
        return leg.serve(holding, headers)

    async def decode(self, holding: Holding, headers: dict[str, str], body: bytes) -> Answer:
        """The decode leg alone (the prefill leg answered): its answer; its failure counted as a
        decode leg's."""
        try:
            return await self._serve(holding, headers, body)
        except AttemptFailed as failure:
            self._account.leg_failed("decode", failure.outcome)
            raise

    async def both(self, holding: Holding, leg: PrefillLeg, headers: dict[str, str], body: bytes) -> Answer:
        """Both legs at once (the decode leg sending `body`): the decode leg's answer, unless the
        prefill leg fails first (then the decode leg is aborted and the attempt fails against the
        prefill worker)."""
        serve = asyncio.ensure_future(self._serve(holding, headers, body))
        try:
            await asyncio.wait((serve, leg.task), return_when=asyncio.FIRST_COMPLETED)
            if not serve.done() and leg.failure is not None:
                serve.cancel()
                await asyncio.wait((serve,))
                raise self._prefill_failed(leg)
            try:
                result = await serve
            except AttemptFailed as failure:
                self._account.leg_failed("decode", failure.outcome)
                raise
        finally:
            if not serve.done():  # our own task was cancelled (the client hung up): end the decode leg too
                serve.cancel()
                await asyncio.wait((serve,))
        if isinstance(result, RelayResponse):
            if not leg.task.done():
                leg.on_late_failure = lambda: self._abort_waiting_decode(result)
            elif leg.failure is not None:  # failed in the loop step that committed the stream: no
                # late-failure call will come, so do now what it would do (else a decode with no
                # content waits for KV until the engine's own timeout)
                self._account.prefill_failed_late(leg.worker, leg.failure)
                await self._abort_waiting_decode(result)
        return result

    async def _abort_waiting_decode(self, result: RelayResponse) -> None:
        """The prefill leg failed after the decode stream was committed: while the decode worker has
        sent no content it waits for KV that will not come, so abort it (the relay then ends with
        one SSE error event; the decode worker is not blamed: the prefill worker is). Once it sent
        content, the KV had arrived: let it finish."""
        if self._ledger.record.first_byte_at is None and isinstance(result.stream, UpstreamStream):
            await result.stream.abort("The prefill worker failed before the first token")

    def commit_deferred(self, holding: Holding, start: Callable[[Holding], Awaitable[Answer]]) -> RelayResponse:
        """Commit the client's stream now (keep-alives); `start(owned)` opens the decode leg later,
        with everything `holding` held (a failure then ends the stream with one SSE error event)."""
        async def opened(owned: Holding) -> RelayResponse:
            result = await start(owned)
            assert isinstance(result, RelayResponse)
            self._observe()
            return result

        self._account.committed()
        # No keep-alives of its own (None): the relay's heartbeat stage covers the wait (gateway/api/heartbeat.py).
        stream = DeferredStream(opened, holding.hand_over(), None, self._failed_after_commit)
        return RelayResponse(stream, SSE_CONTENT_TYPE, [])

    def _failed_after_commit(self, exc: Exception) -> str:
        """Account a deferred stream's failure (against the failed leg's worker); its message."""
        self._account.failed_after_commit(exc, self._failed or self.worker)
        return after_commit_message(exc)

    def _observe(self) -> None:
        """Per-phase metrics once the prefill leg answered (`PdAccount.prefill_phases`)."""
        leg = self._prefill_leg
        if leg is not None and leg.done_at is not None:
            self._account.prefill_phases(leg.started, leg.done_at)
