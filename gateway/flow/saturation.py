"""Saturation: how many more requests each worker of a flow-controlled pool may take now.

Signals, per worker (`Worker`): its engine's waiting requests and KV cache usage as the last load
scrape read them (`gateway/backends/load.py`, every `load.interval` s; `Worker.scraped_at` is when
that scrape was sent), and this replica's requests sent there that have not started yet
(`Starts`: sent, no first byte). A stream starts at its first content token, so until then it is
waiting or in prefill there; a non-streamed answer's first byte is its end, so such a request is
taken as not started only until the next scrape shows where it is. Two queues follow:

    waiting  = engine waiting (at the scrape) + this replica's requests sent since the scrape, not started
    prefill  = estimated uncached prompt tokens of this replica's streams there without a first
               token, and of its non-streamed requests sent since the scrape

A worker is **saturated** when its KV cache usage is at least `max_kv_usage`, its waiting queue
holds `max_waiting` requests (its engine admits no more into its batch: slots or KV memory are
full), or its prefill queue holds `max_prefill_tokens` (its prefill budget is spoken for: a new
request would wait behind that much prefill whichever way it is scheduled). Its **room** is
`max_waiting - waiting` (none when saturated), and at most one while `max_prefill_tokens` is set:
the next request's tokens are counted (it is sent) before the one after it is let go, so the
bound is not overrun by several requests let go at once.

Work-conserving: a worker whose engine queues fewer than `max_waiting` requests and has fewer
than `max_prefill_tokens` of this replica's prompt tokens still to prefill has room, so the engine
always has a batch slot's and a prefill step's worth of work (vLLM's `max_num_batched_tokens`,
SGLang's `chunked_prefill_size`: 8,192 tokens by default on large GPUs) while requests wait at the
gateway. An engine that exports no load metrics (or a failed scrape) leaves this replica's own
requests as its queues.

The pool's room is the sum of its in-service workers', within the pool's `max_in_flight` /
`max_in_flight_per_worker`. A prefill/decode pool's room is its decode workers' (the worker of a
request's attempt), none while every prefill worker's engine is saturated. A decode engine sees a
request only once its prefill is done, so there every not-started request of this replica counts
in its waiting queue whenever it was sent (`max_waiting` bounds the requests in prefill and KV
transfer per decode worker) and the prefill bound does not apply (the prefill runs elsewhere).
Units: requests, tokens, time.monotonic() seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from gateway.backends.capacity import PoolGate
from gateway.backends.worker import Worker
from gateway.flow.params import PoolFlowConfig


class Starts:
    """This replica's requests on one worker that have not started: each `StartTicket` from its
    send until its first byte or its end."""

    __slots__ = ("tickets",)

    def __init__(self) -> None:
        self.tickets: list[StartTicket] = []

    def since(self, at: float) -> int:
        """How many were sent after `at` (time.monotonic() s)."""
        return sum(1 for ticket in self.tickets if ticket.sent_at > at)

    def prefill(self, at: float) -> int:
        """Their estimated prompt tokens still to prefill: every stream's, and the non-streamed
        requests' sent after `at` (the last scrape)."""
        return sum(ticket.tokens for ticket in self.tickets if ticket.stream or ticket.sent_at > at)


class StartTicket:
    """One request sent to a worker, not started yet: counted in its worker's `Starts` until
    `started` (its first byte) or `close` (its slot released), whichever comes first; either calls
    `on_change` (the pool's room may have grown). `tokens`: its estimated uncached prompt tokens;
    `stream`: whether its first byte is its first token. `started` takes the first byte's time as
    the ledger's `watch_first_byte` callbacks do."""

    __slots__ = ("_on_change", "_open", "_starts", "sent_at", "stream", "tokens")

    def __init__(self, starts: Starts, tokens: int, stream: bool, on_change: Callable[[], None]) -> None:
        self._starts = starts
        self._on_change = on_change
        self._open = True
        self.tokens = tokens
        self.stream = stream
        self.sent_at = time.monotonic()
        starts.tickets.append(self)

    def started(self, at: float = 0.0) -> None:
        """The first byte came (`at`: its perf_counter time, unused)."""
        self.close()

    def close(self) -> None:
        """Not waiting any more (idempotent)."""
        if self._open:
            self._open = False
            self._starts.tickets.remove(self)
            self._on_change()


def worker_room(worker: Worker, starts: Starts | None, config: PoolFlowConfig, decode: bool = False) -> int:
    """How many more requests `worker` may take before it is saturated (see the module docstring).
    `decode`: a PD pool's decode worker, whose engine sees a request only once its prefill is
    done: all of this replica's not-started requests there count, whenever they were sent."""
    kv = worker.kv_usage
    if kv is not None and kv >= config.max_kv_usage:
        return 0
    waiting = math.ceil(worker.engine_waiting or 0.0)
    if starts is not None:
        if decode:
            waiting += len(starts.tickets)
        else:
            waiting += starts.since(worker.scraped_at)
            bound = config.max_prefill_tokens
            if bound is not None:  # one request at a time: its tokens count before the next is let go
                return 1 if starts.prefill(worker.scraped_at) < bound and waiting < config.max_waiting else 0
    return max(config.max_waiting - waiting, 0)


def pool_room(workers: Iterable[Worker], prefills: Iterable[Worker] | None, gate: PoolGate,
              starts: Callable[[Worker], Starts | None], config: PoolFlowConfig) -> int:
    """The pool's room: the sum of `workers`' rooms (its in-service workers; a PD pool's decode
    workers), each within the gate's per-worker limit, the total within its `max_in_flight`; 0 when
    `prefills` (a PD pool's in-service prefill workers) are all saturated or none."""
    decode = prefills is not None
    if decode and not any(worker_room(w, None, config) for w in prefills or ()):
        return 0
    per_worker = gate.per_role.get("decode") if decode else gate.per_worker
    room = 0
    for worker in workers:
        own = worker_room(worker, starts(worker), config, decode)
        if per_worker is not None:
            own = min(own, max(per_worker - worker.in_flight, 0))
        room += own
    if gate.total is not None:
        room = min(room, max(gate.total - gate.in_flight, 0))
    return room
