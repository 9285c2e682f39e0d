"""Compact per-request timing records of a simulated engine, for benchmarks (`GET /sim/timings`).

A `SimRequestRecord` holds the whole request body (prompts of up to ~500 KB in the trace replay),
so long benchmarks turn records off (`SimConfig.keep_records=False`). A `SimTiming` keeps only the
times and token counts of one finished generation request (a few hundred bytes), in a bounded log:
the last `SimConfig.timing_records` requests (0, the default: none kept); older ones are dropped
and counted.

How a benchmark finds its own request among a worker's timings: by the `x-request-id` header the
worker received (`request_id`), or by the body's `x_request_tag` string (`tag`). Routers differ in
what they pass on: SGLang's router (sglang-router 0.3.2) forwards the client's `x-request-id` but
rebuilds the body from its typed request (unknown fields, `user`, `rid` and `request_id` are gone);
the gateway gives the engine its own `x-request-id` (`{engine request id}-{attempt}`,
gateway/dispatch/ledger.py `upstream_headers`) and relays the body's unknown fields. A client that
sends both finds its request behind either.

Times are `time.monotonic()` seconds (CLOCK_MONOTONIC on Linux: one clock for every process on a
host, so they compare with a client's `time.monotonic()` on the same machine). Per request:
`received_at` (the body was read), `admitted_at` (first admission: out of the wait queue, its
prefill may start; None if it never was), `first_byte_at` (the first body byte of the answer: in
a stream the first event, sent once the prefill produced the first token), `finished_at`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

TAG_FIELD = "x_request_tag"
"""The body field a benchmark client may set to find its request here (any string)."""


@dataclass(slots=True)
class SimTiming:
    """One finished generation request's times (monotonic seconds) and tokens (see the module
    docstring; made by `SimRequestRecord.timing`). `cached_tokens` of `prompt_tokens` were found in
    the prefix cache at admission, `prefill_tokens` had to be computed."""

    id: int
    path: str
    request_id: str | None
    tag: str | None
    received_at: float
    admitted_at: float | None
    first_byte_at: float | None
    finished_at: float | None
    status: int | None
    aborted: bool
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, Any]:
        """The timing as a JSON-ready dict."""
        return asdict(self)


class TimingLog:
    """The last `capacity` timings (0: none kept). Not thread-safe by itself: the engine calls it
    under its lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._items: deque[SimTiming] = deque(maxlen=capacity or 1)
        self.dropped = 0
        """Timings pushed out by newer ones since the last clear."""

    def add(self, timing: SimTiming) -> None:
        """Keep `timing`, dropping the oldest one when full."""
        if self.capacity == 0:
            return
        if len(self._items) == self.capacity:
            self.dropped += 1
        self._items.append(timing)

    def snapshot(self) -> dict[str, Any]:
        """`{"capacity": N, "dropped": D, "timings": [...]}`, oldest first."""
        return {"capacity": self.capacity, "dropped": self.dropped, "timings": [t.to_json() for t in self._items]}

    def clear(self) -> int:
        """Forget every timing and the drop count; returns how many were kept."""
        count = len(self._items)
        self._items.clear()
        self.dropped = 0
        return count
