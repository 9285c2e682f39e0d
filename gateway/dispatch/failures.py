"""Judging failed attempts: what one failure leads to (`after_failure`: the same pool, a larger
one, or a final answer), what the failures of one request show together (`Failures`), and the
error for a request no worker accepted (`exhausted`).

Passive health is decided here: a 429 backs its worker off, a refused connection or a 5xx that
is the worker's own counts against it, a 5xx two workers give alike is the request's fault.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import DEFAULT_RETRY_AFTER_S, WorkerRegistry
from gateway.backends.worker import Worker
from gateway.dispatch.answers import NO_CLIENT_RETRY, BufferedResponse, engine_error, request_fault
from gateway.dispatch.ledger import Ledger
from gateway.errors import GatewayError, NoCapacity, UpstreamError, UpstreamTimeout
from gateway.observability.record import RequestRecord
from gateway.routing.features import RoutingRequest
from gateway.routing.pools import larger_pools
from gateway.streaming import RETRYABLE, AttemptFailed, Outcome


@dataclass(slots=True)
class Failures:
    """What a request's failed attempts showed that one attempt cannot judge alone.

    `suspect` is a 5xx not yet held against its worker: if the next worker fails the same way,
    the request caused both (a client must never be able to eject a pool); otherwise it is
    charged (`charge`). `busy` is the 429 with the shortest Retry-After.
    """

    suspect: tuple[Worker, AttemptFailed] | None = None
    busy: AttemptFailed | None = None

    def charge(self, ledger: Ledger) -> None:
        """Hold the suspect 5xx against its worker after all (passive health)."""
        if self.suspect is not None:
            worker, failure = self.suspect
            self.suspect = None
            ledger.worker_failed(worker, failure.detail)

    def note_busy(self, failure: AttemptFailed) -> None:
        """Remember a 429 if its Retry-After is the shortest so far (the exhausted answer's wait)."""
        def wait(f: AttemptFailed) -> float:
            return DEFAULT_RETRY_AFTER_S if f.retry_after is None else f.retry_after
        if self.busy is None or wait(failure) < wait(self.busy):
            self.busy = failure


def after_failure(ledger: Ledger, failure: AttemptFailed, worker: Worker, pool: PoolConfig,
                  pools: list[PoolConfig], request: RoutingRequest,
                  too_long_retried: bool, failures: Failures) -> PoolConfig | BufferedResponse:
    """What a failed attempt leads to: the pool to try next (the same one, or the next larger
    one once after an engine's "too long"), or the engine's own error for the client, also
    when a second worker failed exactly as the one before (the request's fault, held
    against neither). Passive health: a 429 backs its worker off, a refused connection or a 5xx
    that is the worker's own counts against it (`failures` holds a 5xx until the next attempt
    tells whether the request caused it); the verdicts go through the request's `ledger`.

    Raises UpstreamError / UpstreamTimeout for failures no other worker should repeat.
    """
    outcome = failure.outcome
    if outcome is Outcome.TOO_LONG:
        larger = larger_pools(pool, pools)
        if too_long_retried or not larger:
            return engine_error(failure, ledger)
        return larger[0]
    if outcome is Outcome.AUTH_ERROR:
        raise UpstreamError(f"The inference server of pool {pool.name} refused the gateway's "
                            "credentials; check the pool's api_key.")
    if outcome is Outcome.TIMEOUT and not request.stream and (failure.answered or ledger.served_others(worker)):
        # The engine was generating: it had answered, or (a whole answer's headers come with its last
        # byte) it passed its health probes and answered other requests all the while, so the request's
        # own length outran its budget. Held against nobody, and no other worker is made to repeat it.
        raise UpstreamTimeout(f"The inference server did not answer in time ({failure.detail}).",
                              headers=dict(NO_CLIENT_RETRY))
    if outcome not in RETRYABLE:
        return engine_error(failure, ledger)
    if outcome is Outcome.STATUS_429:  # busy, not broken
        ledger.worker_throttled(worker, failure.retry_after)
        failures.note_busy(failure)
    elif outcome is Outcome.CONNECT_ERROR:
        ledger.worker_unreachable(worker, failure.detail)
    elif outcome is Outcome.MOVED:  # a moved attempt's worker is already marked unhealthy
        pass
    elif _may_be_the_requests_fault(failure):
        suspect = failures.suspect
        if suspect is not None and suspect[0] is not worker and _same_failure(suspect[1], failure):
            failures.suspect = None  # two workers, one answer: the request's doing
            return request_fault(failure, ledger)
        failures.charge(ledger)  # the earlier one differed: that worker's own failure
        failures.suspect = (worker, failure)
    else:
        ledger.worker_failed(worker, failure.detail)
    return pool


def exhausted(registry: WorkerRegistry, last: AttemptFailed | None, record: RequestRecord,
              pools: list[PoolConfig], failures: Failures) -> GatewayError:
    """The error for a request no worker accepted, naming the pool it was meant for (`pools[0]`),
    the pools it spilled over to and why no worker took it: NoCapacity (503, with the shortest
    honest Retry-After; `upstream_overloaded` when every worker is only busy), UpstreamTimeout
    (504), or UpstreamError (502) after `record.attempts` failed attempts."""
    where = f"pool {pools[0].name}"
    if record.pool != pools[0].name:
        where += f" (and the pools it spilled over to, up to {record.pool})"
    if last is None or last.outcome in (Outcome.CONNECT_ERROR, Outcome.MOVED):
        wait, cause, busy = unavailable(registry, pools)
        if last is not None:
            cause = f"{last.detail}; {cause}"
        return NoCapacity(f"No inference server of {where} can take the request now ({cause}); "
                          f"try again in {wait} s.", headers={"retry-after": str(wait)},
                          code="upstream_overloaded" if busy else None)
    if last.outcome is Outcome.TIMEOUT:
        # A non-streaming one spent its whole answer budget on each worker: the SDK must not resend it.
        return UpstreamTimeout(f"The inference server of {where} did not answer in time ({last.detail}).",
                               headers=None if record.stream else dict(NO_CLIENT_RETRY))
    if last.outcome is Outcome.STATUS_429:
        soonest = failures.busy or last  # the 429 with the shortest Retry-After
        wait = max(1, math.ceil(soonest.retry_after if soonest.retry_after is not None else DEFAULT_RETRY_AFTER_S))
        return NoCapacity(f"Every inference server of {where} is busy (HTTP 429); try again in {wait} s.",
                          headers={**soonest.headers, "retry-after": str(wait)}, code="upstream_overloaded")
    return UpstreamError(f"The inference servers of {where} failed to answer ({last.detail}) after "
                         f"{record.attempts} attempt{'s' if record.attempts != 1 else ''}.")


def unavailable(registry: WorkerRegistry, pools: list[PoolConfig]) -> tuple[int, str, bool]:
    """For a request that found no candidate: the shortest honest wait in whole seconds (the
    soonest a worker of its pools is back: a 429's back-off or an ejection ending, or the
    next health probe for an unhealthy one; at least 1), the workers' states as the cause,
    and whether every worker out of service is only busy (429 back-offs)."""
    now = registry.clock()
    waits: list[float] = []
    states: list[str] = []
    busy = 0
    for pool in pools:
        if pool.name not in registry.pools:  # the request's pools are those of its arrival
            states.append(f"pool {pool.name} removed by a reload")
            continue
        for worker in registry.pools[pool.name]:
            if worker.draining:
                states.append(f"{worker.id} draining")
                continue
            if not worker.healthy:
                waits.append(registry.health.interval)
                state = "unhealthy"
            elif worker.misconfigured is not None:
                waits.append(registry.health.interval)
                state = f"misconfigured ({worker.misconfigured})"
            elif worker.ejected_until > now:
                waits.append(worker.ejected_until - now)
                state = "ejected"
            elif worker.busy_until > now:
                waits.append(worker.busy_until - now)
                state = "busy (429)"
                busy += 1
            else:
                waits.append(0.0)
                state = "tried"
            states.append(f"{worker.id} {state}" + (f": {worker.last_error}" if worker.last_error else ""))
    shown = "; ".join(states[:8]) + (f"; and {len(states) - 8} more" if len(states) > 8 else "")
    return max(1, math.ceil(min(waits, default=1.0))), shown or "no workers", 0 < busy == len(states)


# 502/503/504 say "busy or broken in between", never "this request": they are not compared.
_NOT_THE_REQUEST = frozenset({502, 503, 504})
_VOLATILE = re.compile(rb"[0-9a-fA-F][0-9a-fA-F-]{15,}")  # request ids, UUIDs: differ per attempt
# Base62 request ids (`req_7Hk2LpQ9xZ`), timestamps and epoch seconds differ per attempt too: any
# word of 8+ id/time characters holding a digit (short numbers like "worker 1" still tell causes apart).
_ID_LIKE = re.compile(rb"[A-Za-z0-9_.:+-]{8,}")


def _may_be_the_requests_fault(failure: AttemptFailed) -> bool:
    return failure.outcome is Outcome.STATUS_5XX and failure.status not in _NOT_THE_REQUEST


def _same_failure(first: AttemptFailed, second: AttemptFailed) -> bool:
    """Two engine answers with the same status and the same error body (ids aside)."""
    return first.status == second.status and _without_ids(first.body) == _without_ids(second.body)


def _without_ids(body: bytes) -> bytes:
    body = _VOLATILE.sub(b"#", body)
    return _ID_LIKE.sub(lambda m: b"#" if any(48 <= c <= 57 for c in m[0]) else m[0], body)
