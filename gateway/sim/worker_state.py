"""State of one simulated engine: request records, admission queue, KV cache, counters, faults.

The ASGI app runs in uvicorn's event loop (often in a background thread) while tests read the
records from another thread, so every mutation happens under one re-entrant lock and wakes
`wait_for` callers. Nothing here is global: each `SimWorkerState` owns its state and its own
Prometheus `CollectorRegistry`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, TypeVar

import httpx

from gateway.sim.active import ActiveRequest
from gateway.sim.config import SimConfig, SimFaults
from gateway.sim.dialects import EngineDialect, dialect_for
from gateway.sim.kvcache import CacheLease, PrefixCache, PromptKey, seed_for
from gateway.sim.metrics import EngineStats, PdMetricsCollector, build_registry
from gateway.sim.pd import PdState
from gateway.sim.request_ids import RunningIds
from gateway.sim.responses import AnswerShape
from gateway.sim.script import SimScript
from gateway.sim.stepper import StepRequest, StepScheduler, new_step_request
from gateway.sim.timings import TAG_FIELD, SimTiming, TimingLog
from gateway.sim.tokens import prompt_keys
from gateway.sim.totals import HitRateWindow, SimTotals

T = TypeVar("T")


@dataclass
class SimRequestRecord:
    """What the simulator saw of one generation request.

    Times are `time.monotonic()` seconds (None until the event happens). `headers` has lowercase
    names; `body` is the parsed JSON as received (including any `x_sim_faults`; the raw text when
    it is not JSON). `aborted` is True when the client disconnected before the response completed
    (`finished_at` is then when that was noticed); `fault` names an injected fault that shaped the
    answer ("fail_status", "hang_before_headers", "black_hole", "drop_after_chunks", "raw_stream_chunks").
    `cached_tokens` of `prompt_tokens` were found in the prefix cache at admission;
    `prefill_tokens` (the rest) had to be computed; `admitted_at` is when the engine first admitted
    it (out of the wait queue: `SimWorkerState._start`, or the step scheduler's
    `StepScheduler._admit`), so `admitted_at - received_at` is its queueing and
    `first_byte_at - admitted_at` its prefill. PD workers (`gateway.sim.pd`): a decode
    worker received `kv_transfer_tokens` of KV from its prefill worker in `kv_transfer_s` seconds;
    `pd_failure` names a failed hand-over ("bootstrap", "transfer", "unknown_handle").
    """

    id: int
    path: str
    headers: dict[str, str]
    body: Any
    received_at: float
    headers_at: float | None = None
    admitted_at: float | None = None
    first_byte_at: float | None = None
    finished_at: float | None = None
    status: int | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens_sent: int = 0
    aborted: bool = False
    completed: bool = False
    fault: str | None = None
    cached_tokens: int = 0
    prefill_tokens: int = 0
    kv_transfer_tokens: int = 0
    kv_transfer_s: float = 0.0
    pd_failure: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)

    def timing(self) -> SimTiming:
        """The request's compact timing (`gateway.sim.timings`): its times, tokens, the
        `x-request-id` it came with and its body's `x_request_tag`."""
        tag = self.body.get(TAG_FIELD) if isinstance(self.body, dict) else None
        return SimTiming(
            id=self.id, path=self.path, request_id=self.headers.get("x-request-id"),
            tag=tag if isinstance(tag, str) else None, received_at=self.received_at,
            admitted_at=self.admitted_at, first_byte_at=self.first_byte_at, finished_at=self.finished_at,
            status=self.status, aborted=self.aborted, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens,
            completion_tokens=self.completion_tokens_sent)


class KVUsageModel(Protocol):
    """Maps the running requests to a KV-cache usage fraction in [0, 1]."""

    def usage(self, active: list[ActiveRequest]) -> float: ...


@dataclass(frozen=True)
class ProportionalKVUsage:
    """KV usage = tokens held by running requests / `capacity_tokens`, capped at 1.0.

    Used without a prefix cache (`SimConfig.kv_capacity_tokens` unset); with one, the usage comes
    from `PrefixCache.usage`.
    """

    capacity_tokens: int

    def usage(self, active: list[ActiveRequest]) -> float:
        held = sum(a.prompt_tokens + a.generated for a in active)
        return min(1.0, held / self.capacity_tokens)


@dataclass(eq=False)
class _Waiter:
    """A request queued for admission; `active` is set (under the engine lock) once admitted."""

    prompt_tokens: int
    keys: tuple[PromptKey, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    active: ActiveRequest | None = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class SimWorkerState:
    """Config, state and records of one simulated engine.

    `records` is a snapshot list (the record objects themselves keep updating); `wait_for` blocks a
    thread until a predicate holds; `async_wait_for` does the same inside an event loop.

    Load model: requests are admitted in arrival order (FIFO, head-of-line blocking as in vLLM's
    scheduler) while fewer than `max_num_seqs` run and, with a prefix cache, while the uncached
    tokens of the next request fit in `kv_capacity_tokens` beside those of the running requests
    (one request is always admitted when none runs). The rest count as waiting. With
    `scheduler="stepped"`, `stepper` does the admission, the timing and the preemption instead
    (`gateway.sim.stepper`; requests are `StepRequest`s made by `new_step_request`).
    """

    def __init__(self, config: SimConfig, kv_model: KVUsageModel | None = None) -> None:
        self.config = config
        self.dialect: EngineDialect = dialect_for(config.engine, config.api_version)
        self.answer_shape: AnswerShape = self.dialect.shape_for(config)
        """How this engine shapes chat and text answers (`gateway.sim.responses.AnswerShape`)."""
        self.kv_model: KVUsageModel = kv_model or ProportionalKVUsage(config.max_context_tokens)
        self.kv: PrefixCache | None = (PrefixCache(config.kv_capacity_tokens, config.kv_block_tokens)
                                       if config.kv_capacity_tokens is not None else None)
        """The prefix cache (None unless `kv_capacity_tokens` is set). Not thread-safe: from another
        thread, read `sim_stats()` instead."""
        self.started_at = int(time.time())
        self.loras: dict[str, str] = dict(config.lora_adapters)
        """LoRA adapters loaded now, name -> path: `lora_modules`, then runtime loads and unloads."""
        self._cond = threading.Condition(threading.RLock())
        self._ids = itertools.count(1)
        self._records: list[SimRequestRecord] = []
        self._timings = TimingLog(config.timing_records)
        self._faults = config.faults.model_copy(deep=True)
        self.script = SimScript()  # scripted answers (`gateway.sim.script`), replaced whole by POST /sim/script
        self._active: dict[int, ActiveRequest] = {}
        self._queue: deque[_Waiter] = deque()
        self._waiting = 0
        self._totals = SimTotals()
        self._baseline = SimTotals()
        self._peak_running = 0
        self._peak_waiting = 0
        self._hit_rate = HitRateWindow()
        self._finished: Counter[str] = Counter()
        self._health_checks = 0
        self._last_output_at = 0.0
        """When a running request last produced output (`time.monotonic()` s; per-request timing)."""
        self._idle_resets = 0
        self._models_reads = 0
        self._hash_seed = seed_for(config.model_name)
        self.stepper: StepScheduler | None = None
        """The step scheduler (None unless `scheduler="stepped"`); use it under the engine's lock."""
        if config.scheduler == "stepped":
            self.stepper = StepScheduler(
                self._cond, self.kv, self._totals, self._hit_rate, chunk_tokens=config.chunk_tokens,
                prefill_tokens_per_s=config.step_prefill_tokens_per_s, decode_step_s=config.decode_step_s,
                decode_s_per_seq=config.decode_s_per_seq, max_num_seqs=config.max_num_seqs)
        self.registry = build_registry(self._scraped_stats, self.dialect, config.model_name, time.time())
        self.pd: PdState | None = None
        """The PD role's state (None for an aggregated worker; see `gateway.sim.pd`)."""
        if config.pd_role is not None:
            self.pd = PdState(config, self.hold_blocks, self.release_blocks)
            self.registry.register(PdMetricsCollector(self.pd, self.dialect, config))
        self._http: httpx.AsyncClient | None = None
        self.running_ids = RunningIds()
        """The engine request ids running now (vLLM refuses a duplicate; `gateway.sim.request_ids`)."""

    # --- records -----------------------------------------------------------------------------

    @property
    def records(self) -> list[SimRequestRecord]:
        """All records so far, oldest first (a new list; the records are live objects).

        Always empty with `keep_records=False`.
        """
        with self._cond:
            return list(self._records)

    def new_record(self, path: str, headers: dict[str, str], body: Any) -> SimRequestRecord:
        """Create the record of a request whose body has just been read (stored unless
        `keep_records` is off) and count the request."""
        with self._cond:
            record = SimRequestRecord(id=next(self._ids), path=path, headers=headers, body=body,
                                      received_at=time.monotonic())
            self._totals.requests += 1
            if self.config.keep_records:
                self._records.append(record)
            self._cond.notify_all()
            return record

    def update(self, record: SimRequestRecord, **changes: Any) -> None:
        """Set fields of `record` (under the lock) and wake waiters."""
        with self._cond:
            for name, value in changes.items():
                setattr(record, name, value)
            self._cond.notify_all()

    def note_finished(self, record: SimRequestRecord) -> None:
        """A generation request's handler is done: keep its compact timing (`gateway.sim.timings`;
        kept only with `timing_records` > 0, the last that many)."""
        if self._timings.capacity:
            with self._cond:
                self._timings.add(record.timing())

    def timings(self) -> dict[str, Any]:
        """`GET /sim/timings`: `{"capacity", "dropped", "timings": [...]}` (`TimingLog.snapshot`)."""
        with self._cond:
            return self._timings.snapshot()

    def clear_timings(self) -> int:
        """Forget the kept timings; returns how many there were."""
        with self._cond:
            return self._timings.clear()

    def clear_records(self) -> int:
        """Forget all records; returns how many there were (the counters are kept)."""
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

    # --- prefix cache and latency model ------------------------------------------------------

    def cache_partition(self, body: dict[str, Any], messages: bool = False) -> str | None:
        """What keeps a request's prefix-cache entries apart from other requests' with the same
        model and prompt, as this engine reads it from the body (None: nothing); `messages`: an
        Anthropic Messages body, which SGLang's Messages layer turns into a chat request without
        either field (`convert_anthropic_to_openai_request` in
        `python/sglang/srt/entrypoints/anthropic/request_conversion.py`), while vLLM's reads
        `cache_salt` there too (0.32.0 `vllm/entrypoints/anthropic/protocol.py`).

        vLLM family: `cache_salt` (chat, completions, Responses; a non-empty string, which their
        `protocol.py` requires), mixed into the first block's hash by `generate_block_hash_extra_keys`
        in `vllm/v1/core/kv_cache_utils.py`, so no block of a salted prompt matches another salt's or
        an unsalted one's. SGLang: `cache_salt` and `extra_key` joined in that order
        (`OpenAIServingBase._compute_extra_key` in
        `python/sglang/srt/entrypoints/openai/serving_base.py`), the `extra_key` its radix cache
        matches on beside the tokens. A field that is not a non-empty string counts as absent.
        """
        if messages and self.config.engine == "sglang":
            return None
        names = ("cache_salt", "extra_key") if self.config.engine == "sglang" else ("cache_salt",)
        parts = [value for name in names if isinstance(value := body.get(name), str) and value]
        return "".join(parts) if parts else None

    def prompt_keys(self, kind: str, body: dict[str, Any], prompt_tokens: list[int],
                    partition: str | None = None) -> list[PromptKey]:
        """The prefix-cache keys of a validated request's prompts ([] without a prefix cache), in
        the cache `partition` (`cache_partition`; None: the model's own)."""
        if self.kv is None:
            return []
        seed = self._hash_seed if partition is None else seed_for(f"{self.config.model_name}\x00{partition}")
        return prompt_keys(kind, body, prompt_tokens, self.config, seed)

    def prefill_seconds(self, active: ActiveRequest) -> float:
        """Time to first token of an admitted request (seconds): `ttft_s`, plus its uncached
        tokens / `prefill_tokens_per_s` when that is set."""
        rate = self.config.prefill_tokens_per_s
        if rate is None:
            return self.config.ttft_s
        return self.config.ttft_s + active.prefill_tokens / rate

    def decode_seconds(self) -> float:
        """Time of the next output token (seconds): `tpot_s` x (1 + `decode_batch_slowdown` x
        (running requests - 1)). A PD worker's requests still waiting for their hand-over (a decode
        worker's KV, a SGLang prefill worker's bootstrap) hold a slot but are not in the batch
        (SGLang's transfer and bootstrap queues), so they do not slow it."""
        slowdown = self.config.decode_batch_slowdown
        if slowdown == 0.0:
            return self.config.tpot_s
        with self._cond:
            running = len(self._active)
        if self.pd is not None:
            waiting = self.pd.counters()
            running -= waiting.waiting_for_kv + waiting.bootstrapping
        return self.config.tpot_s * (1.0 + slowdown * max(0, running - 1))

    def hold_blocks(self, keys: Sequence[PromptKey]) -> list[CacheLease]:
        """Pin the cached blocks of `keys` beyond their request (a NIXL prefill worker keeps
        them for its decode worker); [] without a prefix cache."""
        with self._cond:
            return [self.kv.acquire(key) for key in keys] if self.kv is not None else []

    def release_blocks(self, leases: list[CacheLease]) -> None:
        """Unpin blocks pinned by `hold_blocks`."""
        with self._cond:
            if self.kv is not None:
                for lease in leases:
                    self.kv.release(lease)
                self._pump()
            self._cond.notify_all()

    def http_client(self) -> httpx.AsyncClient:
        """The client of this worker's PD side channel calls (made in, and bound to, the sim's
        event loop on first use; closed by `aclose`)."""
        if self._http is None:
            self._http = httpx.AsyncClient(trust_env=False)
        return self._http

    async def aclose(self) -> None:
        """Release what the server's loop owns (the scheduler loop, the side channel client, held
        blocks)."""
        if self.stepper is not None:
            await self.stepper.aclose()
        if self.pd is not None:
            self.pd.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def clear_cache(self) -> int:
        """Drop every cached block no running request uses; returns the tokens dropped."""
        with self._cond:
            return self.kv.clear() if self.kv is not None else 0

    # --- load ---------------------------------------------------------------------------------

    def add_waiting(self, delta: int) -> None:
        """Count a request entering (+1) or leaving (-1) the wait queue (outside `admit`)."""
        with self._cond:
            self._waiting += delta
            self._peak_waiting = max(self._peak_waiting, self._waiting)
            self._cond.notify_all()

    def try_admit(self, prompt_tokens: int, keys: Sequence[PromptKey] = ()) -> ActiveRequest | None:
        """Admit a request now if nobody is queued and it may run, else None (then `admit`)."""
        with self._cond:
            return None if self._queue else self._try_start(prompt_tokens, keys)

    async def admit(self, prompt_tokens: int, keys: Sequence[PromptKey] = ()) -> ActiveRequest:
        """Queue a request until it may run, then admit it (see the class docstring).

        Cancelling the wait (the client left) takes the request out of the queue.
        """
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._queue:
                active = self._try_start(prompt_tokens, keys)
                if active is not None:
                    return active
            waiter = _Waiter(prompt_tokens, tuple(keys), loop, loop.create_future())
            self._queue.append(waiter)
            self.add_waiting(1)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._cond:
                if waiter.active is not None:
                    self.stop_running(waiter.active, "abort")
                else:
                    self._queue.remove(waiter)
                    self.add_waiting(-1)
                    self._pump()
            raise
        assert waiter.active is not None
        return waiter.active

    def new_step_request(self, prompt_tokens: int, keys: Sequence[PromptKey], seqs: int,
                         output_tokens: int) -> StepRequest:
        """Stepped scheduler: a request for `run_stepped_prefill` (not queued yet); `seqs` prompts
        decode together for `output_tokens` steps."""
        return new_step_request(prompt_tokens, keys, seqs, output_tokens)

    async def run_stepped_prefill(self, active: StepRequest, remote_tokens: int = 0) -> None:
        """Stepped scheduler: queue `active` and return once its prefill is done and its first
        token out. `remote_tokens` of its prompt came as KV from a PD prefill worker. Cancelling
        leaves it queued: end it with `stop_running`."""
        assert self.stepper is not None
        with self._cond:
            self.stepper.enqueue(active, remote_tokens)
            self._cond.notify_all()
        await active.wait_steps(0)

    def start_running(self, prompt_tokens: int, keys: Sequence[PromptKey] = ()) -> ActiveRequest:
        """Admit a request at once, bypassing the queue: it counts as running, its prompt tokens
        are counted, and its cached prefix is pinned."""
        with self._cond:
            return self._start(prompt_tokens, keys)

    def finish_prefill(self, active: ActiveRequest) -> None:
        """The request's prefill is done: its full prompt blocks enter the cache; its uncached
        tokens count as prefilled."""
        with self._cond:
            if id(active) not in self._active:
                return
            self._totals.prefill_tokens += active.prefill_tokens
            active.prefill_done = True
            self._last_output_at = time.monotonic()  # the first token leaves with the prefill
            if self.kv is not None:
                for lease in active.leases:
                    self.kv.commit(lease)
                self._pump()
            self._cond.notify_all()

    def note_generated(self, active: ActiveRequest, tokens: int = 1) -> None:
        """Count `tokens` newly generated by a running request."""
        with self._cond:
            active.generated += tokens
            self._totals.generated_tokens += tokens
            self._last_output_at = time.monotonic()
            if self.kv is not None and active.leases:
                self.kv.grow(active.leases[0], tokens)
            self._cond.notify_all()

    def stop_running(self, active: ActiveRequest, finish_reason: str) -> None:
        """A running request ended ("stop", "length" or "abort"): free its KV, admit waiters."""
        if isinstance(active, StepRequest):
            with self._cond:
                if self.stepper is not None and self.stepper.finish(active):
                    self._finished[finish_reason] += 1
                    if finish_reason != "abort":
                        self._totals.completed += 1
                self._cond.notify_all()
            return
        with self._cond:
            if self._active.pop(id(active), None) is not None:
                self._finished[finish_reason] += 1
                if finish_reason != "abort":
                    self._totals.completed += 1
                if self.kv is not None:
                    for lease in active.leases:
                        self.kv.release(lease)
                self._pump()
            self._cond.notify_all()

    def note_aborted(self) -> None:
        """Count a request whose client hung up before its response completed."""
        with self._cond:
            self._totals.aborted += 1

    def note_status(self, status: int) -> None:
        """Count a response's HTTP status (errors are statuses >= 400)."""
        if status >= 400:
            with self._cond:
                self._totals.errors += 1

    def _try_start(self, prompt_tokens: int, keys: Sequence[PromptKey]) -> ActiveRequest | None:
        """Admit now if a slot and the KV room allow it, else None (call under the lock)."""
        if self._active:
            limit = self.config.max_num_seqs
            if limit is not None and len(self._active) >= limit:
                return None
            kv = self.kv
            if kv is not None and not kv.fits(sum(kv.room_needed(key) for key in keys)):
                return None
        return self._start(prompt_tokens, keys)

    def _start(self, prompt_tokens: int, keys: Sequence[PromptKey]) -> ActiveRequest:
        active = ActiveRequest(prompt_tokens, admitted_at=time.monotonic())
        if self.kv is not None:
            active.leases = [self.kv.acquire(key) for key in keys]
            active.cached_tokens = sum(lease.cached_tokens for lease in active.leases)
            self._hit_rate.add(active.cached_tokens, prompt_tokens)
        self._active[id(active)] = active
        self._totals.prompt_tokens += prompt_tokens
        self._totals.cached_tokens += active.cached_tokens
        self._peak_running = max(self._peak_running, len(self._active))
        self._cond.notify_all()
        return active

    def _pump(self) -> None:
        """Admit queued requests in order while the head fits (call under the lock)."""
        while self._queue:
            head = self._queue[0]
            active = self._try_start(head.prompt_tokens, head.keys)
            if active is None:
                return
            self._queue.popleft()
            self._waiting -= 1
            head.active = active
            try:
                in_loop = asyncio.get_running_loop() is head.loop
            except RuntimeError:
                in_loop = False
            if in_loop:
                _resolve(head.future)
            else:
                head.loop.call_soon_threadsafe(_resolve, head.future)

    # --- health and statistics ----------------------------------------------------------------

    def note_health_check(self) -> None:
        """Count one probe (`GET /health`, or SGLang's `/health_generate`, `/ready` or `/model_info`)."""
        with self._cond:
            self._health_checks += 1
            self._cond.notify_all()  # `wait_for` may be waiting on the count

    @property
    def health_checks(self) -> int:
        """How many probes (`GET /health`, SGLang's `/health_generate`, `/ready` and `/model_info`) arrived."""
        with self._cond:
            return self._health_checks

    def scheduler_mark(self) -> tuple[float, int]:
        """Where the scheduler is now (time, stepped scheduler's steps so far), for `scheduler_answered`."""
        with self._cond:
            return time.monotonic(), self.stepper.steps_run if self.stepper is not None else 0

    def scheduler_answered(self, mark: tuple[float, int]) -> bool:
        """Whether a one-token health generation submitted at `mark` has scheduler output by now,
        as SGLang judges it (`health_generate` in `python/sglang/srt/entrypoints/http_server.py`:
        any output reaching the tokenizer manager after the submission counts; a busy scheduler
        defers the health request and answers it with the outputs of its next forward step,
        `return_health_check_ct` in `python/sglang/srt/managers/scheduler.py`; an idle one runs it).

        Per-request timing: some request produced output since `mark`, or no admitted request is
        in its prefill now (the scheduler is free to run the health request: it answers at once).
        A long prefill with nothing else producing output holds the answer back until it ends.
        Stepped scheduler: a step ended since `mark`, or the scheduler is idle.
        """
        since, steps = mark
        with self._cond:
            if self._last_output_at > since:
                return True
            if self.stepper is not None:
                stepper = self.stepper
                return stepper.steps_run > steps or (not stepper.running and stepper.waiting_count == 0)
            return all(active.prefill_done for active in self._active.values())

    def note_idle_reset(self) -> None:
        """Count one request reset on a connection dropped idle (`idle_close_unannounced`)."""
        with self._cond:
            self._idle_resets += 1

    @property
    def idle_resets(self) -> int:
        """Requests that arrived on a connection dropped idle and were reset unanswered."""
        with self._cond:
            return self._idle_resets

    def model_names(self) -> list[str]:
        """Every name a request's `model` may say: the served names, then the loaded LoRA adapters'
        (an adapter's request is generated as the base model's: the sim has no weights to adapt)."""
        return [*self.config.served_model_names, *self.loras]

    def answer_model(self, requested: object) -> str:
        """The `model` a chat or completions answer names for a request's `model`: a loaded LoRA
        adapter's own name (vLLM: vllm/entrypoints/openai/serving_models.py `OpenAIServingModels.model_name`
        returns `lora_request.lora_name`, else the first served name); SGLang names the request's
        `model` as sent (python/sglang/srt/entrypoints/openai/serving_chat.py `_build_chat_response`:
        `model=request.model`). An unnamed model is the first served name."""
        if isinstance(requested, str) and requested and (requested in self.loras or self.config.engine == "sglang"):
            return requested
        return self.config.model_name

    def note_models_read(self) -> None:
        """Count one `GET /v1/models`."""
        with self._cond:
            self._models_reads += 1

    @property
    def models_reads(self) -> int:
        """How many `GET /v1/models` requests arrived."""
        with self._cond:
            return self._models_reads

    def _kv_usage(self) -> float:
        if self.kv is not None:
            return self.kv.usage(self.config.kv_usage_includes_cache)
        active: list[ActiveRequest] = list(self._active.values())
        if self.stepper is not None:
            active.extend(self.stepper.running)
        return self.kv_model.usage(active)

    def _running_waiting(self) -> tuple[int, int]:
        """(running, waiting) now, the step scheduler's included."""
        if self.stepper is None:
            return len(self._active), self._waiting
        return len(self._active) + len(self.stepper.running), self._waiting + self.stepper.waiting_count

    def stats(self) -> EngineStats:
        """A snapshot of the load and the lifetime counters (what `/metrics` exposes)."""
        with self._cond:
            totals = self._lifetime_totals()
            running, waiting = self._running_waiting()
            return EngineStats(
                running=running,
                waiting=waiting,
                kv_usage=self._kv_usage(),
                prompt_tokens_total=totals.prompt_tokens,
                generation_tokens_total=totals.generated_tokens,
                finished_by_reason=dict(self._finished),
                prefix_cache_queries_total=totals.prompt_tokens if self.kv is not None else 0,
                prefix_cache_hits_total=totals.cached_tokens,
                cache_hit_rate=self._hit_rate.rate,
                preemptions_total=totals.preemptions,
            )

    def _scraped_stats(self) -> EngineStats:
        """What `/metrics` shows: `stats()`, with the running requests the faults add
        (`SimFaults.metrics_running_offset`)."""
        stats = self.stats()
        with self._cond:
            offset = self._faults.metrics_running_offset
        return stats if not offset else replace(stats, running=stats.running + offset)

    def _lifetime_totals(self) -> SimTotals:
        totals = self._totals.copy()
        totals.evicted_tokens = self.kv.evicted_tokens if self.kv is not None else 0
        return totals

    def sim_stats(self) -> dict[str, Any]:
        """`GET /sim/stats`: counters since the last reset, peaks, and the state now.

        Counters (requests, tokens) are those of `SimTotals`; `max_running` / `max_waiting` are
        peaks since the reset; `running`, `waiting`, `cache_tokens_now` (tokens in cached blocks),
        `kv_used_tokens` and `kv_usage` (the value `/metrics` reports) describe the present. PD
        workers add `pd`: the `PdCounters` (lifetime, not reset) and `held_handles`.
        """
        with self._cond:
            out: dict[str, Any] = self._lifetime_totals().minus(self._baseline).to_json()
            running, waiting = self._running_waiting()
            stepper = self.stepper
            out.update(
                max_running=max(self._peak_running, stepper.peak_running if stepper is not None else 0),
                max_waiting=max(self._peak_waiting, stepper.peak_waiting if stepper is not None else 0),
                running=running,
                waiting=waiting,
                cache_tokens_now=self.kv.cached_tokens if self.kv is not None else 0,
                kv_used_tokens=self.kv.used_tokens if self.kv is not None else 0,
                kv_capacity_tokens=self.config.kv_capacity_tokens,
                kv_usage=self._kv_usage(),
            )
        if self.pd is not None:
            out["pd"] = {**asdict(self.pd.counters()), "held_handles": self.pd.held_handles}
        return out

    def reset_stats(self) -> dict[str, Any]:
        """Restart the `/sim/stats` counters and peaks (the cache, the load and `/metrics` stay);
        returns the stats as they were just before."""
        with self._cond:
            before = self.sim_stats()
            self._baseline = self._lifetime_totals()
            self._peak_running = len(self._active)
            self._peak_waiting = self._waiting
            if self.stepper is not None:
                self.stepper.reset_peaks()
            return before
