"""One request's account: filled in along the request path, written once as metrics and a log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import orjson

from gateway.metrics import NO_POOL, GatewayMetrics, status_class

log = logging.getLogger("gateway.access")


class RequestOutcome(StrEnum):
    """How one client request ended (a bounded set: the access log's `outcome`, the trace's attribute).

    Attempts have their own `streaming.Outcome`; this is the request's, set along the request path.
    """

    OK = "ok"
    ERROR = "error"  # the client got an error status
    TIMEOUT = "timeout"  # over `timeouts.total` (the overall cap)
    UPSTREAM_ERROR = "upstream_error"  # the answer broke after the engine had accepted it
    SHUTTING_DOWN = "shutting_down"  # cut at the end of the shutdown grace period
    CLIENT_DISCONNECT = "client_disconnect"


# The status class a 200 stream is counted under when it ended badly.
_CUT_STATUS = {RequestOutcome.UPSTREAM_ERROR: 502, RequestOutcome.TIMEOUT: 504, RequestOutcome.SHUTTING_DOWN: 503}


def counted_status(status: int, outcome: RequestOutcome) -> int:
    """The HTTP status a request is counted under in `requests_total`: its own, or for a 2xx/4xx
    whose answer was cut (a 200 stream that broke, ran over the cap or was cut at shutdown) the
    status the cut stands for (502, 504, 503)."""
    if status < 500:
        return _CUT_STATUS.get(outcome, status)
    return status


class RequestSpans(Protocol):
    """What the request path calls on a request's trace: gateway/tracing.py's `RequestTrace`
    (named here as an interface, so this module does not import tracing, which imports it)."""

    def start_attempt(self, pool: str, worker: str) -> dict[str, str]:
        """Open an `upstream` span; returns the `traceparent` header(s) for the engine request."""
        ...

    def end_attempt(self, outcome: str) -> None:
        """Close the open `upstream` span with its outcome."""
        ...

    def finish(self, record: RequestRecord, status: int, ended: float) -> None:
        """End the request's spans from the record's times (`time.perf_counter()` seconds)."""
        ...


@dataclass(slots=True)
class RequestRecord:
    """What happened to one client request. Times are `time.perf_counter()` seconds.

    `outcome` is a `RequestOutcome`: `ok`, `error` (the client got an error status), `timeout` (over
    `timeouts.total`), `upstream_error` (the answer broke after the engine accepted it),
    `shutting_down` (cut at the end of the shutdown grace period) or `client_disconnect`.
    """

    request_id: str  # the client's `x-request-id` (echoed to it, logged), else one the gateway made
    api: str
    started: float = field(default_factory=time.perf_counter)
    pool: str = NO_POOL
    worker: str | None = None
    prefill_worker: str | None = None  # a PD pool's prefill worker (`worker` is then the decode worker)
    reason: str | None = None
    skipped_pools: list[str] | None = None  # pools that fit but whose engines do not serve `api`
    attempts: int = 0
    status: int = 0
    stream: bool = False
    estimated_prompt_tokens: int | None = None
    estimate_method: str | None = None
    first_byte_at: float | None = None
    usage: dict[str, Any] | None = None
    outcome: RequestOutcome = RequestOutcome.OK
    disconnect_stage: str | None = None
    error: str | None = None
    key: str | None = None  # the API key's configured name (auth on), never the key
    trace: RequestSpans | None = None  # OpenTelemetry spans (gateway/tracing.py) when tracing is on
    open_attempt: Any = None  # the Worker of an upstream attempt still running (a cut one stays set)
    attempt_answered: bool = False  # that attempt's engine has sent its response headers
    attempt_at: float = 0.0  # when that attempt started
    prefill_pending: Any = None  # a PD attempt's prefill Worker while its leg has sent no headers
    reached_engine: bool = False  # an engine accepted the request or may have worked on it (quota settle)
    engine_refused: bool = False  # an engine read the request and refused it (4xx, too long): a request spent
    on_finish: Callable[[RequestRecord], None] | None = None  # called once by `finish` (quota settle)
    on_first_byte: Callable[[float], None] | None = None  # called with `first_byte_at` when it is set (prefill)
    engine_request_id: str | None = None  # engines get `x-request-id: {this}-{attempt}` (set by the first attempt)
    migration: dict[str, Any] | None = None  # a stream continued on another worker (gateway/dispatch/migration.py)
    _finished: bool = False

    def cut_by_shutdown(self, response_started: bool, status: int = 503) -> None:
        """The server ended the request at the end of its shutdown grace period. `status`: what the
        client got if nothing was sent yet: gateway/lifecycle.py's 503 (a started stream gets one SSE
        error event), or uvicorn's 500 when its own graceful-shutdown timeout cancelled the request."""
        self.outcome = RequestOutcome.SHUTTING_DOWN
        self.error = "the gateway shut down before the response ended"
        if not response_started:
            self.status = status

    def client_gone(self, stage: str) -> None:
        """The client hung up at `stage` (`before_response` or `mid_stream`), or stopped reading and was
        cut off (`send_stalled`, gateway/request_head.py)."""
        if self.disconnect_stage is None:
            self.disconnect_stage = stage
            self.outcome = RequestOutcome.CLIENT_DISCONNECT

    def answered_with_error(self, status: int) -> None:
        """The client gets error status `status`: the outcome becomes `error` unless a cause was
        already named (`timeout`, `upstream_error`, ...)."""
        self.status = status
        if self.outcome is RequestOutcome.OK:
            self.outcome = RequestOutcome.ERROR

    def finish(self, metrics: GatewayMetrics) -> None:
        """Record metrics and the access log line; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        if self.on_finish is not None:
            self.on_finish(self)
        now = time.perf_counter()
        if self.disconnect_stage is not None:
            metrics.client_disconnects.labels(self.pool, self.disconnect_stage).inc()
            status = 499  # nginx's "client closed request", for the status-class label only
        else:
            status = self.status
        metrics.requests.labels(self.api, self.pool, status_class(counted_status(status, self.outcome))).inc()
        metrics.request_seconds.labels(self.pool).observe(now - self.started)
        ttft = None
        if self.first_byte_at is not None:
            ttft = self.first_byte_at - self.started
            if self.stream:
                metrics.ttft_seconds.labels(self.pool).observe(ttft)
        if self.usage:
            completion = self.usage.get("completion_tokens")
            if self.stream and self.first_byte_at is not None and isinstance(completion, int) and completion > 1:
                metrics.tpot_seconds.labels(self.pool).observe((now - self.first_byte_at) / (completion - 1))
            for kind in ("prompt_tokens", "completion_tokens"):
                value = self.usage.get(kind)
                if isinstance(value, int) and value > 0:
                    metrics.tokens.labels(self.pool, kind.removesuffix("_tokens")).inc(value)
            details = self.usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(cached, int) and cached > 0:
                metrics.tokens.labels(self.pool, "cached").inc(cached)
        if log.isEnabledFor(logging.INFO):
            entry = {
                "event": "request", "request_id": self.request_id, "api": self.api, "key": self.key, "pool": self.pool,
                "worker": self.worker, "reason": self.reason, "attempts": self.attempts,
                "status": status, "outcome": self.outcome, "stream": self.stream,
                "estimated_prompt_tokens": self.estimated_prompt_tokens, "estimate": self.estimate_method,
                "ttft_s": None if ttft is None else round(ttft, 6), "duration_s": round(now - self.started, 6),
                "usage": self.usage, "error": self.error,
            }
            if self.prefill_worker is not None:  # a PD pool's request: `worker` is its decode worker
                entry["prefill_worker"] = self.prefill_worker
            if self.engine_request_id is not None:  # what the engines' own logs call this request
                entry["engine_request_id"] = self.engine_request_id
            if self.migration is not None:  # from, to, outcome, tokens kept, re-prefilled
                entry["migration"] = self.migration
            log.info(orjson.dumps(entry).decode())
        if self.trace is not None:
            self.trace.finish(self, status, now)
