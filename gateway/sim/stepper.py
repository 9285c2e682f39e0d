"""The step scheduler of one simulated worker (`SimConfig.scheduler = "stepped"`): one prefill
budget shared by every request, chunked prefill, batched decode steps and KV-cache preemption, in
the way vLLM (V1 scheduler) and SGLang schedule a GPU worker.

Model. One asyncio task per worker runs steps back to back while there is work (none when idle).
Each step builds a batch under a token budget of `chunk_tokens` (vLLM `max_num_batched_tokens`,
SGLang `chunked_prefill_size`):

1. Running requests, oldest first. A decoding request takes 1 token per sequence of the budget.
   It needs KV room for that token; when the KV cache is full, the youngest running request is
   preempted (vLLM's recompute preemption, SGLang's retraction): its KV is freed (blocks already
   cached stay cached, unpinned), it goes back to the head of the waiting queue, and when it is
   admitted again it recomputes its prompt and the tokens it had generated, less what the prefix
   cache still holds. A request still prefilling takes the next chunk of its prompt.
2. Waiting requests, first come first served (head-of-line blocking, as vLLM's FCFS policy),
   while the budget lasts, fewer than `max_num_seqs` run and (with a KV cache) the head's uncached
   tokens fit beside the running requests' (one request is always admitted on an idle worker).
   Prefix-cache hits are looked up at admission and never computed.

A step lasts `decode_step_s` + `decode_s_per_seq` x decoding sequences + prefill tokens in the
batch / `prefill_tokens_per_s`. At its end each decoding request has one more token per sequence;
a request whose prefill completes gets its first token in that same step (both engines sample it
from the last prefill chunk). So concurrent prefills share one rate: two long prompts admitted
together each take about twice as long as one alone, and a short prompt arriving behind a long
one waits for the long one's remaining chunks (its TTFT ~ remaining long tokens / rate + its own).
Decode time per token grows with the batch, and a prefill chunk in the batch stretches the decode
steps that share it (the ITL cost of chunked prefill).

Simplifications: both engines are modelled with vLLM's mixed prefill + decode batches and FCFS
order. SGLang by default runs prefill batches and decode batches separately (mixing is opt-in,
`--enable-mixed-chunk`) and orders its queue by longest prefix match (`--schedule-policy lpm`);
KV blocks are taken for the whole prompt at admission (vLLM allocates them chunk by chunk, SGLang
also reserves the prompt up front); no watermark, swap or CPU offload.

Default constants (`SimConfig` fields; "~100B-active MoE on one 8-GPU H100/H200-class node"):

- `chunk_tokens` 8,192 (`DEFAULT_CHUNK_TOKENS`): vLLM's `max_num_batched_tokens` default for the
  OpenAI server on GPUs with >= 70 GiB that are not A100 (`EngineArgs.get_batch_defaults`, vLLM
  0.9+); SGLang's `chunked_prefill_size` default for 35-160 GB GPUs (H100, H200; 16,384 on B200 /
  MI300, `ServerArgs`).
- `prefill_tokens_per_s` 20,000 (`DEFAULT_PREFILL_TOKENS_PER_S`) when unset: DeepSeek's published
  V3/R1 inference system overview (2025-03, day 6 of its open-source week) reports 73.7k input
  tokens/s per H800 node in prefill *including* a 56.3 % prefix-cache hit rate, i.e. ~32k computed
  tokens/s for 37B active parameters; prefill is compute-bound, so ~100B active gives ~12k/s;
  SGLang's large-scale EP write-up (LMSYS blog 2025-05, 96 H100) measured 52.3k input tokens/s per
  node on 2,000-token prompts (~19k/s scaled to 100B active). 20k/s sits in that range.
- `decode_step_s` 20 ms and `decode_s_per_seq` 0.1 ms (`DEFAULT_DECODE_STEP_S`,
  `DEFAULT_DECODE_S_PER_SEQ`): a decode step at small batch is bound by reading the active weights
  and its fixed launch/communication cost; the same DeepSeek overview reports 20-22 output
  tokens/s per user (45-50 ms a token) at production batch sizes, and GPUStack's DeepSeek-V3.2
  8xH200 SGLang measurements show 39-46 ms TPOT on a generation-heavy load. A 20 ms base plus
  0.1 ms per running sequence gives ~46 ms at a batch of 256 (vLLM's old default `max_num_seqs`).

Steps follow an engine-time schedule: each one ends its duration after the previous one's end, so
a late wake-up of the event loop (a busy machine running 8 workers at 20x) is made up by the next
sleeps (up to `MAX_LAG_S`) instead of slowing the simulated engine down.

Units: tokens, seconds. Not thread-safe by itself: every method but the loop is called under the
owning engine's lock, and the loop takes that lock around each planning and completion.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.sim.active import ActiveRequest
from gateway.sim.kvcache import PrefixCache, PromptKey
from gateway.sim.totals import HitRateWindow, SimTotals

DEFAULT_CHUNK_TOKENS = 8192
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
DEFAULT_DECODE_STEP_S = 0.020
DEFAULT_DECODE_S_PER_SEQ = 0.0001
MAX_LAG_S = 0.5
"""How far (seconds) the step loop may run behind its engine-time schedule and still catch up."""


@dataclass(eq=False)
class StepRequest(ActiveRequest):
    """A request in the step scheduler.

    `seqs` sequences (prompts of a batched completion) decode together; `output_tokens` is the
    number of steps that produce tokens (per sequence). `remote_tokens` of the prompt arrived as KV
    from a PD prefill worker and are not computed (first admission only). `steps` counts the steps
    that produced tokens so far; `prefilled` turns True once the first prefill finished.
    `cached_tokens` is the prefix-cache hit of the first admission (what the response reports).
    """

    keys: tuple[PromptKey, ...] = ()
    seqs: int = 1
    output_tokens: int = 1
    remote_tokens: int = 0
    steps: int = 0
    prefilled: bool = False
    preempted: int = 0
    """How many times this request was preempted."""
    computed: int = 0
    """Prefill tokens computed in the current admission."""
    target: int = 0
    """Prefill tokens to compute in the current admission."""
    state: str = "new"
    """"new" (not yet queued), "waiting", "prefill", "decode", "generated" (all steps done, KV
    freed) or "ended" (the handler finished it)."""
    counted: bool = False
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_steps(self, steps: int) -> None:
        """Return once `steps` token-producing steps have run for this request (or, with 0, once its
        prefill finished)."""
        while not self._reached(steps) and self.state != "ended":
            self._progress.clear()
            await self._progress.wait()

    def _reached(self, steps: int) -> bool:
        return self.prefilled if steps <= 0 else self.steps >= steps


@dataclass
class _Step:
    decode: list[StepRequest]
    prefill: list[tuple[StepRequest, int]]
    seconds: float


class StepScheduler:
    """One worker's scheduler loop (see the module docstring).

    `lock` is the engine's condition (notified after each step); `kv` its prefix cache or None
    (unlimited KV, no prefix cache); `totals` and `hit_rate` are the engine's counters, which the
    scheduler updates: prompt and cached tokens at a request's first admission, prefill tokens as
    prefills complete (recomputation included), generated tokens, preemptions.
    """

    def __init__(self, lock: threading.Condition, kv: PrefixCache | None, totals: SimTotals,
                 hit_rate: HitRateWindow, *, chunk_tokens: int, prefill_tokens_per_s: float,
                 decode_step_s: float, decode_s_per_seq: float, max_num_seqs: int | None) -> None:
        if chunk_tokens <= 0 or prefill_tokens_per_s <= 0:
            raise ValueError("chunk_tokens and prefill_tokens_per_s must be positive")
        self._lock = lock
        self._kv = kv
        self._totals = totals
        self._hit_rate = hit_rate
        self.chunk_tokens = chunk_tokens
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_step_s = decode_step_s
        self.decode_s_per_seq = decode_s_per_seq
        self.max_num_seqs = max_num_seqs
        self._waiting: deque[StepRequest] = deque()
        self._running: list[StepRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.peak_running = 0
        self.peak_waiting = 0
        self.steps_run = 0
        """Steps run so far (a counter)."""

    # --- views (under the lock) ----------------------------------------------------------------

    @property
    def running(self) -> list[StepRequest]:
        """Admitted requests (prefilling or decoding), oldest first (a new list)."""
        return list(self._running)

    @property
    def waiting_count(self) -> int:
        """Requests queued (never admitted, or preempted and not yet readmitted)."""
        return len(self._waiting)

    def step_seconds(self, decode_seqs: int, prefill_tokens: int = 0) -> float:
        """Duration of a step with `decode_seqs` decoding sequences and `prefill_tokens` prefill
        tokens (seconds)."""
        return (self.decode_step_s + self.decode_s_per_seq * decode_seqs
                + prefill_tokens / self.prefill_tokens_per_s)

    def reset_peaks(self) -> None:
        """Restart `peak_running` / `peak_waiting` from the present counts."""
        self.peak_running = len(self._running)
        self.peak_waiting = len(self._waiting)

    # --- request life cycle (under the lock, in the loop) --------------------------------------

    def enqueue(self, req: StepRequest, remote_tokens: int = 0) -> None:
        """Queue a request for scheduling (starts the loop on first use)."""
        if req.state != "new":
            return
        req.remote_tokens = remote_tokens
        req.state = "waiting"
        self._waiting.append(req)
        self.peak_waiting = max(self.peak_waiting, len(self._waiting))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    def finish(self, req: StepRequest) -> bool:
        """The handler is done with `req` (completed or aborted): take it out of the queues and free
        its KV. True the first time, False if it had already ended."""
        if req.state == "ended":
            return False
        if req.state == "waiting":
            self._waiting.remove(req)
        elif req.state in ("prefill", "decode"):
            self._running.remove(req)
            self._free(req)
        req.state = "ended"
        req._progress.set()
        return True

    async def aclose(self) -> None:
        """Stop the loop (the server is shutting down)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # --- the loop ------------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()  # when the previous step ended, in engine time
        while True:
            with self._lock:
                step = self._plan()
                if step is None:
                    self._wake.clear()
            if step is None:
                await self._wake.wait()
                clock = loop.time()
                continue
            # Steps run back to back in engine time: a late wake-up (a busy machine) shortens the
            # next sleep instead of stretching every step, up to `MAX_LAG_S` of debt.
            clock = max(clock, loop.time() - MAX_LAG_S) + step.seconds
            await asyncio.sleep(max(0.0, clock - loop.time()))
            with self._lock:
                self._complete(step)
                self.steps_run += 1
                self._lock.notify_all()

    def _plan(self) -> _Step | None:
        budget = self.chunk_tokens
        decode: list[StepRequest] = []
        prefill: list[tuple[StepRequest, int]] = []
        preempted = False  # as vLLM: no admission in a step that had to preempt
        i = 0
        while i < len(self._running):
            req = self._running[i]
            if req.state == "decode":
                if budget < req.seqs:
                    i += 1
                    continue
                fits, evicted = self._room_for(req, req.seqs)
                preempted = preempted or evicted
                if not fits:
                    continue  # req itself was preempted: the same index now holds the next one
                decode.append(req)
                budget -= req.seqs
            elif budget > 0 or req.target == 0:
                n = min(req.target - req.computed, budget)
                prefill.append((req, n))
                budget -= n
            i += 1
        while self._waiting and budget > 0 and not preempted:
            if self.max_num_seqs is not None and len(self._running) >= self.max_num_seqs:
                break
            head = self._waiting[0]
            if not self._admit(head):
                break
            self._waiting.popleft()
            n = min(head.target, budget)
            prefill.append((head, n))
            budget -= n
        if not decode and not prefill:
            return None
        seqs = sum(r.seqs for r in decode)
        return _Step(decode, prefill, self.step_seconds(seqs, sum(n for _, n in prefill)))

    def _room_for(self, req: StepRequest, tokens: int) -> tuple[bool, bool]:
        """Make KV room for `tokens` more of `req`, preempting the youngest running requests:
        (False when `req` itself had to go, whether anyone was preempted). The last running request
        is never preempted (it may overshoot the capacity, as one sequence longer than the free
        memory would)."""
        kv = self._kv
        if kv is None:
            return True, False
        evicted = False
        while not kv.fits(tokens) and len(self._running) > 1:
            victim = self._running[-1]
            self._preempt(victim)
            evicted = True
            if victim is req:
                return False, True
        return True, evicted

    def _preempt(self, req: StepRequest) -> None:
        self._running.remove(req)
        self._free(req)
        req.state = "waiting"
        req.preempted += 1
        self._totals.preemptions += 1
        self._waiting.appendleft(req)
        self.peak_waiting = max(self.peak_waiting, len(self._waiting))

    def _admit(self, req: StepRequest) -> bool:
        kv = self._kv
        resumed = req.generated  # recompute: the output so far is part of what must be rebuilt
        if kv is not None and self._running and not kv.fits(sum(kv.pin_cost(k) for k in req.keys) + resumed):
            return False
        hit = 0
        if kv is not None:
            req.leases = [kv.acquire(key) for key in req.keys]
            hit = sum(lease.cached_tokens for lease in req.leases)
            if resumed and req.leases:
                kv.grow(req.leases[0], resumed)
        if not req.counted:
            req.counted = True
            req.admitted_at = time.monotonic()  # the step this admission plans starts now
            req.cached_tokens = hit
            self._totals.prompt_tokens += req.prompt_tokens
            self._totals.cached_tokens += hit
            if kv is not None:
                self._hit_rate.add(hit, req.prompt_tokens)
            remote = req.remote_tokens
        else:
            remote = 0  # the prefill worker's KV was used once; a recompute is local
        req.target = max(0, req.prompt_tokens + resumed - hit - remote)
        req.computed = 0
        req.state = "prefill"
        self._running.append(req)
        self.peak_running = max(self.peak_running, len(self._running))
        return True

    def _complete(self, step: _Step) -> None:
        for req, n in step.prefill:
            if req.state != "prefill":
                continue  # ended during the step
            req.computed += n
            if req.computed < req.target:
                continue
            self._totals.prefill_tokens += req.target
            if self._kv is not None:
                for lease in req.leases:
                    self._kv.commit(lease)
            req.state = "decode"
            req.prefilled = True
            self._produce(req)
        for req in step.decode:
            if req.state == "decode":
                self._produce(req)

    def _produce(self, req: StepRequest) -> None:
        """One token per sequence (none for a request that asked for none); the last step frees
        the request's KV at once (its blocks stay cached), as the engines do."""
        if req.output_tokens > 0:
            req.steps += 1
            req.generated += req.seqs
            self._totals.generated_tokens += req.seqs
            if self._kv is not None and req.leases:
                self._kv.grow(req.leases[0], req.seqs)
        if req.steps >= req.output_tokens:
            self._running.remove(req)
            self._free(req)
            req.state = "generated"
        req._progress.set()

    def _free(self, req: StepRequest) -> None:
        if self._kv is not None:
            for lease in reversed(req.leases):
                self._kv.release(lease)
        req.leases = []


def new_step_request(prompt_tokens: int, keys: Iterable[PromptKey], seqs: int, output_tokens: int) -> StepRequest:
    """A request not yet queued (`StepScheduler.enqueue` queues it)."""
    return StepRequest(prompt_tokens, keys=tuple(keys), seqs=max(1, seqs), output_tokens=max(0, output_tokens))
