"""One attempt without a socket (`gateway/dispatch/attempt.py`, `kinds.py`): what it owns and
releases on every exit path (`Holding`), the probe watch that moves a waiting attempt, its time
budgets, the aggregated pool kind's attempt, and `SingleLeg.run` against an in-memory engine
answer (the real engine paths are covered by tests/integration/test_failure_attribution.py,
test_engine_answer_relay.py and others)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest

from gateway.backends.client import UpstreamTimeouts
from gateway.backends.registry import WorkerRegistry
from gateway.config import GatewayConfig, parse_config
from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.attempt import ProbeWatch, SingleLeg, budgets, engine_output, hold_window
from gateway.dispatch.context import Dispatch
from gateway.dispatch.failures import Failures, exhausted
from gateway.dispatch.kinds import AGGREGATED, kind_of
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.service import ProxyService
from gateway.errors import NoCapacity
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestRecord
from gateway.redact import Redactor
from gateway.routing.features import RoutingRequest
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Holding, Outcome


def config(timeouts: dict[str, Any] | None = None, **pool: Any) -> GatewayConfig:
    """One pool `p` of two workers (a, b); `timeouts` is the gateway's section, `pool` the pool's fields."""
    return parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                    "workers": ["http://a:1", "http://b:1"], **pool}],
                         "health": {"unhealthy_after": 1}, "timeouts": timeouts or {}}, environ={})


def request(prompt: int = 100, stream: bool = False, output: int | None = None) -> RoutingRequest:
    return RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=prompt, output_tokens=output, stream=stream,
                          modalities=frozenset({"text"}), estimate_method="bytes")


class Answer:
    """An engine's answer as the attempt sees it (the `UpstreamResponse` surface), in memory."""

    def __init__(self, status: int, chunks: list[bytes], content_type: str = "application/json",
                 log: list[str] | None = None) -> None:
        self.status_code = status
        self.headers: Mapping[str, str] = {"content-type": content_type}
        self.redact = Redactor()  # no secrets configured
        self._chunks = chunks
        self.closed = 0
        self._log = log
        self.gap: float | None = None  # the read timeout set once content flowed

    def content_started(self, gap: float) -> None:
        self.gap = gap

    async def _iterate(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk

    def chunks(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def aclose(self) -> None:
        self.closed += 1
        if self._log is not None:
            self._log.append("response closed")


class Engine:
    """The upstream client's `post`, answering from memory (or never, with `hang`)."""

    def __init__(self, answer: Answer | None) -> None:
        self.answer = answer
        self.posted: list[str] = []

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeouts: UpstreamTimeouts,
                   pool: str | None = None) -> Answer:
        self.posted.append(url)
        if self.answer is None:
            await asyncio.Event().wait()  # hangs until the attempt's wait ends
        assert self.answer is not None
        return self.answer


@pytest.fixture
def state() -> Iterator[AppState]:
    app_state = AppState.build(config(timeouts={"response_header": 0.05, "first_byte_base": 0.05}))
    yield app_state
    app_state.parse_pool.close()


def ledger_of(state: AppState, pool: str = "p", stream: bool = False) -> Ledger:
    """A chat request's ledger on `state`'s metrics and registry, in `pool`."""
    ledger = Ledger("chat", "r", None, state.metrics, state.registry)
    ledger.record.pool, ledger.record.stream = pool, stream
    return ledger


def single_leg(state: AppState, engine: Engine, stream: bool = False) -> tuple[SingleLeg, RequestRecord]:
    state.upstream = engine  # type: ignore[assignment]
    pool = state.config.pools[0]
    worker = state.registry.pools["p"][0]
    ledger = ledger_of(state, stream=stream)
    return SingleLeg(state, "chat", pool, worker, "least_load", None, b"{}", request(stream=stream), ledger,
                     False), ledger.record


def in_flight(state: AppState) -> tuple[int, int]:
    worker = state.registry.pools["p"][0]
    return worker.in_flight, state.registry.gates["p"].in_flight


# -- what an attempt holds --------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_holding_releases_slots_then_responses_once_and_hands_everything_over_in_one_call() -> None:
    cfg = config(max_in_flight=4)
    registry, metrics = WorkerRegistry(cfg), GatewayMetrics()
    a, b = registry.pools["p"]
    gate = registry.gates["p"]
    log: list[str] = []
    holding = Holding()
    assert not holding
    holding.lease(a, metrics, gate)
    holding.lease(b, metrics, gate)  # a two-leg attempt holds two slots and two responses
    first, second = Answer(200, [], log=log), Answer(200, [], log=log)
    assert holding.opened(first) is first
    holding.opened(second)
    assert holding and (a.in_flight, b.in_flight, gate.in_flight) == (1, 1, 2)
    moved = holding.hand_over()
    assert not holding and moved
    await holding.aclose()  # the attempt's cleanup: nothing of its own left
    assert (a.in_flight, gate.in_flight, first.closed) == (1, 2, 0)

    class Released:
        async def aclose(self) -> None:
            log.append(f"slots {gate.in_flight}")

    moved.opened(Released())  # type: ignore[arg-type]
    await moved.aclose()
    await moved.aclose()
    assert (a.in_flight, b.in_flight, gate.in_flight) == (0, 0, 0)
    assert log == ["response closed", "response closed", "slots 0"]  # slots were free before any close
    assert metrics.registry.get_sample_value("kimi_gateway_in_flight", {"pool": "p", "worker": a.id}) == 0


@pytest.mark.anyio
async def test_a_holding_frees_its_slots_even_when_closing_a_response_fails() -> None:
    registry, metrics = WorkerRegistry(config()), GatewayMetrics()
    a = registry.pools["p"][0]

    class Broken:
        async def aclose(self) -> None:
            raise OSError("reset")

    holding = Holding()
    holding.lease(a, metrics, registry.gates["p"])
    holding.opened(Broken())  # type: ignore[arg-type]
    with pytest.raises(OSError):
        await holding.aclose()
    assert a.in_flight == 0 and not holding


# -- the probe watch and the budgets ----------------------------------------------------------------

@pytest.mark.anyio
async def test_a_failed_health_probe_ends_the_header_wait_at_once_and_marks_the_attempt_moved() -> None:
    registry = WorkerRegistry(config())
    a = registry.pools["p"][0]
    watch = ProbeWatch(registry, a)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(30) as deadline:
            with watch.until(deadline):
                loop.call_soon(registry.probe_failed, a, "connection refused")
                await asyncio.Event().wait()
    when = deadline.when()
    assert watch.moved and when is not None and when < started + 30  # the wait was ended, not run out
    registry.probe_failed(a, "again")  # after the wait: the watch is no longer registered
    later = ProbeWatch(registry, a)
    with later.until(deadline):
        pass
    assert not later.moved


def test_budgets_give_a_stream_a_short_header_wait_and_a_whole_answer_its_read_timeout() -> None:
    cfg = config(timeouts={"response_header": 2.0, "first_byte_base": 10.0, "first_byte_per_1k_tokens": 1.0})
    pool = cfg.pools[0]
    timeout, budget, header_wait = budgets(cfg.timeouts, request(prompt=5000, stream=True), pool)
    assert (budget, header_wait) == (15.0, 2.0)
    timeout, budget, header_wait = budgets(cfg.timeouts, request(prompt=5000, output=100), pool)
    assert budget == header_wait == timeout.read


def test_a_whole_answer_without_an_output_limit_gets_the_budget_of_the_engines_own_default() -> None:
    """vLLM (and SGLang) generate to the end of the context when a chat or Responses request sets no
    limit: the budget counts that, not the pool's `default_output_tokens` (1024 here), else a long
    answer times out on a healthy worker. Completions default to 16 tokens on vLLM; an explicit
    limit counts at most what the context leaves after the prompt (vLLM shortens it)."""
    cfg = config(timeouts={"first_byte_base": 1.0, "first_byte_per_1k_tokens": 0.0, "generation": 1.0,
                           "generation_per_token": 0.01}, default_output_tokens=1024)
    pool = cfg.pools[0]
    assert engine_output(request(prompt=192), pool) == 8192 - 192
    _, budget, _ = budgets(cfg.timeouts, request(prompt=192), pool)
    assert budget == pytest.approx(2.0 + 0.01 * 8000)
    completion = RoutingRequest(api="completions", model="kimi-k3", prompt_tokens=100, output_tokens=None,
                                stream=False, modalities=frozenset({"text"}), estimate_method="bytes")
    assert engine_output(completion, pool) == 16
    assert engine_output(request(prompt=8000, output=32000), pool) == 192
    assert engine_output(request(prompt=100, output=50), pool) == 50


def test_the_hold_window_counts_from_the_clients_arrival() -> None:
    cfg = config(timeouts={"hold_headers": 5.0})
    record = RequestRecord(request_id="r", api="chat")
    record.started -= 2.0
    window = hold_window(cfg.timeouts, record)
    assert window is not None and 2.5 < window <= 3.0
    record.started -= 10.0
    assert hold_window(cfg.timeouts, record) == 0.0
    assert hold_window(config(timeouts={"hold_headers": None}).timeouts, record) is None


# -- the aggregated pool kind -----------------------------------------------------------------------

def test_the_aggregated_kind_makes_one_single_leg_attempt_from_the_policys_choice(state: AppState) -> None:
    pool = state.config.pools[0]
    assert kind_of(pool) is AGGREGATED
    a, b = state.registry.pools["p"]
    a.in_flight += 3  # the default (ttft_cost) policy: b is as fast and holds the longer prefix
    dispatch = Dispatch(state, "chat", {"model": "kimi-k3", "messages": [], "max_completion_tokens": 5},
                        request(), ledger_of(state), list(state.config.pools), pool)
    attempt = AGGREGATED.attempt(dispatch, state.policies.policy("p"), [a, b], {"http://b:1": 0.5})
    assert isinstance(attempt, SingleLeg)
    # `matched`: the share b held, for the affinity metric (None with a policy that ignores affinity)
    assert (attempt.worker, attempt.pool, attempt.reason, attempt.matched) == (b, pool, "affinity", 0.5)
    assert len(dispatch.bodies) == 1  # the engine body, encoded once for the request's attempts
    a.in_flight -= 3


def test_exhausted_by_busy_workers_is_upstream_overloaded_with_the_shortest_wait() -> None:
    cfg = config()
    registry = WorkerRegistry(cfg)
    pools = list(cfg.pools)
    a, b = registry.pools["p"]
    registry.throttled(a, 30.0)
    registry.throttled(b, 2.5)
    record = RequestRecord(request_id="r", api="chat", pool="p")
    error = exhausted(registry, None, record, pools, Failures())
    assert isinstance(error, NoCapacity) and error.code == "upstream_overloaded"
    assert error.headers == {"retry-after": "3"}


# -- SingleLeg.run: every exit path releases what it held, or hands it over -------------------------

@pytest.mark.anyio
async def test_a_failed_attempt_releases_its_slot_and_closes_the_response(state: AppState) -> None:
    answer = Answer(503, [b'{"error": "overloaded"}'])
    attempt, _ = single_leg(state, Engine(answer))
    with pytest.raises(AttemptFailed) as caught:
        await attempt.run()
    assert caught.value.outcome is Outcome.STATUS_5XX
    assert in_flight(state) == (0, 0) and answer.closed >= 1


@pytest.mark.anyio
async def test_an_engine_without_headers_in_time_times_out_and_releases_its_slot(state: AppState) -> None:
    attempt, record = single_leg(state, Engine(None), stream=True)
    with pytest.raises(AttemptFailed) as caught:
        await attempt.run()
    assert (caught.value.outcome, caught.value.answered, record.status) == (Outcome.TIMEOUT, False, 0)
    assert "no response headers" in caught.value.detail and in_flight(state) == (0, 0)


@pytest.mark.anyio
async def test_a_buffered_answer_is_read_whole_then_everything_is_released(state: AppState) -> None:
    answer = Answer(200, [b'{"usage": {"prompt_tokens": 3,', b' "completion_tokens": 4}}'])
    attempt, record = single_leg(state, Engine(answer))
    result = await attempt.run()
    assert isinstance(result, BufferedResponse) and result.status == 200
    assert record.usage == {"prompt_tokens": 3, "completion_tokens": 4} and record.status == 200
    assert in_flight(state) == (0, 0) and answer.closed == 1


@pytest.mark.anyio
async def test_a_cut_buffered_answer_is_a_failed_attempt_held_against_the_worker(state: AppState) -> None:
    # Nothing reached the client, so the dispatch may retry it on another worker (issue 23).
    answer = Answer(200, [b'{"usage": {"prompt'])
    attempt, _ = single_leg(state, Engine(answer))
    with pytest.raises(AttemptFailed, match="broke while it was read"):
        await attempt.run()
    assert in_flight(state) == (0, 0)  # the dispatch charges the worker (test_worker_failover.py)


@pytest.mark.anyio
async def test_an_accepted_stream_owns_the_slot_and_the_response_until_it_is_closed(state: AppState) -> None:
    events = [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]
    answer = Answer(200, events, content_type="text/event-stream")
    attempt, record = single_leg(state, Engine(answer), stream=True)
    result = await attempt.run()
    assert isinstance(result, RelayResponse) and record.first_byte_at is not None
    assert in_flight(state) == (1, 1) and answer.closed == 0  # handed over, not released
    assert answer.gap == state.config.timeouts.read  # from the first content, the gap limit between tokens
    relayed = b"".join([chunk async for chunk in result.stream.body()])
    assert relayed == b"".join(events)
    assert in_flight(state) == (0, 0) and answer.closed == 1


# -- the dispatch loop's accounting steps -----------------------------------------------------------

def two_pools() -> GatewayConfig:
    return parse_config({"pools": [
        {"name": "small", "engine": "vllm", "max_context_tokens": 8192, "workers": ["http://a:1"]},
        {"name": "large", "engine": "vllm", "max_context_tokens": 131072, "workers": ["http://c:1"]},
    ]}, environ={})


def test_a_failed_attempts_accounting_and_a_too_long_move_to_the_larger_pool_once() -> None:
    app_state = AppState.build(two_pools())
    try:
        service = ProxyService(app_state)
        pools = list(app_state.config.pools)
        ledger = ledger_of(app_state, "small")
        record = ledger.record
        dispatch = Dispatch(app_state, "chat", {}, request(), ledger, pools, pools[0])
        a = app_state.registry.pools["small"][0]
        attempt = SingleLeg(app_state, "chat", pools[0], a, "least_load", None, b"{}", request(), ledger, False)
        service._attempt_started(dispatch, attempt)
        assert (record.attempts, record.worker, ledger.open_attempt) == (1, a.id, a)
        too_long = AttemptFailed(Outcome.TOO_LONG, "too long", 400, b'{"error": {"message": "too long"}}',
                                 answered=True)
        assert service._attempt_failed(dispatch, attempt, too_long) is None  # try again, in the larger pool
        assert (dispatch.pool.name, record.pool, dispatch.too_long_retried) == ("large", "large", True)
        assert ledger.open_attempt is None and dispatch.tried == {a} and dispatch.last is too_long
        c = app_state.registry.pools["large"][0]
        second = SingleLeg(app_state, "chat", pools[1], c, "least_load", None, b"{}", request(), ledger, False)
        service._attempt_started(dispatch, second)
        answer = service._attempt_failed(dispatch, second, too_long)  # a second "too long": the engine's answer
        assert isinstance(answer, BufferedResponse) and answer.status == 400 and record.attempts == 2
        metrics = app_state.metrics.registry
        assert metrics.get_sample_value("kimi_gateway_upstream_attempts_total",
                                        {"pool": "small", "worker": a.id, "outcome": "too_long"}) == 1
        assert metrics.get_sample_value("kimi_gateway_retries_total", {"pool": "large", "cause": "too_long"}) == 1
    finally:
        app_state.parse_pool.close()
