"""The PD attempt without a socket (`gateway/dispatch/pd/`): each protocol runner's leg order
against in-memory engine answers, which worker a failure is held against (`failed_worker`) and
counted as (`kimi_gateway_pd_leg_failures_total{phase}`), both slots released, a NIXL stream
committed while its prefill runs, and the Mooncake engine id the registry keeps. The real engine
paths are tests/integration/test_pd_dispatch.py, test_pd_failures.py and test_pd_kv_handles.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from gateway.backends.client import UpstreamTimeouts
from gateway.backends.worker import Worker
from gateway.config import parse_config
from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.pd.attempt import PdAttempt, PdRunner
from gateway.dispatch.pd.deferred import DeferredStream
from gateway.dispatch.pd.mooncake import MOONCAKE
from gateway.dispatch.pd.nixl import NIXL
from gateway.dispatch.pd.sglang import SGLANG
from gateway.observability.record import RequestRecord
from gateway.routing.features import RoutingRequest
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Outcome
from tests.unit.test_dispatch_attempt import Answer, ledger_of

BODY = orjson.dumps({"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8})
USAGE = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
HANDLE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1], "remote_engine_id": "e",
          "remote_request_id": "r", "remote_host": "p0", "remote_port": 5600, "tp_size": 1}
EVENTS = [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]


class Waiting(Answer):
    """A stream whose first event comes once `event` is set (a decode worker waiting for its KV)."""

    def __init__(self, event: asyncio.Event, chunks: list[bytes]) -> None:
        super().__init__(200, chunks, content_type="text/event-stream")
        self._event = event

    async def _iterate(self) -> AsyncIterator[bytes]:
        await self._event.wait()
        async for chunk in super()._iterate():
            yield chunk


Behaviour = Callable[[], Awaitable[Answer]]


def now(answer: Answer) -> Behaviour:
    async def answer_now() -> Answer:
        return answer
    return answer_now


def after(event: asyncio.Event, answer: Answer) -> Behaviour:
    async def answer_later() -> Answer:
        await event.wait()
        return answer
    return answer_later


async def never() -> Answer:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class Pair:
    """The upstream client's `post` for a prefill (host p0) and a decode (host d0) worker; records
    each leg as (host, body bytes, headers) in the order sent."""

    def __init__(self, prefill: Behaviour, decode: Behaviour) -> None:
        self._answers = {"p0": prefill, "d0": decode}
        self.posted: list[tuple[str, bytes, dict[str, str]]] = []

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeouts: UpstreamTimeouts,
                   pool: str | None = None) -> Answer:
        host = urlsplit(url).hostname or ""
        self.posted.append((host, body, dict(headers)))
        return await self._answers[host]()

    def hosts(self) -> list[str]:
        return [host for host, _, _ in self.posted]

    def body(self, host: str) -> dict[str, Any]:
        return orjson.loads(next(body for h, body, _ in self.posted if h == host))


def pd_state(mode: str, timeouts: dict[str, Any] | None = None) -> AppState:
    prefill: dict[str, Any] = {"url": "http://p0:1"}
    if mode != "vllm-nixl":
        prefill["bootstrap_port"] = 8998
    return AppState.build(parse_config({"pools": [{
        "name": "pd", "engine": "sglang" if mode == "sglang" else "vllm", "max_context_tokens": 8192,
        "disaggregation": {"mode": mode, "prefill": [prefill], "decode": ["http://d0:1"]}}],
        "timeouts": timeouts or {}}, environ={}))


@pytest.fixture
def states() -> Iterator[list[AppState]]:
    built: list[AppState] = []
    yield built
    for state in built:
        state.parse_pool.close()


def workers(state: AppState) -> tuple[Worker, Worker]:
    """(prefill, decode)."""
    pool = state.registry.pools["pd"]
    return next(w for w in pool if w.role == "prefill"), next(w for w in pool if w.role != "prefill")


def attempt(state: AppState, runner: PdRunner, pair: Pair, stream: bool = False) -> tuple[PdAttempt, RequestRecord]:
    state.upstream = pair  # type: ignore[assignment]
    prefill, decode = workers(state)
    ledger = ledger_of(state, "pd", stream)
    record = ledger.record
    request = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=100, output_tokens=None, stream=stream,
                             modalities=frozenset({"text"}), estimate_method="bytes")
    return PdAttempt(runner, state, "chat", state.config.pools[0], decode, prefill, "prefill:r,decode:r",
                     "r", None, BODY, request, ledger, False), record


def leg_failures(state: AppState, phase: str, outcome: str) -> float | None:
    return state.metrics.registry.get_sample_value("kimi_gateway_pd_leg_failures_total",
                                                   {"pool": "pd", "phase": phase, "outcome": outcome})


def released(state: AppState) -> bool:
    prefill, decode = workers(state)
    return (prefill.in_flight, decode.in_flight, state.registry.gates["pd"].in_flight) == (0, 0, 0)


# -- SGLang: one body to both legs at once ------------------------------------------------------------

@pytest.mark.anyio
async def test_sglang_sends_one_body_to_both_legs_at_once_and_answers_the_decodes(states: list[AppState]) -> None:
    state = pd_state("sglang")
    states.append(state)
    pair = Pair(never, now(Answer(200, [USAGE])))
    pd, record = attempt(state, SGLANG, pair)
    result = await pd.run()
    assert isinstance(result, BufferedResponse) and result.body == USAGE
    assert sorted(pair.hosts()) == ["d0", "p0"]
    (_, first, first_headers), (_, second, second_headers) = pair.posted
    assert first == second  # the same bytes: encoded once
    sent = orjson.loads(first)
    assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("p0", 8998) and isinstance(sent["bootstrap_room"], int)
    assert first_headers["x-request-id"] == second_headers["x-request-id"]
    assert record.prefill_worker == workers(state)[0].id and pd.cache_worker is workers(state)[0]
    assert released(state)  # the prefill leg still running is aborted with the slots


@pytest.mark.anyio
async def test_a_prefill_failure_first_fails_the_attempt_against_the_prefill_worker(states: list[AppState]) -> None:
    state = pd_state("sglang")
    states.append(state)
    pd, _ = attempt(state, SGLANG, Pair(now(Answer(500, [b"{}"])), never))
    with pytest.raises(AttemptFailed) as failed:
        await pd.run()
    assert failed.value.outcome is Outcome.STATUS_5XX
    assert pd.failed_worker(failed.value) is workers(state)[0]
    assert leg_failures(state, "prefill", "status_5xx") == 1 and leg_failures(state, "decode", "status_5xx") is None
    assert released(state)


@pytest.mark.anyio
async def test_a_decode_failure_is_held_against_the_decode_worker(states: list[AppState]) -> None:
    state = pd_state("sglang")
    states.append(state)
    pd, _ = attempt(state, SGLANG, Pair(never, now(Answer(503, [b"{}"]))))
    with pytest.raises(AttemptFailed) as failed:
        await pd.run()
    assert pd.failed_worker(failed.value) is workers(state)[1]
    assert leg_failures(state, "decode", "status_5xx") == 1 and leg_failures(state, "prefill", "status_5xx") is None
    assert released(state)


@pytest.mark.anyio
async def test_a_prefill_failure_after_the_commit_aborts_the_waiting_decode(states: list[AppState]) -> None:
    state = pd_state("sglang", {"hold_headers": 0.05, "keepalive_interval": 0.02})
    states.append(state)
    failing, kv = asyncio.Event(), asyncio.Event()
    pair = Pair(after(failing, Answer(500, [b"{}"])), now(Waiting(kv, EVENTS)))
    pd, record = attempt(state, SGLANG, pair, stream=True)
    result = await pd.run()  # committed: the decode worker sent headers, no content yet
    assert isinstance(result, RelayResponse)
    failing.set()
    relayed = [chunk async for chunk in result.stream.body() if chunk != b": keep-alive\n\n"]
    assert len(relayed) == 1 and b'"code":"upstream_error"' in relayed[0] and b"[DONE]" not in relayed[0]
    assert (record.error or "").startswith("The prefill worker failed before the first token")
    prefill, decode = workers(state)
    assert (prefill.consecutive_failures, decode.consecutive_failures) == (1, 0)
    assert leg_failures(state, "prefill", "status_5xx") == 1
    assert released(state)


# -- vLLM NIXL: the prefill leg, then the decode leg with its KV handle ---------------------------------

@pytest.mark.anyio
async def test_nixl_opens_the_decode_leg_with_the_handle_the_prefill_answered(states: list[AppState]) -> None:
    state = pd_state("vllm-nixl")
    states.append(state)
    pair = Pair(now(Answer(200, [orjson.dumps({"id": "x", "kv_transfer_params": HANDLE})])),
                now(Answer(200, [USAGE])))
    pd, _ = attempt(state, NIXL, pair)
    result = await pd.run()
    assert isinstance(result, BufferedResponse) and result.body == USAGE
    assert pair.hosts() == ["p0", "d0"]
    prefill_leg = pair.body("p0")
    assert (prefill_leg["stream"], prefill_leg["max_tokens"], prefill_leg["max_completion_tokens"]) == (False, 1, 1)
    assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
    assert pair.body("d0") == {**orjson.loads(BODY), "kv_transfer_params": HANDLE}
    assert state.metrics.registry.get_sample_value("kimi_gateway_pd_prefill_seconds_count", {"pool": "pd"}) == 1
    assert released(state)


@pytest.mark.anyio
@pytest.mark.parametrize(("answer", "counted"), [
    (orjson.dumps({"kv_transfer_params": {**HANDLE, "remote_host": "elsewhere"}}), True),
    (b"[]", False),
    (orjson.dumps({"kv_transfer_params": "handle"}), False),
])
async def test_a_prefill_answer_without_a_usable_handle_never_reaches_the_decode_worker(
        states: list[AppState], answer: bytes, counted: bool) -> None:
    state = pd_state("vllm-nixl")
    states.append(state)
    pair = Pair(now(Answer(200, [answer])), now(Answer(200, [USAGE])))
    pd, _ = attempt(state, NIXL, pair)
    with pytest.raises(AttemptFailed) as failed:
        await pd.run()
    assert failed.value.outcome is Outcome.PROTOCOL_ERROR and pd.failed_worker(failed.value) is workers(state)[0]
    assert pair.hosts() == ["p0"]
    assert leg_failures(state, "prefill", "protocol_error") == (1 if counted else None)
    assert released(state)


async def committed_nixl_stream(states: list[AppState], prefill: Answer) -> tuple[list[bytes], Pair, RequestRecord]:
    """A NIXL stream whose prefill leg (answering `prefill`) outlasts the hold window: the chunks
    the client gets once the prefill answered (the stream's silences get heartbeats from the relay,
    gateway/api/heartbeat.py, not from the stream), the legs, the record."""
    state = pd_state("vllm-nixl", {"hold_headers": 0.05, "keepalive_interval": 0.02})
    states.append(state)
    prefilled = asyncio.Event()
    pair = Pair(after(prefilled, prefill), now(Answer(200, EVENTS, content_type="text/event-stream")))
    pd, record = attempt(state, NIXL, pair, stream=True)
    result = await pd.run()
    assert isinstance(result, RelayResponse) and isinstance(result.stream, DeferredStream)
    assert record.status == 200 and pair.hosts() == ["p0"]  # committed; no decode leg yet
    body = result.stream.body()
    prefilled.set()
    rest = [chunk async for chunk in body]
    assert released(state)
    return rest, pair, record


@pytest.mark.anyio
async def test_a_nixl_stream_is_committed_while_a_long_prefill_runs(states: list[AppState]) -> None:
    rest, pair, _ = await committed_nixl_stream(states, Answer(200, [orjson.dumps({"kv_transfer_params": HANDLE})]))
    assert b"".join(rest) == b"".join(EVENTS) and pair.hosts() == ["p0", "d0"]


@pytest.mark.anyio
async def test_a_deferred_streams_prefill_failure_ends_it_with_one_error_event(states: list[AppState]) -> None:
    tail, pair, record = await committed_nixl_stream(states, Answer(502, [b"{}"]))
    assert len(tail) == 1 and tail[0].startswith(b"data: ") and b"[DONE]" not in tail[0]
    assert orjson.loads(tail[0][6:])["error"]["message"].startswith("The inference server failed before the first")
    assert record.outcome == "upstream_error" and pair.hosts() == ["p0"]
    prefill, decode = workers(states[0])
    assert (prefill.consecutive_failures, decode.consecutive_failures) == (1, 0)


# -- vLLM Mooncake: both legs at once, the engine id kept by the registry -------------------------------

def bootstrap(state: AppState, answers: list[httpx.Response]) -> list[str]:
    """The prefill worker's bootstrap server, answering `answers` in turn; returns the URLs asked."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return answers.pop(0)

    state.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return asked


@pytest.mark.anyio
async def test_mooncake_ties_both_legs_by_one_transfer_id_and_keeps_the_engine_id(states: list[AppState]) -> None:
    state = pd_state("vllm-mooncake")
    states.append(state)
    asked = bootstrap(state, [httpx.Response(200, json={"0": {"engine_id": "e0", "worker_addr": {}}})])
    prefill, _ = workers(state)
    pair = Pair(now(Answer(200, [b"{}"])), now(Answer(200, [USAGE])))
    pd, _ = attempt(state, MOONCAKE, pair)
    assert isinstance(await pd.run(), BufferedResponse)
    assert asked == ["http://p0:8998/query"] and prefill.pd_engine_id == "e0"
    sent, received = pair.body("p0")["kv_transfer_params"], pair.body("d0")["kv_transfer_params"]
    assert sent["transfer_id"] == received["transfer_id"] and sent["do_remote_decode"] is True
    assert (received["remote_bootstrap_addr"], received["remote_engine_id"]) == ("http://p0:8998", "e0")

    pair = Pair(now(Answer(200, [b"{}"])), now(Answer(500, [b"{}"])))  # the id kept: no second query
    pd, _ = attempt(state, MOONCAKE, pair)
    with pytest.raises(AttemptFailed):
        await pd.run()
    assert len(asked) == 1 and pair.body("d0")["kv_transfer_params"]["remote_engine_id"] == "e0"
    assert prefill.pd_engine_id is None  # forgotten after a failed attempt: read again next time
    await state.http.aclose()


@pytest.mark.anyio
async def test_an_unreadable_bootstrap_server_fails_the_attempt_against_the_prefill_worker(
        states: list[AppState]) -> None:
    state = pd_state("vllm-mooncake")
    states.append(state)
    bootstrap(state, [httpx.Response(503)])
    pair = Pair(now(Answer(200, [b"{}"])), now(Answer(200, [USAGE])))
    pd, _ = attempt(state, MOONCAKE, pair)
    with pytest.raises(AttemptFailed, match="prefill bootstrap server http://p0:8998/query") as failed:
        await pd.run()
    assert failed.value.outcome is Outcome.CONNECT_ERROR and pd.failed_worker(failed.value) is workers(state)[0]
    assert pair.posted == [] and released(state)
    await state.http.aclose()
