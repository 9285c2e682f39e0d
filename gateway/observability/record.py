"""One request's account: the data its ledger (gateway/dispatch/ledger.py) writes along the request
path and turns, once, into metrics, an access-log line and the trace's attributes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from gateway.observability.metrics import NO_MODEL, NO_POOL


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
    """What the request path calls on a request's trace: gateway/observability/tracing.py's `RequestTrace`
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

    Written only by the request's `Ledger` (gateway/dispatch/ledger.py); everyone else reads it.
    `outcome` is a `RequestOutcome`: `ok`, `error` (the client got an error status), `timeout` (over
    `timeouts.total`), `upstream_error` (the answer broke after the engine accepted it),
    `shutting_down` (cut at the end of the shutdown grace period) or `client_disconnect`.
    """

    request_id: str  # the client's `x-request-id` (echoed to it, logged), else one the gateway made
    api: str
    started: float = field(default_factory=time.perf_counter)
    pool: str = NO_POOL
    model: str = NO_MODEL  # the resolved model (configured, or a known LoRA adapter): the metrics' `model` label
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
    reached_engine: bool = False  # an engine accepted the request or may have worked on it (quota settle)
    engine_refused: bool = False  # an engine read the request and refused it (4xx, too long): a request spent
    engine_request_id: str | None = None  # engines get `x-request-id: {this}-{attempt}` (set by the first attempt)
    migration: dict[str, Any] | None = None  # a stream continued on another worker (gateway/dispatch/migration.py)
    queued_s: float | None = None  # seconds flow control held it at the gateway (gateway/flow/), None: not held
