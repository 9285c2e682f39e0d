"""State of one simulated engine: request records, load, counters, faults.

The ASGI app runs in uvicorn's event loop (often in a background thread) while tests read the
records from another thread, so every mutation happens under one re-entrant lock and wakes
`wait_for` callers. Nothing here is global: each `SimEngine` owns its state and its own
Prometheus `CollectorRegistry`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from gateway.sim.config import SimConfig, SimFaults
from gateway.sim.dialects import EngineDialect, dialect_for
from gateway.sim.metrics import EngineStats, build_registry

T = TypeVar("T")


@dataclass
class SimRequestRecord:
    """What the simulator saw of one generation request.

    Times are `time.monotonic()` seconds (None until the event happens). `headers` has lowercase
    names; `body` is the parsed JSON as received (including any `x_sim_faults`; the raw text when
    it is not JSON). `aborted` is True when the client disconnected before the response completed
    (`finished_at` is then when that was noticed); `fault` names an injected fault
    that shaped the answer ("fail_status", "hang_before_headers", "drop_after_chunks",
    "raw_stream_chunks").
    """

    id: int
    path: str
    headers: dict[str, str]
    body: Any
    received_at: float
    headers_at: float | None = None
    first_byte_at: float | None = None
    finished_at: float | None = None
    status: int | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens_sent: int = 0
    aborted: bool = False
    completed: bool = False
    fault: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)


@dataclass
class ActiveRequest:
    """A request admitted for processing (counts as running): its tokens occupy the KV cache."""

    prompt_tokens: int
    generated: int = 0


class KVUsageModel(Protocol):
    """Maps the running requests to a KV-cache usage fraction in [0, 1]."""

    def usage(self, active: list[ActiveRequest]) -> float: ...


@dataclass(frozen=True)
class ProportionalKVUsage:
    """KV usage = tokens held by running requests / `capacity_tokens`, capped at 1.0.

    A stand-in until a paged KV cache with prefix reuse is modelled.
    """

    capacity_tokens: int

    def usage(self, active: list[ActiveRequest]) -> float:
        held = sum(a.prompt_tokens + a.generated for a in active)
        return min(1.0, held / self.capacity_tokens)


class SimEngine:
    """Config, state and records of one simulated engine.

    `records` is a snapshot list (the record objects themselves keep updating); `wait_for` blocks a
    thread until a predicate holds; `async_wait_for` does the same inside an event loop.
    """

    def __init__(self, config: SimConfig, kv_model: KVUsageModel | None = None) -> None:
        self.config = config
        self.dialect: EngineDialect = dialect_for(config.engine, config.api_version)
        self.kv_model: KVUsageModel = kv_model or ProportionalKVUsage(config.max_context_tokens)
        self.started_at = int(time.time())
        self._cond = threading.Condition(threading.RLock())
        self._ids = itertools.count(1)
        self._records: list[SimRequestRecord] = []
        self._faults = config.faults.model_copy(deep=True)
        self._active: list[ActiveRequest] = []
        self._waiting = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished: Counter[str] = Counter()
        self._health_checks = 0
        self._admission: asyncio.Semaphore | None = None
        self.registry = build_registry(self.stats, self.dialect, config.model_name)

    # --- records -----------------------------------------------------------------------------

    @property
    def records(self) -> list[SimRequestRecord]:
        """All records so far, oldest first (a new list; the records are live objects)."""
        with self._cond:
            return list(self._records)

    def new_record(self, path: str, headers: dict[str, str], body: Any) -> SimRequestRecord:
        """Create and store the record of a request whose body has just been read."""
        with self._cond:
            record = SimRequestRecord(id=next(self._ids), path=path, headers=headers, body=body,
                                      received_at=time.monotonic())
            self._records.append(record)
            self._cond.notify_all()
            return record

    def update(self, record: SimRequestRecord, **changes: Any) -> None:
        """Set fields of `record` (under the lock) and wake waiters."""
        with self._cond:
            for name, value in changes.items():
                setattr(record, name, value)
            self._cond.notify_all()

    def clear_records(self) -> int:
        """Forget all records; returns how many there were."""
        with self._cond:
            count = len(self._records)
            self._records.clear()
            self._cond.notify_all()
            return count

    def wait_for(self, predicate: Callable[[], T], timeout: float = 5.0) -> T:
        """Block the calling thread until `predicate()` is truthy; return its value.

        Raises TimeoutError after `timeout` seconds. Do not call from the sim's own event loop.
        """
        with self._cond:
            result = self._cond.wait_for(predicate, timeout)
        if not result:
            raise TimeoutError(f"condition not met within {timeout} s")
        return result

    async def async_wait_for(self, predicate: Callable[[], T], timeout: float = 5.0,
                             poll_s: float = 0.005) -> T:
        """`wait_for` for code running in an event loop (polls without blocking the loop)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                result = predicate()
            if result:
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(f"condition not met within {timeout} s")
            await asyncio.sleep(poll_s)

    # --- faults ------------------------------------------------------------------------------

    @property
    def faults(self) -> SimFaults:
        """The global faults now in force (a copy)."""
        with self._cond:
            return self._faults.model_copy(deep=True)

    def set_faults(self, faults: SimFaults) -> None:
        """Replace the global faults."""
        with self._cond:
            self._faults = faults.model_copy(deep=True)

    def effective_faults(self, override: SimFaults | None) -> tuple[SimFaults, bool]:
        """Faults for one request and whether it must fail with `fail_status`.

        Fields set in the request's `x_sim_faults` win. A per-request `fail_status` fails that
        request (unless its `fail_count` is 0); the global one fails while its count lasts
        (`None` = always) and counts down.
        """
        with self._cond:
            faults = self._faults if override is None else self._faults.overridden_by(override)
            if faults.fail_status is None:
                return faults, False
            if override is not None and "fail_status" in override.model_fields_set:
                return faults, faults.fail_count != 0
            remaining = self._faults.fail_count
            if remaining is None:
                return faults, True
            if remaining <= 0:
                return faults, False
            self._faults = self._faults.model_copy(update={"fail_count": remaining - 1})
            return faults, True

    # --- load ---------------------------------------------------------------------------------

    def admission(self) -> asyncio.Semaphore | None:
        """The semaphore bounding running requests (`max_num_seqs`), created in the serving loop."""
        if self.config.max_num_seqs is None:
            return None
        if self._admission is None:
            self._admission = asyncio.Semaphore(self.config.max_num_seqs)
        return self._admission

    def add_waiting(self, delta: int) -> None:
        """Count a request entering (+1) or leaving (-1) the wait queue."""
        with self._cond:
            self._waiting += delta
            self._cond.notify_all()

    def start_running(self, prompt_tokens: int) -> ActiveRequest:
        """Admit a request: it counts as running and its prompt is prefilled (counted)."""
        with self._cond:
            active = ActiveRequest(prompt_tokens)
            self._active.append(active)
            self._prompt_tokens_total += prompt_tokens
            self._cond.notify_all()
            return active

    def note_generated(self, active: ActiveRequest, tokens: int = 1) -> None:
        """Count `tokens` newly generated by a running request."""
        with self._cond:
            active.generated += tokens
            self._generation_tokens_total += tokens
            self._cond.notify_all()

    def stop_running(self, active: ActiveRequest, finish_reason: str) -> None:
        """A running request ended ("stop", "length" or "abort")."""
        with self._cond:
            if active in self._active:
                self._active.remove(active)
                self._finished[finish_reason] += 1
            self._cond.notify_all()

    def note_health_check(self) -> None:
        """Count one `GET /health`."""
        with self._cond:
            self._health_checks += 1

    @property
    def health_checks(self) -> int:
        """How many `GET /health` requests arrived."""
        with self._cond:
            return self._health_checks

    def stats(self) -> EngineStats:
        """A snapshot of the load and the counters."""
        with self._cond:
            return EngineStats(
                running=len(self._active),
                waiting=self._waiting,
                kv_usage=self.kv_model.usage(list(self._active)),
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
                finished_by_reason=dict(self._finished),
            )
