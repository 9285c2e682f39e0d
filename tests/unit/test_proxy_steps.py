"""The proxy endpoint's steps that need no socket (`gateway/api/proxy.py`): refusing a request from its
head alone, reading its body, telling a shutdown cut, a stalled reader and a hang-up apart, and the
relay (the proxied endpoints' and the stored-response replay's) with its overall cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.api.proxy import (
    ClientGone,
    cancelled,
    check_head,
    hung_up,
    read_body,
    relay,
    request_id_of,
    start_message,
    watch_hang_up,
)
from gateway.auth.middleware import AUTH_ERROR
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.dialects.names import CHAT
from gateway.dialects.registry import dialect_for
from gateway.dispatch.answers import RelayResponse
from gateway.dispatch.ledger import Ledger
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestBodyTimeout,
    UnsupportedMediaType,
)
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestOutcome
from gateway.serving.lifecycle import SHUTDOWN_GUARD, ShutdownGuard
from gateway.serving.request_head import SEND_STALLED

JSON = {"content-type": "application/json"}


CHAT_DIALECT = dialect_for(CHAT)


def scope(method: str = "POST", **extra: Any) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/v1/chat/completions", **extra}


def test_a_well_formed_head_passes() -> None:
    check_head(scope(), {**JSON, "content-length": "100"}, 100, json_only=True)
    check_head(scope(), {"content-type": "application/vnd.api+json", "content-encoding": "identity"}, 100, True)
    check_head(scope(), {"content-type": "text/plain"}, 100, json_only=False)  # auth on: keys guard the origin
    check_head(scope(), {}, 100, json_only=True)  # no type and no Origin: curl-like, not a browser


@pytest.mark.parametrize(("request_scope", "headers", "json_only", "error", "status"), [
    (scope("GET"), JSON, True, MethodNotAllowed, 405),
    (scope(), {**JSON, "content-length": "101"}, True, PayloadTooLarge, 413),
    (scope(), {"content-type": "text/plain"}, True, UnsupportedMediaType, 415),
    (scope(), {"origin": "https://evil.example"}, True, UnsupportedMediaType, 415),
    (scope(), {**JSON, "content-encoding": "gzip"}, True, UnsupportedMediaType, 415),
    # the auth middleware's refusal comes first, even for a GET
    (scope("GET", **{AUTH_ERROR: InvalidApiKey("Incorrect API key provided.")}), JSON, False, InvalidApiKey, 401),
])
def test_a_bad_head_is_refused_before_the_body(request_scope: dict[str, Any], headers: dict[str, str],
                                               json_only: bool, error: type[GatewayError], status: int) -> None:
    with pytest.raises(error) as caught:
        check_head(request_scope, headers, 100, json_only)
    assert caught.value.status == status


def test_method_not_allowed_names_the_allowed_method() -> None:
    with pytest.raises(MethodNotAllowed) as caught:
        check_head(scope("PUT"), JSON, 100, True)
    assert caught.value.headers == {"allow": "POST", "x-should-retry": "false"}  # retrying cannot help


def ledger(metrics: GatewayMetrics | None = None) -> Ledger:
    """A chat request's ledger in pool `small` whose answer started (status 200)."""
    config = parse_config({"pools": [{"name": "small", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"]}]}, environ={})
    book = Ledger("chat", "r", None, metrics or GatewayMetrics(), WorkerRegistry(config))
    book.record.pool, book.record.status = "small", 200
    return book


def test_a_hang_up_is_told_by_its_stage() -> None:
    before, during = ledger(), ledger()
    hung_up(scope(), before, response_started=False)
    hung_up(scope(), during, response_started=True)
    assert (before.record.outcome, before.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT,
                                                                       "before_response")
    assert (during.record.outcome, during.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT, "mid_stream")


def test_a_stalled_reader_is_counted_per_pool() -> None:
    metrics = GatewayMetrics()
    stalled = ledger(metrics)
    hung_up(scope(**{SEND_STALLED: True}), stalled, response_started=True)
    assert (stalled.record.outcome, stalled.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT,
                                                                         "send_stalled")
    assert metrics.registry.get_sample_value("kimi_gateway_client_send_stalls_total", {"pool": "small"}) == 1


def test_the_end_of_the_grace_period_is_a_shutdown_not_a_hang_up() -> None:
    guard = ShutdownGuard(app=None)  # type: ignore[arg-type]  # only its flag is read here
    quiet = ledger()
    hung_up(scope(**{SHUTDOWN_GUARD: guard}), quiet, response_started=False)
    assert quiet.record.outcome is RequestOutcome.CLIENT_DISCONNECT  # the guard has not hung up: the client did
    guard.hang_up()
    cut, streaming = ledger(), ledger()
    hung_up(scope(**{SHUTDOWN_GUARD: guard, SEND_STALLED: True}), cut, response_started=False)
    hung_up(scope(**{SHUTDOWN_GUARD: guard}), streaming, response_started=True)
    assert (cut.record.outcome, cut.record.status, cut.record.disconnect_stage) == (RequestOutcome.SHUTTING_DOWN,
                                                                                    503, None)
    assert (streaming.record.outcome, streaming.record.status) == (RequestOutcome.SHUTTING_DOWN, 200)


# -- reading the body ---------------------------------------------------------------------------------

def receiver(*messages: dict[str, Any], then_wait: bool = True) -> Any:
    """An ASGI `receive` giving `messages`, then waiting forever (`then_wait`) or disconnecting."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


@pytest.mark.anyio
async def test_read_body_joins_its_chunks_and_refuses_one_over_the_limit() -> None:
    body = await read_body(receiver({"type": "http.request", "body": b"ab", "more_body": True},
                                    {"type": "http.request", "body": b"cd"}), 10, 1.0)
    assert body == b"abcd"
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver({"type": "http.request", "body": b"x" * 11}), 10, 1.0)


@pytest.mark.anyio
async def test_read_body_notices_a_hang_up_a_stall_and_a_trickle() -> None:
    with pytest.raises(ClientGone):
        await read_body(receiver({"type": "http.disconnect"}), 10, 1.0)
    with pytest.raises(RequestBodyTimeout, match="stalled"):
        await read_body(receiver({"type": "http.request", "body": b"a", "more_body": True}), 10, 0.02)
    trickle = [{"type": "http.request", "body": b"a", "more_body": True}] * 1000

    async def slow() -> dict[str, Any]:
        await asyncio.sleep(0.005)
        return trickle.pop()

    with pytest.raises(RequestBodyTimeout, match="too slowly"):
        await read_body(slow, 10_000, 1.0, base_s=0.05, min_rate=1000.0)


def test_request_id_of_keeps_a_short_printable_id_only() -> None:
    assert request_id_of({"x-request-id": "abc-123"}) == "abc-123"
    for bad in ("", "x" * 129, "caf\u00e9", "a\nb"):
        made = request_id_of({"x-request-id": bad})
        assert made != bad and len(made) == 32
    assert request_id_of({}) != request_id_of({})


def test_the_start_message_marks_a_stream_uncached_and_a_buffered_answer_by_its_length() -> None:
    buffered = start_message(CHAT_DIALECT, 200, b"application/json", [(b"x-a", b"1")], "r", 5)
    assert buffered["headers"] == [(b"content-type", b"application/json"), (b"x-request-id", b"r"), (b"x-a", b"1"),
                                   (b"content-length", b"5")]
    streamed = start_message(CHAT_DIALECT, 200, b"text/event-stream", [], "r", None)
    assert (b"cache-control", b"no-cache") in streamed["headers"] and (b"x-accel-buffering", b"no") in \
        streamed["headers"]


# -- the relay ------------------------------------------------------------------------------------------

class Events:
    """A relayed stream (`RelayStream`) of `parts`, one every `gap` seconds."""

    def __init__(self, parts: list[bytes], gap: float = 0.0, sse: bool = True) -> None:
        self.parts = parts
        self.gap = gap
        self.sse = sse
        self.closed = 0

    async def body(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            if self.gap:
                await asyncio.sleep(self.gap)
            yield part

    async def aclose(self) -> None:
        self.closed += 1


class Sent:
    """An ASGI `send` keeping what went out; `broken` after that many messages raises OSError."""

    def __init__(self, broken: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.broken = broken

    async def __call__(self, message: dict[str, Any]) -> None:
        await asyncio.sleep(0)  # a real send may suspend: the cap may fire in it
        if self.broken is not None and len(self.messages) >= self.broken:
            raise OSError("client gone")
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def loop_time() -> float:
    return asyncio.get_running_loop().time()


@pytest.mark.anyio
async def test_the_relay_passes_the_streams_bytes_and_ends_it() -> None:
    book, sent, events = ledger(), Sent(), Events([b"data: 1\n\n", b"data: [DONE]\n\n"])
    answer = RelayResponse(events, b"text/event-stream", [(b"x-kimi-gateway-pool", b"small")])
    await relay(CHAT_DIALECT, answer, book, sent, None, None)
    assert sent.messages[0]["status"] == 200 and (b"x-request-id", b"r") in sent.messages[0]["headers"]
    assert sent.body == b"data: 1\n\ndata: [DONE]\n\n" and sent.messages[-1]["more_body"] is False
    assert book.record.outcome is RequestOutcome.OK


@pytest.mark.anyio
async def test_a_relay_past_the_cap_ends_with_one_error_event_and_counts_a_timeout() -> None:
    book, sent, events = ledger(), Sent(), Events([b"data: 1\n\n"] * 50, gap=0.01)
    await relay(CHAT_DIALECT, RelayResponse(events), book, sent, loop_time() + 0.05, 0.05)
    assert sent.body.startswith(b"data: 1\n\n") and b"request_timeout" in sent.body and b"[DONE]" not in sent.body
    assert book.record.outcome is RequestOutcome.TIMEOUT and book.record.status == 200 and events.closed >= 1
    assert "0.05 seconds" in (book.record.error or "")


@pytest.mark.anyio
async def test_a_relay_whose_cap_passed_before_it_started_answers_504() -> None:
    book, sent = ledger(), Sent()
    await relay(CHAT_DIALECT, RelayResponse(Events([b"data: 1\n\n"])), book, sent, loop_time() - 1.0, 3.0)
    assert sent.messages[0]["status"] == 504 and b"request_timeout" in sent.body
    assert (book.record.status, book.record.outcome) == (504, RequestOutcome.TIMEOUT)


@pytest.mark.anyio
async def test_a_client_the_server_says_is_gone_is_a_mid_stream_hang_up() -> None:
    book = ledger()
    await relay(CHAT_DIALECT, RelayResponse(Events([b"data: 1\n\n"] * 3)), book, Sent(broken=2), None, None)
    assert (book.record.outcome, book.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT, "mid_stream")


@pytest.mark.anyio
async def test_a_cancellation_is_the_clients_hang_up_only_when_the_watch_saw_it() -> None:
    async def handler(receive: Any, book: Ledger) -> bool:
        watch = watch_hang_up(receive)
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            return cancelled(watch, scope(), book, response_started=True)
        finally:
            await watch.stop()
        return False

    client = ledger()
    assert await asyncio.create_task(handler(receiver(then_wait=False), client)) is True
    assert client.record.disconnect_stage == "mid_stream"
    server = ledger()
    task = asyncio.create_task(handler(receiver(), server))
    await asyncio.sleep(0.01)
    task.cancel()  # the server's cancellation (uvicorn's graceful-shutdown timeout), not the client's
    assert await task is False
    assert (server.record.outcome, server.record.status) == (RequestOutcome.SHUTTING_DOWN, 200)
