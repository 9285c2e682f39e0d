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

from gateway.auth.middleware import AUTH_ERROR, principal_of
from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.service import ProxyService
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestBodyTimeout,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.lifecycle import REQUEST_ID, SHUTDOWN_GUARD
from gateway.metrics import NO_POOL, GatewayMetrics
from gateway.parsing import Body, body_of
from gateway.protocol.sse import sse_error_event
from gateway.record import RequestOutcome, RequestRecord
from gateway.request_head import SEND_STALLED
from gateway.routing.features import Api

log = logging.getLogger("gateway.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


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


def hung_up(scope: Scope, record: RequestRecord, metrics: GatewayMetrics, response_started: bool) -> None:
    """Account for a request whose connection ended under it: cut at the end of the shutdown grace
    period (the shutdown guard answers the client), aborted because the client stopped reading
    (`send_stalled`, counted per pool), or the client hung up before or during the response."""
    guard = scope.get(SHUTDOWN_GUARD)
    if guard is not None and guard.hung_up:  # the grace period ended: the guard answers the client
        record.cut_by_shutdown(response_started=response_started)
    elif scope.get(SEND_STALLED):  # the client stopped reading: its connection was aborted
        record.client_gone("send_stalled")
        metrics.client_send_stalls.labels(record.pool).inc()
    else:
        record.client_gone("mid_stream" if response_started else "before_response")


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


class ProxyEndpoint:
    """ASGI app for `POST /v1/chat/completions`, `POST /v1/completions` or `POST /v1/responses`."""

    records_auth_errors = True  # the auth middleware hands refusals here (`AUTH_ERROR`) to be recorded

    def __init__(self, api: Api) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request, in steps: check its head (`check_head`), read its body within the overall cap,
        route and proxy it (`ProxyService.handle`) while a watcher notices a hang-up, answer (relay a
        stream or send a buffered answer or error), and account for it (`RequestRecord.finish`)."""
        service: ProxyService = scope["state"]["service"]
        state = service.state
        total = state.config.timeouts.total
        deadline = None if total is None else asyncio.get_running_loop().time() + total
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        principal = principal_of(scope)  # set by the auth middleware when auth is on
        record = RequestRecord(request_id=request_id_of(headers), api=self.api,
                               key=principal.name if principal is not None else None)
        scope[REQUEST_ID] = record.request_id  # for a 503 the shutdown guard may have to send
        if state.tracing is not None:
            record.trace = state.tracing.begin(record, headers)
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
                    record.outcome = RequestOutcome.TIMEOUT
                    raise RequestBodyTimeout(f"The request body did not arrive within the gateway's overall time "
                                             f"limit of {total:g} seconds.") from None
                watch = _HangUpWatch(receive)
                cap = _cap(deadline)
                try:
                    async with cap:
                        result = await service.handle(self.api, body, headers, record, principal)
                except TimeoutError:
                    if not _expired(cap):
                        raise
                    record.outcome = RequestOutcome.TIMEOUT  # over the cap; the work's cleanup closed the upstream
                    service.attempt_cut_by_cap(record)
                    raise RequestTimeout(_over_cap_message(total)) from None
            except ClientGone:
                record.client_gone("before_response")
                return
            except GatewayError as exc:
                result = self._error(exc, record)
            except Exception as exc:  # a bug: answer 500 as an OpenAI error, keep serving
                log.exception("request %s failed", record.request_id)
                result = self._error(GatewayError(f"Internal gateway error ({type(exc).__name__})."), record)
            if isinstance(result, RelayResponse):
                await self._relay(result, record, send, deadline, total)
            else:
                await self._send_buffered(result, record, send)
        except asyncio.CancelledError:
            if watch is None or not watch.absorb():
                # Not the client: the server cancelled the request (uvicorn's `timeout_graceful_shutdown`
                # ran out on a server without serve's ShutdownGuard: the demo, tests' ThreadedServer).
                # uvicorn answers 500 if nothing was sent, else closes the connection; the finally below
                # still closes the upstream (the engine aborts the request).
                record.cut_by_shutdown(response_started=isinstance(result, RelayResponse), status=500)
                raise
            hung_up(scope, record, state.metrics, response_started=isinstance(result, RelayResponse))
            service.attempt_cut_by_hang_up(record)
        finally:
            if watch is not None:
                await watch.stop()
            if isinstance(result, RelayResponse):
                await result.stream.aclose()
            record.finish(state.metrics)

    @staticmethod
    def _error(exc: GatewayError, record: RequestRecord) -> BufferedResponse:
        record.answered_with_error(exc.status)
        record.error = exc.message
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        if isinstance(exc, (RequestBodyTimeout, PayloadTooLarge)):
            # The rest of the body may still be on its way: close the connection after the answer, or
            # uvicorn keeps reading (and dropping) a trickled body for as long as it comes.
            extra.append((b"connection", b"close"))
        if record.pool != NO_POOL:
            extra.append((b"x-kimi-gateway-pool", record.pool.encode()))
        if record.worker is not None:  # e.g. the worker a 504 waited for
            extra.append((b"x-kimi-gateway-worker", record.worker.encode()))
        return BufferedResponse(exc.status, exc.to_bytes(), b"application/json", extra)

    @staticmethod
    def _start(status: int, content_type: bytes, extra: list[tuple[bytes, bytes]], record: RequestRecord,
               length: int | None) -> Message:
        headers = [(b"content-type", content_type), (b"x-request-id", record.request_id.encode()), *extra]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        else:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def _send_buffered(self, result: BufferedResponse, record: RequestRecord, send: Send) -> None:
        if result.status >= 400:
            record.answered_with_error(result.status)
        else:
            record.status = result.status
        with contextlib.suppress(OSError):
            await send(self._start(result.status, result.content_type, result.headers, record, len(result.body)))
            await send({"type": "http.response.body", "body": result.body, "more_body": False})

    async def _relay(self, result: RelayResponse, record: RequestRecord, send: Send, deadline: float | None,
                     total: float | None) -> None:
        """Pump upstream bytes to the client until the end, or until the overall cap (`deadline`,
        event-loop time) passes. A client hang-up arrives as a cancellation (`_HangUpWatch`)."""
        body = result.stream.body()
        started = False
        cap = _cap(deadline)
        try:
            async with cap:
                await send(self._start(200, result.content_type, result.headers, record, None))
                started = True
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            if not _expired(cap):
                raise
            await self._cut_at_cap(result, record, send, started, _over_cap_message(total))
        except OSError:  # the server says the client is gone
            record.client_gone("mid_stream")
        finally:
            await body.aclose()

    async def _cut_at_cap(self, result: RelayResponse, record: RequestRecord, send: Send, started: bool,
                          message: str) -> None:
        """End a relay that ran past the overall cap: the upstream is closed (the engine aborts the
        request); the client gets one SSE error event and no `[DONE]` (a 504 if nothing was sent yet).
        The relay only yields whole events, so the error never lands inside one."""
        await result.stream.aclose()
        record.outcome = RequestOutcome.TIMEOUT
        record.error = message
        with contextlib.suppress(OSError):
            if not started:
                record.status = RequestTimeout.status
                error = RequestTimeout(message)
                await send(self._start(error.status, b"application/json", [], record, len(error.to_bytes())))
                await send({"type": "http.response.body", "body": error.to_bytes(), "more_body": False})
                return
            tail = b""
            if result.stream.sse:
                tail = sse_error_event(message + " The response is incomplete.", code="request_timeout",
                                       api=record.api)
            await send({"type": "http.response.body", "body": tail, "more_body": False})
