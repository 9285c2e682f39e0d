"""The proxied endpoints as raw ASGI: read the body, do the work, relay, and stop at a hang-up.

Why raw ASGI: the client may hang up while the engine is still prefilling (no byte to send yet)
or between two tokens; a watcher on `receive()` notices `http.disconnect` at any stage and
cancels the handler, which closes the upstream request so the engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.api.heartbeat import Heartbeat, heartbeat
from gateway.auth.middleware import AUTH_ERROR, principal_of
from gateway.dialects.base import Dialect
from gateway.dialects.names import Api
from gateway.dialects.registry import dialect_for
from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.service import ProxyService
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestBodyTimeout,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.observability.metrics import NO_POOL
from gateway.parsing import Body, body_of
from gateway.serving.lifecycle import REQUEST_ID, SHUTDOWN_GUARD
from gateway.serving.request_head import SEND_STALLED

log = logging.getLogger("gateway.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SEND_PIECE = 1 << 20
"""The most bytes of a relayed stream handed to the server in one `send`: a longer chunk (one large
event, held whole until its end) goes out in pieces of this size, each after the one before has
drained (uvicorn waits for its transport below its high-water mark before writing), so the server
never holds another copy of a whole large event."""


class ClientGone(Exception):
    """The client disconnected while we were still reading its body."""


async def read_body(receive: Receive, limit: int, idle_s: float, base_s: float = math.inf,
                    min_rate: float = math.inf, join_max: int = 2**62) -> Body:
    """The whole request body; PayloadTooLarge (413) beyond `limit` bytes, ClientGone on disconnect,
    RequestBodyTimeout (408) when `idle_s` seconds pass without a byte of it (a stalled upload would
    otherwise hold its connection for good), or when it is still incomplete `base_s` seconds plus one
    second per `min_rate` bytes received after the first read began (a body trickled a byte at a
    time, each gap under `idle_s`; Apache's mod_reqtimeout `body=...,MinRate=...` in one deadline).
    Over `join_max` bytes its chunks are not joined (`parsing.body_of`)."""
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        left = start + base_s + size / min_rate - loop.time()
        try:
            async with asyncio.timeout(min(idle_s, left)):
                message = await receive()
        except TimeoutError:
            if left < idle_s:
                raise RequestBodyTimeout(
                    f"The request body arrived too slowly: {size} bytes in {loop.time() - start:.1f} seconds (it "
                    f"may take {base_s:g} seconds plus one per {min_rate:g} bytes).") from None
            raise RequestBodyTimeout(f"The request body stalled: no byte of it for {idle_s:g} seconds "
                                     f"({size} bytes received).") from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return body_of(chunks, size, join_max)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def request_id_of(headers: dict[str, str]) -> str:
    """The client's `x-request-id` when it is short printable ASCII (up to 128 characters), else a new uuid4 hex."""
    incoming = headers.get("x-request-id", "")
    if 0 < len(incoming) <= 128 and incoming.isprintable() and incoming.isascii():
        return incoming
    return uuid.uuid4().hex


def _require_json_content_type(headers: dict[str, str]) -> None:
    """With auth off, refuse (415) a body a browser may post from any site without a CORS preflight:
    `text/plain`, form types, or none at all from a page (an `Origin` header). JSON is not a "simple"
    type (Fetch standard, CORS-safelisted request-header), so a foreign page cannot send it unasked.
    The SDKs send JSON; curl needs `-H 'Content-Type: application/json'` (its `-d` says form)."""
    declared = headers.get("content-type")
    if declared is None:
        if "origin" not in headers:
            return
        media = ""
    else:
        media = declared.partition(";")[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return
    raise UnsupportedMediaType(f"Send the request body as JSON with 'Content-Type: application/json' (got "
                               f"{media[:60] or 'none'!r}).", param="content-type")


_NO_CAP = contextlib.nullcontext()
"""The overall cap's stand-in when `timeouts.total` is unset (the default): entering it costs two
calls, an `asyncio.timeout_at(None)` about six."""


def _cap(deadline: float | None) -> asyncio.Timeout | contextlib.nullcontext[None]:
    """The overall cap as an async context: `asyncio.timeout_at(deadline)`, or `_NO_CAP` without one."""
    return _NO_CAP if deadline is None else asyncio.timeout_at(deadline)


def _expired(cap: asyncio.Timeout | contextlib.nullcontext[None]) -> bool:
    """True when a TimeoutError came from the overall cap itself (not from the work under it)."""
    return isinstance(cap, asyncio.Timeout) and cap.expired()


def _over_cap_message(total: float | None) -> str:
    return f"The request exceeded the gateway's overall time limit of {total:g} seconds."


def check_head(scope: Scope, headers: dict[str, str], max_body_bytes: int, json_only: bool) -> None:
    """Refuse a request from its head alone, before a byte of its body is read: the auth
    middleware's refusal (`AUTH_ERROR`: 401/403/429), a method other than POST (405), a declared
    `content-length` over `max_body_bytes` (413), a body type a foreign page may post unasked
    (415, `json_only`: auth off), or a content coding the gateway does not decode (415).
    Raises the GatewayError to answer; returns None for a request to read on."""
    if (refused := scope.get(AUTH_ERROR)) is not None:
        raise refused
    if scope["method"] != "POST":
        raise MethodNotAllowed(f"Use POST for {scope['path']}.", headers={"allow": "POST"})
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise PayloadTooLarge(f"The request body is larger than the limit of {max_body_bytes} bytes.")
    if json_only:
        _require_json_content_type(headers)
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):  # RFC 9110 15.5.16: 415 for a content coding we lack
        raise UnsupportedMediaType(f"Content-Encoding '{encoding[:40]}' is not supported; "
                                   f"send the JSON body uncompressed.")


def hung_up(scope: Scope, ledger: Ledger, response_started: bool) -> None:
    """Account for a request whose connection ended under it: cut at the end of the shutdown grace
    period (the shutdown guard answers the client), aborted because the client stopped reading
    (`send_stalled`, counted per pool), or the client hung up before or during the response."""
    guard = scope.get(SHUTDOWN_GUARD)
    if guard is not None and guard.hung_up:  # the grace period ended: the guard answers the client
        ledger.cut_by_shutdown(response_started=response_started)
    elif scope.get(SEND_STALLED):  # the client stopped reading: its connection was aborted
        ledger.send_stalled()
    else:
        ledger.client_gone("mid_stream" if response_started else "before_response")


class _HangUpWatch:
    """Cancels the request's own task when the client disconnects (after the body was read).

    The work and the relay run in the handler task itself (no task or `asyncio.wait` per
    request): the disconnect arrives as a cancellation at whatever the handler awaits, whose
    `finally` blocks close the upstream response, so the engine aborts the request.
    """

    __slots__ = ("_task", "_watcher", "gone")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._fired)

    def _fired(self, watcher: asyncio.Task[None]) -> None:
        if not watcher.cancelled() and watcher.exception() is None and self._task is not None:
            self.gone = True
            self._task.cancel()

    def absorb(self) -> bool:
        """After a CancelledError: True (and the cancellation is consumed) when it was the client
        hanging up; False when something else cancelled the handler (server shutdown)."""
        if self.gone and self._task is not None:
            self._task.uncancel()
            return True
        return False

    async def stop(self) -> None:
        """Cancel the watcher and wait for it to end (inline: no helper coroutine or context manager per request)."""
        watcher = self._watcher
        watcher.remove_done_callback(self._fired)
        watcher.cancel()
        try:  # noqa: SIM105 (contextlib.suppress is an object and two calls per request)
            await watcher
        except (asyncio.CancelledError, Exception):
            pass


def watch_hang_up(receive: Receive) -> _HangUpWatch:
    """Start watching for the client's hang-up once its body was read: it cancels the current task."""
    return _HangUpWatch(receive)


def cancelled(watch: _HangUpWatch | None, scope: Scope, ledger: Ledger, response_started: bool) -> bool:
    """Account for a cancelled request: True (the cancellation consumed) when the client hung up
    (`hung_up`); False, to re-raise, when the server cancelled it (uvicorn's `timeout_graceful_shutdown`
    ran out on a server without serve's ShutdownGuard: the demo, tests' ThreadedServer), recorded as
    cut by the shutdown with uvicorn's 500 (what it answers when nothing was sent yet)."""
    if watch is None or not watch.absorb():
        ledger.cut_by_shutdown(response_started=response_started, status=500)
        return False
    hung_up(scope, ledger, response_started=response_started)
    return True


class ProxyEndpoint:
    """ASGI app for one proxied API (`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`,
    `/v1/messages`, `/v1/messages/count_tokens`): every answer and error in that API's shape, rendered
    by its dialect (`Dialect.error_bytes`, `answer_status`, `request_id_header`, `stream_error`)."""

    records_auth_errors = True  # the auth middleware hands refusals here (`AUTH_ERROR`) to be recorded

    def __init__(self, api: Api) -> None:
        self.api = api
        self.dialect = dialect_for(api)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request, in steps: check its head (`check_head`), read its body within the overall cap,
        route and proxy it (`ProxyService.handle`) while a watcher notices a hang-up, answer (relay a
        stream or send a buffered answer or error), and account for it (its `Ledger`, `finish`)."""
        service: ProxyService = scope["state"]["service"]
        state = service.state
        total = state.config.timeouts.total
        deadline = None if total is None else asyncio.get_running_loop().time() + total
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        principal = principal_of(scope)  # set by the auth middleware when auth is on
        ledger = Ledger(self.api, request_id_of(headers), principal.name if principal is not None else None,
                        state.metrics, state.registry, state.tracing, headers)
        record = ledger.record
        scope[REQUEST_ID] = record.request_id  # for a 503 the shutdown guard may have to send
        result: BufferedResponse | RelayResponse | None = None
        watch: _HangUpWatch | None = None
        try:
            try:
                check_head(scope, headers, state.config.max_body_bytes, json_only=state.auth is None)
                try:
                    async with _cap(deadline):
                        timeouts = state.config.timeouts
                        body = await read_body(receive, state.config.max_body_bytes, timeouts.body_idle,
                                               timeouts.body_deadline, timeouts.body_min_rate,
                                               state.config.parse_offload_bytes)
                except TimeoutError:
                    ledger.timed_out()
                    raise RequestBodyTimeout(f"The request body did not arrive within the gateway's overall time "
                                             f"limit of {total:g} seconds.") from None
                watch = watch_hang_up(receive)
                cap = _cap(deadline)
                try:
                    async with cap:
                        result = await service.handle(self.api, body, headers, ledger, principal)
                except TimeoutError:
                    if not _expired(cap):
                        raise
                    ledger.cut_by_cap()  # over the cap; the work's cleanup closed the upstream
                    raise RequestTimeout(_over_cap_message(total)) from None
            except ClientGone:
                ledger.client_gone("before_response")
                return
            except GatewayError as exc:
                result = self._error(exc, ledger)
            except Exception as exc:  # a bug: answer 500 as an OpenAI error, keep serving
                log.exception("request %s failed", record.request_id)
                result = self._error(GatewayError(f"Internal gateway error ({type(exc).__name__})."), ledger)
            if isinstance(result, RelayResponse):
                await relay(self.dialect, result, ledger, send, deadline, total,
                            state.config.timeouts.keepalive_interval)
            else:
                await self._send_buffered(result, ledger, send)
        except asyncio.CancelledError:
            # Not the client: uvicorn answers 500 if nothing was sent, else closes the connection; the
            # finally below still closes the upstream (the engine aborts the request).
            if not cancelled(watch, scope, ledger, response_started=isinstance(result, RelayResponse)):
                raise
            service.attempt_cut_by_hang_up(ledger)
        finally:
            if watch is not None:
                await watch.stop()
            if isinstance(result, RelayResponse):
                await result.stream.aclose()
            ledger.finish()

    def _error(self, exc: GatewayError, ledger: Ledger) -> BufferedResponse:
        ledger.answered_with_error(exc.status, exc.message)
        record = ledger.record
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        if isinstance(exc, (RequestBodyTimeout, PayloadTooLarge)):
            # The rest of the body may still be on its way: close the connection after the answer, or
            # uvicorn keeps reading (and dropping) a trickled body for as long as it comes.
            extra.append((b"connection", b"close"))
        if record.pool != NO_POOL:
            extra.append((b"x-kimi-gateway-pool", record.pool.encode()))
        if record.worker is not None:  # e.g. the worker a 504 waited for
            extra.append((b"x-kimi-gateway-worker", record.worker.encode()))
        return BufferedResponse(exc.status, self.dialect.error_bytes(exc, record.request_id), b"application/json",
                                extra)

    async def _send_buffered(self, result: BufferedResponse, ledger: Ledger, send: Send) -> None:
        ledger.answered(result.status)
        with contextlib.suppress(OSError):
            await send(start_message(self.dialect, result.status, result.content_type, result.headers,
                                     ledger.record.request_id, len(result.body)))
            await send({"type": "http.response.body", "body": result.body, "more_body": False})


def start_message(dialect: Dialect, status: int, content_type: bytes, extra: list[tuple[bytes, bytes]],
                  request_id: str, length: int | None) -> Message:
    """The `http.response.start` message of an answer in `dialect`'s API: its status as that API
    names it (`Dialect.answer_status`), content type, `x-request-id` (and the API's own request-id
    header), `extra` headers and, for a buffered answer, its `length`; a stream (None) is marked
    not to be cached or buffered by proxies."""
    rid = request_id.encode()
    headers = [(b"content-type", content_type), (b"x-request-id", rid), *extra]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    else:
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    if (named := dialect.request_id_header) is not None:
        headers.append((named, rid))
    return {"type": "http.response.start", "status": dialect.answer_status(status), "headers": headers}


async def relay(dialect: Dialect, result: RelayResponse, ledger: Ledger, send: Send, deadline: float | None,
                total: float | None, heartbeat_s: float | None = None) -> None:
    """Pump an accepted stream's bytes to the client until its end, or until the overall cap
    (`deadline`, event-loop time; `total` seconds) passes (errors in `dialect`'s shape). A client hang-up arrives as a
    cancellation (`_HangUpWatch`); the server saying the client is gone (OSError) is recorded.
    An SSE stream silent for `heartbeat_s` seconds gets `dialect`'s heartbeat at an event boundary
    (gateway/api/heartbeat.py; None: none). The one relay of the proxied endpoints and of the
    stored-response replay."""
    body = result.stream.body()
    started = False
    beat: Heartbeat | None = None
    cap = _cap(deadline)
    try:
        async with cap:
            await send(start_message(dialect, 200, result.content_type, result.headers, ledger.record.request_id,
                                     None))
            started = True
            beat = heartbeat(send, dialect.heartbeat, heartbeat_s, result.stream.sse)
            async for chunk in body:
                if beat is not None:
                    if beat.beating is not None:
                        await beat.settle()
                    beat.passed(chunk)
                if len(chunk) > SEND_PIECE:
                    for at in range(0, len(chunk), SEND_PIECE):
                        await send({"type": "http.response.body", "body": chunk[at:at + SEND_PIECE],
                                    "more_body": True})
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if beat is not None:
                await beat.stop()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except TimeoutError:
        if not _expired(cap):
            raise
        if beat is not None:
            await beat.stop()
        await _cut_at_cap(dialect, result, ledger, send, started, _over_cap_message(total))
    except OSError:  # the server says the client is gone
        ledger.client_gone("mid_stream")
    finally:
        if beat is not None:
            beat.cancel()
        await body.aclose()


async def _cut_at_cap(dialect: Dialect, result: RelayResponse, ledger: Ledger, send: Send, started: bool,
                      message: str) -> None:
    """End a relay that ran past the overall cap: the upstream is closed (the engine aborts the
    request); the client gets one SSE error event and no `[DONE]` (a 504 if nothing was sent yet).
    The relay only yields whole events, so the error never lands inside one."""
    await result.stream.aclose()
    ledger.relay_cut_by_cap(message, started, RequestTimeout.status)
    with contextlib.suppress(OSError):
        if not started:
            error = RequestTimeout(message)
            body = dialect.error_bytes(error, ledger.record.request_id)
            await send(start_message(dialect, error.status, b"application/json", [], ledger.record.request_id,
                                     len(body)))
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        tail = b""
        if result.stream.sse:
            tail = dialect.stream_error(message + " The response is incomplete.", code="request_timeout")
        await send({"type": "http.response.body", "body": tail, "more_body": False})
