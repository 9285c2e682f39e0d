"""Saturation: how many more requests each worker of a flow-controlled pool may take now.

Signals, per worker (`Worker`): its engine's waiting requests and KV cache usage as the last load
scrape read them (`gateway/backends/load.py`, every `load.interval` s; `Worker.scraped_at` is when
that scrape was sent), and this replica's requests sent there that have not started yet
(`Starts`: sent, no first byte): the engine counted those sent before the scrape in its waiting
or running requests, not those sent after it. So the worker's queue is

    queued = engine waiting (at the scrape) + this replica's not-started requests sent since the scrape

and its **room** is `max_waiting - queued`, none when its KV cache usage is at least
`max_kv_usage` or this replica's not-started requests hold `max_prefill_tokens` estimated prompt
tokens. A stream starts at its first content; a non-streamed answer's first byte is its end, so a
non-streamed request counts until the next scrape shows where it is. An engine that exports no
load metrics (or a failed scrape) leaves this replica's own not-started requests as its queue.

Work-conserving: a worker whose engine queues fewer than `max_waiting` requests has room, so the
gateway never holds a request while a worker would start it at its next step. The pool's room is
the sum of its in-service workers', within the pool's `max_in_flight` / `max_in_flight_per_worker`.

A prefill/decode pool's room is its decode workers' (the worker of a request's attempt), none
while every prefill worker's engine is saturated. A decode engine sees a request only once its
prefill is done, so there this replica's not-started requests count whenever they were sent:
`max_waiting` bounds the requests in prefill and KV transfer per decode worker.
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
    send until its first byte or its end (`tickets`; `tokens`: their estimated prompt tokens)."""

    __slots__ = ("tickets", "tokens")

    def __init__(self) -> None:
        self.tickets: list[StartTicket] = []
        self.tokens = 0

    def since(self, at: float) -> int:
        """How many were sent after `at` (time.monotonic() s)."""
        return sum(1 for ticket in self.tickets if ticket.sent_at > at)


class StartTicket:
    """One request sent to a worker, not started yet: counted in its worker's `Starts` until
    `started` (its first byte) or `close` (its slot released), whichever comes first; either calls
    `on_change` (the pool's room may have grown). `started` takes the first byte's time as the
    ledger's `watch_first_byte` callbacks do."""

    __slots__ = ("_on_change", "_open", "_starts", "sent_at", "tokens")

    def __init__(self, starts: Starts, tokens: int, on_change: Callable[[], None]) -> None:
        self._starts = starts
        self._on_change = on_change
        self._open = True
        self.tokens = tokens
        self.sent_at = time.monotonic()
        starts.tickets.append(self)
        starts.tokens += tokens

    def started(self, at: float = 0.0) -> None:
        """The first byte came (`at`: its perf_counter time, unused)."""
        self.close()

    def close(self) -> None:
        """Not waiting any more (idempotent)."""
        if self._open:
            self._open = False
            starts = self._starts
            starts.tickets.remove(self)
            starts.tokens -= self.tokens
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
        if config.max_prefill_tokens is not None and starts.tokens >= config.max_prefill_tokens:
            return 0
        waiting += len(starts.tickets) if decode else starts.since(worker.scraped_at)
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
