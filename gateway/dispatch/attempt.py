"""One attempt: the unit a pool kind produces, that either hands the client an answer or fails
before anything reached the client (`AttemptFailed`: the dispatch may try again elsewhere).

`Attempt` is the interface: `run()` gets the answer; `pool`, `worker` (the worker whose answer
the client gets: the one the outcome is counted and judged against), `reason` (the route
reason) and `matched` (the prompt share that worker held per the affinity store; None when the
pool's policy does not use affinity) are what the dispatch accounts with. `SingleLeg` is the
aggregated pool's attempt: one worker serves the whole request.

Ownership: an attempt holds everything it takes (every leg's slot, every upstream response it
opens) in one `Holding`, released together on every exit path (`finally: if holding: await
holding.aclose()`); on success it moves the whole Holding in one call (`Holding.hand_over`) to the
`UpstreamStream` that relays the answer, or closes it after reading a buffered answer.

How a prefill/decode (PD) attempt plugs in (issue 13, `dispatch/pd/`): the PD pool kind (`kinds.py`, chosen by
`kind_of` from the pool's `disaggregation` config) picks a decode worker among the candidates with
room the loop gives it (the pool's decode role) and a prefill worker among its prefill role's own
candidates, each with its role's policy, and returns a two-leg attempt whose `worker` is the
decode worker (the one whose answer the client gets). Its `run()` takes both slots into one
Holding and opens both legs into it: SGLang style sends the same body (plus `bootstrap_host`,
`bootstrap_port`, `bootstrap_room`) to both at once; vLLM NIXL style first reads the prefill leg's
answer (`max_tokens: 1`, `kv_transfer_params` asking for a remote decode) and then opens the
decode leg with the `kv_transfer_params` it returned. The decode leg's first content is waited
for exactly as here. A failure of either leg before it raises `AttemptFailed`, `failed_worker`
names that leg's worker (so `failures.after_failure` judges the right one), and the Holding's
`aclose` releases both slots and aborts both requests; on success the whole Holding (both slots,
both responses) moves to the stream in one `hand_over`, so the stream's end or a client hang-up
ends both legs at once (an SGLang prefill answer still unread is then closed, not drained). The
dispatch loop does not change.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.backends.client import UpstreamResponse, UpstreamTimeouts, first_byte_budget, request_timeout
from gateway.backends.encoding import DecodeError
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.dialects.names import Api
from gateway.dialects.registry import DIALECTS
from gateway.dispatch.answers import (
    NO_CLIENT_RETRY,
    BufferedResponse,
    RelayResponse,
    json_answer_usage,
    relayed_content_type,
)
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.params import TimeoutConfig
from gateway.errors import UpstreamError
from gateway.flow.saturation import StartTicket
from gateway.observability.record import RequestRecord
from gateway.routing.features import RoutingRequest
from gateway.routing.pools import output_room
from gateway.routing.prefill import PrefillTicket
from gateway.state import AppState
from gateway.streaming import (
    AnswerTooLarge,
    AttemptFailed,
    EventTooLarge,
    Holding,
    Outcome,
    UpstreamStream,
    first_chunk,
    first_content,
    open_upstream,
    read_rest,
)

# The engine path of each client API (its dialect's `path`).
UPSTREAM_PATHS: dict[str, str] = {api: dialect.path for api, dialect in DIALECTS.items()}


class Attempt(ABC):
    """One try at getting the answer from a pool (see the module docstring for the contract)."""

    __slots__ = ("matched", "pool", "reason", "worker")

    def __init__(self, pool: PoolConfig, worker: Worker, reason: str, matched: float | None) -> None:
        self.pool = pool
        self.worker = worker
        self.reason = reason
        self.matched = matched

    @property
    def cache_worker(self) -> Worker:
        """The worker that holds the prompt's prefix cache after this attempt (affinity records it)."""
        return self.worker

    def failed_worker(self, failure: AttemptFailed) -> Worker:
        """The worker `failure` is counted and judged against (passive health, `tried`): the one
        leg's worker here; a two-leg attempt names the leg that failed."""
        return self.worker

    @abstractmethod
    async def run(self) -> BufferedResponse | RelayResponse:
        """Get the answer: a `RelayResponse` owning everything the attempt held, or a complete
        `BufferedResponse` (everything released). Raises AttemptFailed before anything reached
        the client, UpstreamError for an answer that broke or is too large after an engine accepted
        the request; releases everything it holds on every exit but a relayed stream."""


def budgets(timeouts: TimeoutConfig, request: RoutingRequest,
            pool: PoolConfig) -> tuple[UpstreamTimeouts, float, float]:
    """An attempt's time limits: the engine request's timeouts, the budget (seconds) for a
    stream's first content or a whole answer, and the wait for response headers (seconds).

    The budget is its own: the client's read timeout is per read and must also allow a long
    prefill, so it cannot catch a worker that hangs quickly. A stream's headers have a shorter
    wait: engines send them before the prefill. A whole answer's budget counts the output the
    engine really generates at most (`engine_output`), not the pool's reservation."""
    timeout = request_timeout(timeouts, request.prompt_tokens, request.stream, engine_output(request, pool))
    budget = first_byte_budget(timeouts, request.prompt_tokens) if request.stream else timeout.read
    return timeout, budget, min(timeouts.response_header, budget) if request.stream else budget


def engine_output(request: RoutingRequest, pool: PoolConfig) -> int:
    """The most output tokens the pool's engine generates for `request` (each completion): its
    output limit, else the engine's own default (`EngineSpec.default_output`: to the end of the
    context but on completions), and never more than the context leaves after the prompt (vLLM and
    llama.cpp shorten a larger limit to that; SGLang accepted only one that fits)."""
    room = output_room(pool, request)
    if request.output_tokens is None:
        return ENGINES[pool.engine].default_output(request.api, request.prompt_tokens, pool.max_context_tokens)
    return min(request.output_tokens, room)


def silence_limit(timeouts: TimeoutConfig, prompt_tokens: int) -> float:
    """Seconds a client must have waited for an attempt whose worker sent it nothing (no response
    headers) for its hang-up to count against that worker: the answer budget of an answer of no
    tokens (the first-byte budget plus `timeouts.generation`), the least the gateway allows any
    non-streamed answer. A client that gives up sooner says nothing about the worker."""
    return first_byte_budget(timeouts, prompt_tokens) + timeouts.generation


def first_byte_watch(prefill: PrefillTicket | None, started: StartTicket | None) -> Callable[[float], None] | None:
    """What the ledger calls with an attempt's first byte (`Ledger.watch_first_byte`): its
    prefill ticket's and its flow-controlled pool's not-started count's `first_byte`/`started`."""
    if started is None:
        return None if prefill is None else prefill.first_byte
    if prefill is None:
        return started.started

    def both(at: float) -> None:
        prefill.first_byte(at)
        started.started(at)

    return both


def hold_window(timeouts: TimeoutConfig, record: RequestRecord) -> float | None:
    """How long (seconds) a stream's response may be held back waiting for its first content
    (`timeouts.hold_headers`, None: no limit), counted from the client's arrival: its proxies'
    idle timers run since then."""
    hold = timeouts.hold_headers
    return None if hold is None else max(0.0, hold - (time.perf_counter() - record.started))


def upstream_headers(pool: PoolConfig, worker: Worker, ledger: Ledger) -> dict[str, str]:
    """The headers of the engine request: JSON, the engine request id and the trace context (from
    the ledger, `Ledger.upstream_headers`: the gateway's id, never the client's) and the pool's
    bearer credential."""
    headers = {"content-type": "application/json", **ledger.upstream_headers(pool.name, worker)}
    if pool.api_key is not None:
        headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
    return headers


def timed_out(moved: bool, answered: bool, header_wait: float, budget: float) -> AttemptFailed:
    """The failure of an attempt whose wait ran out: `moved` (its worker failed a health probe,
    which ends the wait at once), no response headers within `header_wait` seconds, or (`answered`)
    no first content within `budget` seconds (the engine was working on it)."""
    if moved:
        return AttemptFailed(Outcome.MOVED, "its health probe failed before it answered")
    if not answered:
        return AttemptFailed(Outcome.TIMEOUT, f"no response headers within {header_wait:.1f}s")
    return AttemptFailed(Outcome.TIMEOUT, f"no first content within {budget:.1f}s", answered=True)


class ProbeWatch:
    """While an attempt waits for response headers: if its worker fails a health probe, the
    registry calls this watch, which marks the attempt `moved` and ends the wait (`deadline`) at
    once: an engine that has not answered is not generating, the request should go elsewhere."""

    __slots__ = ("_registry", "_worker", "deadline", "moved")

    def __init__(self, registry: WorkerRegistry, worker: Worker) -> None:
        self._registry = registry
        self._worker = worker
        self.deadline: asyncio.Timeout | None = None
        self.moved = False

    def until(self, deadline: asyncio.Timeout) -> ProbeWatch:
        """Watch while in a `with` block, ending `deadline` on a failed probe."""
        self.deadline = deadline
        return self

    def __call__(self) -> None:
        self.moved = True
        if self.deadline is not None:
            self.deadline.reschedule(asyncio.get_running_loop().time())

    def __enter__(self) -> ProbeWatch:
        self._registry.awaiting_headers(self._worker, self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._registry.headers_done(self._worker, self)


class SingleLeg(Attempt):
    """The attempt of an aggregated pool: one worker serves the whole request.

    `run()`: take a slot, send the body, wait for the engine's headers and its first content
    within their budgets, then hand the stream over (`UpstreamStream`) or read the answer whole.
    `strip_usage`: the usage patch is on (its chunk is not relayed; backends/patches.py).
    `prefill`: the request's prefill ticket (a cost-aware policy's, `routing/prefill.py`): told the
    first byte through the ledger (`Ledger.watch_first_byte`), closed with the slot. What happens
    is reported to the request's `ledger` (it writes the record and issues the verdicts).
    """

    __slots__ = ("_api", "_body", "_ledger", "_prefill", "_request", "_state", "_strip_usage")

    def __init__(self, state: AppState, api: Api, pool: PoolConfig, worker: Worker, reason: str,
                 matched: float | None, body: bytes, request: RoutingRequest, ledger: Ledger,
                 strip_usage: bool, prefill: PrefillTicket | None = None) -> None:
        super().__init__(pool, worker, reason, matched)
        self._state = state
        self._api = api
        self._body = body
        self._request = request
        self._ledger = ledger
        self._strip_usage = strip_usage
        self._prefill = prefill

    async def run(self) -> BufferedResponse | RelayResponse:
        """Take the slot, send, wait for headers then first content, and accept (see the class)."""
        holding = Holding()
        prefill = self._prefill
        request = self._request  # its tokens the affinity store says are cached there need no prefill
        started = self._state.flow.ticket(self.pool, self.worker,
                                          int(request.prompt_tokens * (1.0 - (self.matched or 0.0))), request.stream)
        self._ledger.watch_first_byte(first_byte_watch(prefill, started))
        try:
            holding.lease(self.worker, self._state.metrics, self._state.registry.gates[self.pool.name], prefill=prefill,
                          adapter=self._request.adapter, started=started)
            return await self._serve(holding, self.upstream_headers())
        finally:
            if holding:  # not handed over: release the slot (a waiter may take it), then the connection
                await holding.aclose()

    @property
    def body(self) -> bytes:
        """The engine request's body."""
        return self._body

    @property
    def strip_usage(self) -> bool:
        """Whether the usage patch is on (its chunk is not relayed)."""
        return self._strip_usage

    def upstream_headers(self) -> dict[str, str]:
        """The engine request's headers (`upstream_headers`)."""
        return upstream_headers(self.pool, self.worker, self._ledger)

    def serve(self, holding: Holding, headers: dict[str, str]) -> Awaitable[BufferedResponse | RelayResponse]:
        """The relay without the slot (a PD attempt's decode leg, `dispatch/pd/`): `_serve` into
        `holding`, whose slots the caller took."""
        return self._serve(holding, headers)

    async def _serve(self, holding: Holding, headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        """Send the body to `self.worker` with `headers`, wait for headers then first content, and
        accept: a stream takes everything `holding` holds; a buffered answer is read whole (the
        caller closes `holding`)."""
        state, request, ledger, worker, pool = self._state, self._request, self._ledger, self.worker, self.pool
        timeouts = state.config.timeouts
        timeout, budget, header_wait = budgets(timeouts, request, pool)
        ledger.answer_budget(budget)
        probe = ProbeWatch(state.registry, worker)
        answered = False
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(header_wait) as deadline:
                with probe.until(deadline):
                    response = holding.opened(await open_upstream(
                        state.upstream, worker.url + UPSTREAM_PATHS[self._api], self._body, headers, timeout,
                        pool.name))
                answered = True
                ledger.headers_arrived(worker)
                deadline.reschedule(started + budget)
                content = True
                if request.stream:  # `content` False: still prefilling; commit and send keep-alives
                    sse = response.headers.get("content-type", "").startswith("text/event-stream")
                    first, rest, content = await first_content(response, hold_window(timeouts, ledger.record), sse,
                                                               state.config.max_body_bytes)
                else:
                    first, rest = await first_chunk(response)
        except TimeoutError:
            raise timed_out(probe.moved, answered, header_wait, budget) from None
        except EventTooLarge as exc:
            raise self._event_too_large(int(exc.args[0])) from None
        content_type = self._accepted(response)
        if request.stream:
            return self._relay(holding, response, first, rest, content, content_type)
        ledger.first_byte()
        try:
            answer = await read_rest(response, first, rest, state.config.max_body_bytes)
        except (AnswerTooLarge, DecodeError) as exc:
            raise self._broken(exc) from exc
        except Exception as exc:
            raise self._cut(exc) from exc
        return self._buffered(answer, content_type)

    def _accepted(self, response: UpstreamResponse) -> bytes:
        """The engine's 200 checked: the client's content type. Raises AttemptFailed
        (protocol_error) for a type we must not relay."""
        content_type = relayed_content_type(response, self._request.stream)
        self._ledger.accepted(response.status_code)
        return content_type

    def _relay(self, holding: Holding, response: UpstreamResponse, first: bytes, rest: AsyncIterator[bytes],
               content: bool, content_type: bytes) -> RelayResponse:
        """Hand the stream over: from here the `UpstreamStream` owns the slot and the response."""
        ledger = self._ledger
        if content:
            ledger.first_byte()
        # No keep-alives of its own (None): the relay's heartbeat stage covers every silence of a
        # committed stream, this prefill's too (gateway/api/heartbeat.py).
        stream = UpstreamStream(response, first, rest, holding.hand_over(), ledger, not content,
                                None, self._ended, self._strip_usage,
                                self._state.config.max_body_bytes,
                                ENGINES[self.pool.engine].messages_cache_in_input, self._api,
                                self._state.config.timeouts.read)
        return RelayResponse(stream, content_type)

    def _buffered(self, answer: bytes, content_type: bytes) -> BufferedResponse:
        """A whole non-streaming answer (identity bytes); its usage is read for the record. A cut or
        broken JSON answer is the engine's failure."""
        try:
            usage = json_answer_usage(answer, content_type, self._api,
                                      ENGINES[self.pool.engine].messages_cache_in_input)
        except ValueError as exc:
            raise self._cut(exc) from exc
        self._ledger.usage(usage)
        self._ended(None)
        return BufferedResponse(200, answer, content_type)

    def _cut(self, exc: Exception) -> AttemptFailed:
        """The failure of a non-streaming answer that broke while it was read (a reset or an EOF
        before its end, a cut JSON body): nothing reached the client, so it is an attempt that
        failed like any other (the dispatch tries another worker, `after_failure` holds it against
        this one), not a migration: there is no partial answer to continue."""
        return AttemptFailed(Outcome.PROTOCOL_ERROR, f"the answer broke while it was read ({exc})", answered=True)

    def _broken(self, exc: Exception) -> UpstreamError:
        """The error for a non-streaming answer the engine encoded unasked into more than the gateway
        relays (held against the worker), or that grew too large (the request's doing: held against
        nobody); one cut while it was read is `_cut`'s."""
        self._ledger.answer_broken()
        if isinstance(exc, AnswerTooLarge):
            limit = self._state.config.max_body_bytes
            return UpstreamError(f"The answer is larger than this gateway relays without streaming ({limit} "
                                 f"bytes); ask for fewer tokens or completions, or stream it.")
        self._ended(f"broken answer: {exc}")
        return UpstreamError(f"The inference server failed while sending its answer ({exc}).")

    def _event_too_large(self, size: int) -> UpstreamError:
        """The error for a stream whose engine sent one event over `max_body_bytes` before its first
        content (`first_content`): token-level data the request asked for (`prompt_logprobs` on a
        long prompt), or a line without end. Given once: not retried on another worker (it would
        redo the whole prefill), not by the client either (`x-should-retry: false`), and held
        against nobody (a client must not be able to eject workers by asking for it)."""
        self._ledger.answer_broken()
        limit = self._state.config.max_body_bytes
        return UpstreamError(f"The inference server sent a stream event of over {size} bytes before the first "
                             f"token, more than this gateway relays ({limit} bytes); ask for less token-level data "
                             "(prompt_logprobs, prompt token ids) on a prompt this long.",
                             headers=dict(NO_CLIENT_RETRY))

    def _ended(self, failure: str | None) -> None:
        """Passive health counts whole answers: a stream that breaks after its first byte too."""
        if failure is None:
            self._ledger.worker_succeeded(self.worker)
        else:
            self._ledger.worker_failed(self.worker, failure)
