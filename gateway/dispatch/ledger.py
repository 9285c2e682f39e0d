"""One request's accountant: the only code that writes its `RequestRecord`, touches the request
path's metrics, issues passive-health verdicts on workers, opens and closes its trace spans and
settles its quota.

The endpoint (`gateway/api/proxy.py`) and the stored-response routes (`gateway/api/stored_responses.py`)
make one `Ledger` per request; everything on the request path below them (the dispatch loop,
attempts and their legs, the stream relay, a migration) reports facts to it, one call per fact,
and never writes the record itself (tests/unit/test_ledger_guard.py keeps it so). The facts come
per attempt, per leg and per stream end, never per chunk: the relay's hot loop reports nothing.

The facts, by who reports them:

- the endpoint: `timed_out`, `cut_by_cap`, `relay_cut_by_cap`, `client_gone`, `send_stalled`,
  `cut_by_shutdown`, `answered`, `answered_with_error`, `hang_up_verdict`, then `finish` (once);
  the stored-response routes also `in_pool`, `served_by`, `streamed`; the tokenizer routes `resolved`;
- the dispatch: `parsed`, `refused_model`, `history_counted`, `skipped`, `in_pool`, `flow_waited`, `spilled`,
  `affinity_looked_up`, `attempt_started`, `attempt_failed`, `attempt_accepted`, `error_answer`,
  `hold_quota` / `settle_quota`, `response_stored`;
- an attempt and its legs: `upstream_headers`, `answer_budget`, `watch_first_byte`, `headers_arrived`,
  `first_byte`, `accepted`, `usage`, `answer_broken`, `worker_succeeded` / `worker_failed` /
  `worker_throttled` / `worker_unreachable` (the verdicts), and a PD attempt's `pd_routed`,
  `prefill_chosen`, `prefill_sent`, `prefill_answered`, `leg_failed`, `pd_phases`;
- the stream: `first_byte`, `stream_broken`, `stream_usage`;
- a migration: `migration_refused`, `migration_started`, `continuation_started`,
  `continuation_ended`, `migration_ended`, `migrated_usage`, `migration_prefilled`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson

from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.observability.metrics import GatewayMetrics, status_class
from gateway.observability.record import RequestOutcome, RequestRecord, RequestSpans, counted_status
from gateway.routing.features import RoutingRequest

log = logging.getLogger("gateway.access")

OK = "ok"  # `streaming.Outcome.OK`: an accepted attempt's outcome label
PEER_SILENCE_MIN_S = 1.0
"""Seconds a client must have waited for its hang-up to be compared with the worker's peers
(`Ledger.hang_up_verdict`): engines send a stream's headers once its prompt is tokenized, which a
long prompt may take a moment for."""
TIMEOUT = "timeout"  # `streaming.Outcome.TIMEOUT`
_REACHED = frozenset({"timeout", "protocol_error"})  # a failed attempt's engine may have worked on it
_REFUSED = frozenset({"client_error", "too_long"})  # an engine read the request and refused it


class Tracer(Protocol):
    """What the ledger asks of gateway/observability/tracing.py's `Tracing`: a request's spans."""

    def begin(self, record: RequestRecord, headers: Mapping[str, str]) -> RequestSpans: ...


class Settler(Protocol):
    """What the ledger asks of the auth guard (`AuthGuard`) to settle a token reservation."""

    async def settle(self, reservation: Any, used_tokens: int | None) -> None: ...

    def settle_soon(self, reservation: Any, used_tokens: int | None) -> None: ...


class ContextNoter(Protocol):
    """What the ledger asks of the stored-response store (`response_store.ResponseStore`): the size
    of a stored response, once its usage is known."""

    def note_context(self, response_id: str, tokens: int) -> None: ...


class Ledger:
    """The accountant of one client request (see the module docstring): `record` is its data,
    written only here, read by anyone (the route headers, the error messages, the quota).

    `metrics` and `registry` are the app's; `tracing` (None: off) opens the request's spans from
    the client's `headers` (`traceparent`)."""

    __slots__ = ("_answered", "_attempt_at", "_budget", "_finished", "_metrics", "_on_first_byte", "_open",
                 "_prefill_pending", "_quota", "_registry", "_stored", "record", "trace")

    def __init__(self, api: str, request_id: str, key: str | None, metrics: GatewayMetrics,
                 registry: WorkerRegistry, tracing: Tracer | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.record = RequestRecord(request_id=request_id, api=api, key=key)
        self._metrics = metrics
        self._registry = registry
        self.trace: RequestSpans | None = None if tracing is None else tracing.begin(self.record, headers or {})
        self._open: Worker | None = None  # the worker of an upstream attempt still running (a cut one stays set)
        self._answered = False  # that attempt's engine has sent its response headers
        self._attempt_at = 0.0  # when that attempt started (perf_counter seconds)
        self._budget = 0.0  # that attempt's answer budget (seconds; `answer_budget`)
        self._prefill_pending: Worker | None = None  # a PD attempt's prefill worker while its leg sent no headers
        self._on_first_byte: Callable[[float], None] | None = None
        self._quota: tuple[Settler, Any, RoutingRequest] | None = None
        self._stored: tuple[ContextNoter, str] | None = None  # the stored response a stream creates
        self._finished = False

    @property
    def open_attempt(self) -> Worker | None:
        """The worker of the upstream attempt still running (None: none; a cut one stays set)."""
        return self._open

    # --- the request, as the endpoint sees it ------------------------------------------------

    def timed_out(self) -> None:
        """The overall cap (`timeouts.total`) ran out: the outcome is `timeout`."""
        self.record.outcome = RequestOutcome.TIMEOUT

    def client_gone(self, stage: str) -> None:
        """The client hung up at `stage` (`before_response` or `mid_stream`), or stopped reading and was
        cut off (`send_stalled`, gateway/serving/request_head.py). The first stage counts."""
        record = self.record
        if record.disconnect_stage is None:
            record.disconnect_stage = stage
            record.outcome = RequestOutcome.CLIENT_DISCONNECT

    def send_stalled(self) -> None:
        """The client took no byte for `timeouts.send_stall` seconds and its connection was aborted."""
        self.client_gone("send_stalled")
        self._metrics.client_send_stalls.labels(self.record.pool).inc()

    def cut_by_shutdown(self, response_started: bool, status: int = 503) -> None:
        """The server ended the request at the end of its shutdown grace period. `status`: what the
        client got if nothing was sent yet: gateway/serving/lifecycle.py's 503 (a started stream gets one SSE
        error event), or uvicorn's 500 when its own graceful-shutdown timeout cancelled the request."""
        record = self.record
        record.outcome = RequestOutcome.SHUTTING_DOWN
        record.error = "the gateway shut down before the response ended"
        if not response_started:
            record.status = status

    def served_by(self, worker: Worker) -> None:
        """The request went to `worker` (a stored-response call: no attempt, no route reason)."""
        self.record.worker = worker.id

    def streamed(self, status: int) -> None:
        """The client gets a stream of `status` (a stored response's replay)."""
        self.record.stream = True
        self.record.status = status

    def answered(self, status: int) -> None:
        """The client gets a buffered answer of `status` (an error status counts as `answered_with_error`)."""
        if status >= 400:
            self.answered_with_error(status)
        else:
            self.record.status = status

    def answered_with_error(self, status: int, message: str | None = None) -> None:
        """The client gets error status `status` (and, given, the gateway's `message` as the log's
        `error`): the outcome becomes `error` unless a cause was already named (`timeout`, ...)."""
        record = self.record
        record.status = status
        if record.outcome is RequestOutcome.OK:
            record.outcome = RequestOutcome.ERROR
        if message is not None:
            record.error = message

    def relay_cut_by_cap(self, message: str, started: bool, status: int) -> None:
        """A relay ran past the overall cap: `timeout`, with `message`; `status` (504) when nothing
        was sent yet."""
        record = self.record
        record.outcome = RequestOutcome.TIMEOUT
        record.error = message
        if not started:
            record.status = status

    def cut_by_cap(self) -> None:
        """The overall cap cut the dispatch while an attempt ran: `timeout`; that attempt is counted
        as a `timeout`, held against its worker only for a stream whose engine had not even sent
        headers (a streaming engine answers them at once, so it hangs; a non-streaming answer's
        headers come with its last byte, so a long generation and a hang look the same)."""
        self.timed_out()
        worker = self._open
        if worker is None:
            return
        self._open = None
        self.record.reached_engine = True  # the engine may have been working on it all along
        self._metrics.upstream_attempts.labels(worker.pool, worker.id, TIMEOUT).inc()
        if self.trace is not None:
            self.trace.end_attempt(TIMEOUT)
        if self.record.stream and not self._answered:
            self._registry.request_failed(worker, "no response headers within the overall cap")

    def hang_up_verdict(self, patience: float) -> None:
        """Passive health for a client that hung up before its response while an attempt still
        waited: the worker that had sent it nothing (a PD attempt's prefill worker while its leg is
        unanswered, else the attempt's worker before its response headers) counts a failed request
        when that worker answered no other request since this attempt started and either the
        client waited at least `patience` seconds (`attempt.silence_limit`), or (an aggregated
        pool's worker, the client having waited at least `PEER_SILENCE_MIN_S`) a peer of the
        worker answered meanwhile a request sent after this one that the gateway gives at least as
        much time (`WorkerRegistry.peers_answered`, gateway/backends/answer_marks.py): the worker
        is behind its peers by more than the request's own length explains. A quick hang-up, a
        busy engine answering others, or a long request whose peers answered only shorter ones is
        held against nobody."""
        worker = self._open
        if worker is None or self.record.disconnect_stage != "before_response":
            return
        silent = self._prefill_pending or (None if self._answered else worker)
        if silent is None or silent.answered_at >= self._attempt_at:
            return
        waited = time.perf_counter() - self._attempt_at
        if waited >= patience:
            self._registry.request_failed(silent, f"its client hung up after {waited:.1f}s without a byte "
                                                  "from it (it answered no request meanwhile)")
        elif (silent is worker and silent.role is None and waited >= PEER_SILENCE_MIN_S
              and self._registry.peers_answered(silent, self._attempt_at, self._budget, self.record.stream)):
            self._registry.request_failed(silent, f"its client hung up after {waited:.1f}s without a byte "
                                                  "from it, while its peers answered later requests as large "
                                                  "(it answered none)")

    # --- the dispatch -------------------------------------------------------------------------

    def parsed(self, request: RoutingRequest) -> None:
        """The body was parsed: whether it streams, its estimated prompt tokens and its model (the
        metrics' `model` label: a configured model's canonical name, or a LoRA adapter a pool
        declares or a worker lists; a name no longer known stays `none`, so labels stay bounded)."""
        record = self.record
        if request.adapter is None or request.adapter in self._registry.adapter_names():
            record.model = request.model
        record.stream = request.stream
        record.estimated_prompt_tokens = request.prompt_tokens
        record.estimate_method = request.estimate_method

    def resolved(self, model: str) -> None:
        """The request names `model` (a configured model's canonical name or a LoRA adapter a pool
        serves: the metrics' `model` label), with no body to route (the tokenizer routes)."""
        self.record.model = model

    def refused_model(self, model: str) -> None:
        """The body named a model its key may not use, answered 404 before anything else is known
        of it: `model`, its resolved name (as `resolved` records it), is the metrics' `model` label."""
        self.resolved(model)

    def history_counted(self, request: RoutingRequest) -> None:
        """A Responses follow-up's estimate now holds the stored conversation its engine prefills
        (`response_affinity.follow_up_of`): the estimate of what the engine's prompt is."""
        self.record.estimated_prompt_tokens = request.prompt_tokens

    def skipped(self, pools: list[str] | None) -> None:
        """Pools that fit but whose engines do not serve the request's API (None: none)."""
        self.record.skipped_pools = pools

    def in_pool(self, pool: str, request: RoutingRequest | None = None) -> None:
        """The request is in `pool` now; with `request`, its first pool (its estimate is observed there)."""
        self.record.pool = pool
        if request is not None:
            self._metrics.estimated_prompt_tokens.labels(pool, request.estimate_method).observe(request.prompt_tokens)

    def spilled(self, from_pool: str, to_pool: str, cause: str) -> None:
        """The request moved to a later pool (`unavailable`, `saturated`, `too_long`)."""
        self._metrics.spillovers.labels(from_pool, to_pool, cause).inc()

    def flow_waited(self, seconds: float) -> None:
        """Flow control held the request `seconds` before letting it into its pool (the access log's `queued_s`)."""
        self.record.queued_s = seconds

    def affinity_looked_up(self, pool: str, hit: bool) -> None:
        """The affinity store answered a lookup for `pool`: a prefix match (`hit`) or none."""
        self._metrics.affinity_lookup(pool, "hit" if hit else "miss")

    def attempt_started(self, pool: str, worker: Worker, reason: str, retry_cause: str | None) -> None:
        """An attempt on `worker` is about to run (route `reason`; `retry_cause`: what the last one
        failed by, None for the first)."""
        record = self.record
        record.attempts += 1
        record.worker, record.reason, record.prefill_worker = worker.id, reason, None
        self._metrics.route_decisions.labels(pool, reason).inc()
        if retry_cause is not None:
            self._metrics.retries.labels(pool, retry_cause).inc()
        self._open, self._answered, self._budget = worker, False, 0.0
        self._attempt_at, self._prefill_pending = time.perf_counter(), None

    def attempt_failed(self, pool: str, worker: Worker, outcome: str) -> None:
        """The attempt failed with `outcome` (a `streaming.Outcome`) against `worker` (the failed leg's)."""
        record = self.record
        self._open = None
        record.reached_engine |= outcome in _REACHED
        record.engine_refused |= outcome in _REFUSED
        self._metrics.upstream_attempts.labels(pool, worker.id, outcome).inc()
        if self.trace is not None:
            self.trace.end_attempt(outcome)

    def attempt_accepted(self, pool: str, worker: Worker, matched: float | None) -> None:
        """The attempt was accepted (`matched`: the prompt share its worker held per the affinity
        store, observed when given)."""
        self._open = None
        self.record.reached_engine = True
        self._metrics.upstream_attempts.labels(pool, worker.id, OK).inc()
        if self.trace is not None:
            self.trace.end_attempt(OK)
        if matched is not None:
            self._metrics.affinity_match_ratio.labels(pool).observe(matched)

    def error_answer(self, status: int, error: str) -> None:
        """An engine's own error is the client's answer (`status`), for the log's `error`."""
        self.record.status = status
        self.record.error = error

    def adapter_loaded(self) -> None:
        """An engine loaded a LoRA adapter for this request (unloading another to make room, maybe):
        work done on its behalf, so however it ends it is settled as one an engine worked on
        (`quota_used`: at least its prompt estimate), never released as free."""
        self.record.reached_engine = True

    def hold_quota(self, guard: Settler, reservation: Any, request: RoutingRequest) -> None:
        """A token reservation to settle when the request ends (`finish`), unless settled sooner."""
        self._quota = (guard, reservation, request)

    def response_stored(self, store: ContextNoter, response_id: str) -> None:
        """The stream's engine stores its response as `response_id` (recorded in `store` with an
        estimate of its size): `finish` replaces that estimate by the usage the stream reports."""
        self._stored = (store, response_id)

    async def settle_quota(self, failed: bool) -> None:
        """Settle the held reservation now (an answer or error given before any stream)."""
        if self._quota is not None:
            guard, reservation, request = self._quota
            await guard.settle(reservation, quota_used(self.record, request, reservation.tokens, failed))

    # --- attempts, legs and streams ------------------------------------------------------------

    def upstream_headers(self, pool: str, worker: Worker) -> dict[str, str]:
        """An engine request's `x-request-id` and trace context (opening the attempt's span).

        The engine request id (which vLLM makes its request id: `chatcmpl-{id}`) is the gateway's,
        never the client's: `{engine_request_id}-{attempt number}`, the first a fresh uuid4 hex per
        request (logged as `engine_request_id`), the same on both legs of a PD attempt. So two
        clients sending the same id never collide on an engine that refuses a duplicate running id,
        nor does a retry on a worker still ending the attempt before it."""
        record = self.record
        base = record.engine_request_id
        if base is None:
            base = record.engine_request_id = uuid.uuid4().hex
        headers = {"x-request-id": f"{base}-{record.attempts}"}
        if self.trace is not None:
            headers.update(self.trace.start_attempt(pool, worker.id))
        return headers

    def answer_budget(self, seconds: float) -> None:
        """The running attempt's answer budget (`dispatch/attempt.py` `budgets`: a stream's
        first-content budget, a non-streamed request's whole answer budget): its size, for
        comparing workers' answers (`headers_arrived`, `hang_up_verdict`)."""
        self._budget = seconds

    def watch_first_byte(self, callback: Callable[[float], None] | None) -> None:
        """Call `callback` with the first byte's time when it comes (a prefill ticket; None: nobody)."""
        self._on_first_byte = callback

    def served_others(self, worker: Worker) -> bool:
        """Whether `worker` sent response headers to another request since this request's attempt
        on it began (it is alive and serving). Read after an attempt that got none failed."""
        return worker.answered_at >= self._attempt_at

    def headers_arrived(self, worker: Worker) -> None:
        """The attempt's engine sent its response headers: it is alive and working on the request
        (and answered a request of this size, sent when the attempt started: `Worker.answers`)."""
        self._answered = True
        worker.answered_at = time.perf_counter()
        worker.answers.mark(self._attempt_at, self._budget, self.record.stream)

    def first_byte(self) -> None:
        """The first upstream body byte (TTFT for streams); later calls do nothing."""
        record = self.record
        if record.first_byte_at is None:
            record.first_byte_at = at = time.perf_counter()
            if self._on_first_byte is not None:
                self._on_first_byte(at)

    def accepted(self, status: int) -> None:
        """The engine's answer was accepted with `status` (the client's status)."""
        self.record.status = status

    def usage(self, usage: dict[str, Any] | None) -> None:
        """A whole answer's usage (OpenAI's names)."""
        self.record.usage = usage

    def answer_broken(self) -> None:
        """A non-streaming answer broke, or grew too large, after the engine accepted the request."""
        self.record.outcome = RequestOutcome.UPSTREAM_ERROR

    def stream_broken(self, error: str) -> None:
        """A stream ended badly after it was committed (broken, cut early, failed before its first
        token): `upstream_error`, with `error` for the log."""
        self.record.outcome = RequestOutcome.UPSTREAM_ERROR
        self.record.error = error

    def stream_usage(self, usage: dict[str, Any] | None) -> None:
        """The usage a stream reported at its end (none: the record keeps what it had)."""
        if usage:
            self.record.usage = usage

    def worker_succeeded(self, worker: Worker) -> None:
        """Verdict: `worker` gave a whole answer (passive health)."""
        self._registry.request_succeeded(worker)

    def worker_failed(self, worker: Worker, reason: str) -> None:
        """Verdict: the request failed on `worker`'s side (5xx, timeout, broken answer)."""
        self._registry.request_failed(worker, reason)

    def worker_throttled(self, worker: Worker, retry_after: float | None) -> None:
        """Verdict: `worker` is rate limiting (429): no new requests for `retry_after` seconds."""
        self._registry.throttled(worker, retry_after)

    def worker_unreachable(self, worker: Worker, reason: str) -> None:
        """Verdict: `worker` refused the connection."""
        self._registry.connect_failed(worker, reason)

    # --- prefill/decode attempts ----------------------------------------------------------------

    def pd_routed(self, pool: str, prefill_reason: str, decode_reason: str) -> None:
        """A PD pool chose a worker per phase, each for its policy's reason."""
        metric = self._metrics.pd_route_decisions
        metric.labels(pool, "prefill", prefill_reason).inc()
        metric.labels(pool, "decode", decode_reason).inc()

    def prefill_chosen(self, worker: Worker) -> None:
        """The attempt's prefill worker (`worker` of the record is then its decode worker)."""
        self.record.prefill_worker = worker.id

    def prefill_sent(self, worker: Worker) -> None:
        """The prefill leg went to `worker`: a hang-up before it answers is held against it."""
        self._prefill_pending = worker

    def prefill_answered(self, worker: Worker) -> None:
        """The prefill leg's headers came: `worker` is alive."""
        worker.answered_at = time.perf_counter()
        if self._prefill_pending is worker:
            self._prefill_pending = None

    def leg_failed(self, pool: str, role: str, outcome: str) -> None:
        """One leg (`prefill`, `decode`) of a PD attempt failed with `outcome`."""
        self._metrics.pd_leg_failures.labels(pool, role, outcome).inc()

    def pd_phases(self, pool: str, prefill_started: float, prefill_done: float) -> None:
        """A PD attempt's prefill leg took `prefill_started` → `prefill_done` (perf_counter seconds);
        the KV hand-off runs from there to the decode leg's first byte, when that came after it."""
        self._metrics.pd_prefill_seconds.labels(pool).observe(prefill_done - prefill_started)
        first = self.record.first_byte_at
        if first is not None and first >= prefill_done:
            self._metrics.pd_handoff_seconds.labels(pool).observe(first - prefill_done)

    # --- migration ------------------------------------------------------------------------------

    def migration_refused(self, pool: str, worker: Worker, why: str) -> None:
        """A failing stream was not at a safe point to continue elsewhere (`why`)."""
        self._metrics.migrations.labels(pool, "refused").inc()
        self.record.migration = {"from": worker.id, "outcome": "refused", "why": why}

    def migration_started(self, worker: Worker, why: str, kept_tokens: int, count: int) -> None:
        """A stream is continued away from `worker` (which failed: `why`), `kept_tokens` relayed so far."""
        self.record.migration = {"from": worker.id, "why": why, "kept_tokens": kept_tokens, "count": count}

    def continuation_started(self, worker: Worker) -> None:
        """A continuation's attempt on `worker` is about to run (route reason `migration`)."""
        record = self.record
        record.attempts += 1
        record.worker, record.reason = worker.id, "migration"

    def continuation_ended(self, pool: str, worker: Worker, outcome: str) -> None:
        """A continuation's attempt on `worker` was accepted (`ok`) or failed with `outcome`."""
        self._metrics.upstream_attempts.labels(pool, worker.id, outcome).inc()
        if self.trace is not None:
            self.trace.end_attempt(outcome)

    def migration_ended(self, pool: str, outcome: str, to: Worker | None = None,
                        prefill: Worker | None = None) -> None:
        """The migration ended: `migrated` (to worker `to`; a PD pool's decode worker, with its
        pair's `prefill` worker), `no_worker` or `failed`."""
        note = self.record.migration
        if note is not None:
            if to is not None:
                note["to"] = to.id
            if prefill is not None:
                note["prefill"] = prefill.id
            note["outcome"] = outcome
        self._metrics.migrations.labels(pool, outcome).inc()

    def migrated_usage(self, usage: dict[str, Any] | None) -> None:
        """The whole migrated answer's usage (its continuation's, made honest)."""
        self.record.usage = usage

    def migration_prefilled(self, pool: str, tokens: int) -> None:
        """Continuations prefilled `tokens` prompt tokens again (not billed to the key)."""
        self._metrics.migration_prefill_tokens.labels(pool).inc(tokens)
        if self.record.migration is not None:
            self.record.migration["prefill_tokens"] = tokens

    # --- the end ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Settle the held quota (`quota_used`), note the size of the stored response the stream
        created (`response_stored`, `context_used`), record the metrics and the access log line and
        end the trace; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        record, metrics = self.record, self._metrics
        if self._quota is not None:
            guard, reservation, request = self._quota
            failed = record.outcome is not RequestOutcome.OK or record.status >= 400
            guard.settle_soon(reservation, quota_used(record, request, reservation.tokens, failed))
        if self._stored is not None and (used := context_used(record.usage)) is not None:
            store, response_id = self._stored
            store.note_context(response_id, used)
        now = time.perf_counter()
        if record.disconnect_stage is not None:
            metrics.client_disconnects.labels(record.pool, record.disconnect_stage).inc()
            status = 499  # nginx's "client closed request", for the status-class label only
        else:
            status = record.status
        pool, model = record.pool, record.model
        metrics.requests.labels(record.api, pool, status_class(counted_status(status, record.outcome)), model).inc()
        metrics.request_seconds.labels(pool, model).observe(now - record.started)
        ttft = None
        if record.first_byte_at is not None:
            ttft = record.first_byte_at - record.started
            if record.stream:
                metrics.ttft_seconds.labels(pool, model).observe(ttft)
        usage = record.usage
        if usage:
            completion = usage.get("completion_tokens")
            if record.stream and record.first_byte_at is not None and isinstance(completion, int) and completion > 1:
                metrics.tpot_seconds.labels(pool, model).observe((now - record.first_byte_at) / (completion - 1))
            for kind in ("prompt_tokens", "completion_tokens"):
                value = usage.get(kind)
                if isinstance(value, int) and value > 0:
                    metrics.tokens.labels(pool, kind.removesuffix("_tokens"), model).inc(value)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(cached, int) and cached > 0:
                metrics.tokens.labels(pool, "cached", model).inc(cached)
        if log.isEnabledFor(logging.INFO):
            log.info(orjson.dumps(access_entry(record, status, ttft, now)).decode())
        if self.trace is not None:
            self.trace.finish(record, status, now)


def access_entry(record: RequestRecord, status: int, ttft: float | None, now: float) -> dict[str, Any]:
    """The access log line's fields (`status`: as counted, 499 for a client that hung up; `ttft`
    seconds or None; `now`: the end, perf_counter seconds)."""
    entry = {
        "event": "request", "request_id": record.request_id, "api": record.api, "key": record.key,
        "model": record.model, "pool": record.pool, "worker": record.worker, "reason": record.reason,
        "attempts": record.attempts, "status": status, "outcome": record.outcome, "stream": record.stream,
        "estimated_prompt_tokens": record.estimated_prompt_tokens, "estimate": record.estimate_method,
        "ttft_s": None if ttft is None else round(ttft, 6), "duration_s": round(now - record.started, 6),
        "usage": record.usage, "error": record.error,
    }
    if record.prefill_worker is not None:  # a PD pool's request: `worker` is its decode worker
        entry["prefill_worker"] = record.prefill_worker
    if record.engine_request_id is not None:  # what the engines' own logs call this request
        entry["engine_request_id"] = record.engine_request_id
    if record.migration is not None:  # from, to, outcome, tokens kept, re-prefilled
        entry["migration"] = record.migration
    if record.queued_s is not None:  # held by flow control before it was routed
        entry["queued_s"] = round(record.queued_s, 6)
    return entry


def quota_used(record: RequestRecord, request: RoutingRequest, reserved: int, failed: bool) -> int | None:
    """The tokens a request that ended (`failed`: with an error, or a stream cut short) counts
    against its key's token limit: the engine's usage (prompt + completion tokens) when it
    reported one (a prompt it counted as 0, or did not report where its output was, is charged
    at the estimate: no prompt is empty); the reservation when the client hung up, or a complete
    answer came without usage (nothing to settle by); the prompt estimate when an engine accepted
    the request (or may have been working on it) and it failed later; 0 when an engine read it and
    refused it (a 4xx, "too long"): its tokens go back but its request stays counted, or refused
    bodies would reach the engines past the key's request limit; None, "release it all", when no
    engine worked on it (refused connections, 5xx/429 answers, no worker free)."""
    usage = record.usage
    estimate = request.batch_prompt_tokens if request.batch_prompt_tokens is not None else request.prompt_tokens
    if usage is not None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            return (prompt if prompt > 0 else estimate) + completion
    if record.disconnect_stage is not None or (record.reached_engine and not failed):
        return reserved
    if record.reached_engine:
        return estimate
    return 0 if record.engine_refused else None


def context_used(usage: dict[str, Any] | None) -> int | None:
    """The tokens of the conversation an engine stores with a response whose usage is `usage`
    (OpenAI's chat names, which `protocol.responses.chat_usage` adds): its prompt (the stored
    conversation it continued included) + its output, which a `previous_response_id` follow-up's
    prompt starts with; None without both counts, or with a prompt counted as 0 (no prompt is
    empty: the estimate stays, as `quota_used` charges it)."""
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int and prompt > 0 and completion >= 0:
        return prompt + completion
    return None
