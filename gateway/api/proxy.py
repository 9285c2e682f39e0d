"""The proxied endpoints as raw ASGI: read the body, race the work against client disconnect, send.

Why raw ASGI: the client may hang up while the engine is still prefilling (no byte to send yet)
or between two tokens; a watcher on `receive()` notices `http.disconnect` at any stage and
cancels the work or the relay, which closes the upstream request so the engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.auth.middleware import principal_of
from gateway.errors import GatewayError, MethodNotAllowed, PayloadTooLarge, RequestTimeout
from gateway.metrics import NO_POOL
from gateway.protocol.sse import sse_error_event
from gateway.record import RequestRecord
from gateway.routing.features import Api
from gateway.service import BufferedResponse, ProxyService, RelayResponse

log = logging.getLogger("gateway.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected while we were still reading its body."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; PayloadTooLarge (413) beyond `limit` bytes, ClientGone on disconnect."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _request_id(headers: dict[str, str]) -> str:
    incoming = headers.get("x-request-id", "")
    if 0 < len(incoming) <= 128 and incoming.isprintable() and incoming.isascii():
        return incoming
    return uuid.uuid4().hex


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (event-loop time), None without one."""
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


def _over_cap_message(total: float | None) -> str:
    return f"The request exceeded the gateway's overall time limit of {total:g} seconds."


class ProxyEndpoint:
    """ASGI app for `POST /v1/chat/completions` or `POST /v1/completions`."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service: ProxyService = scope["state"]["service"]
        state = service.state
        total = state.config.timeouts.total
        deadline = None if total is None else asyncio.get_running_loop().time() + total
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        principal = principal_of(scope)  # set by the auth middleware when auth is on
        record = RequestRecord(request_id=_request_id(headers), api=self.api,
                               key=principal.name if principal is not None else None)
        result: BufferedResponse | RelayResponse | None = None
        watcher: asyncio.Task[None] | None = None
        work: asyncio.Task[BufferedResponse | RelayResponse] | None = None
        try:
            try:
                if scope["method"] != "POST":
                    raise MethodNotAllowed(f"Use POST for {scope['path']}.")
                declared = headers.get("content-length", "")
                if declared.isdigit() and int(declared) > state.config.max_body_bytes:
                    raise PayloadTooLarge(
                        f"The request body is larger than the limit of {state.config.max_body_bytes} bytes.")
                body = await read_body(receive, state.config.max_body_bytes)
                watcher = asyncio.ensure_future(wait_for_disconnect(receive))
                work = asyncio.ensure_future(service.handle(self.api, body, headers, record, principal))
                await asyncio.wait((work, watcher), timeout=_remaining(deadline),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not work.done() and not watcher.done():  # over the overall cap: abort the work
                    await _cancel(work)
                    if work.done() and not work.cancelled() and work.exception() is None:
                        late = work.result()
                        if isinstance(late, RelayResponse):
                            await late.stream.aclose()
                    record.outcome = "timeout"
                    raise RequestTimeout(_over_cap_message(total))
                if watcher.done():
                    await _cancel(work)
                    if work.done() and not work.cancelled() and work.exception() is None:
                        result = work.result()  # accepted just as the client left: closed below
                    record.client_gone("before_response")
                    return
                result = work.result()
            except ClientGone:
                record.client_gone("before_response")
                return
            except GatewayError as exc:
                result = self._error(exc, record)
            except Exception as exc:  # a bug: answer 500 as an OpenAI error, keep serving
                log.exception("request %s failed", record.request_id)
                result = self._error(GatewayError(f"Internal gateway error ({type(exc).__name__})."), record)
            if isinstance(result, RelayResponse):
                await self._relay(result, record, send, watcher, deadline, total)
            else:
                await self._send_buffered(result, record, send)
        finally:
            # Also when this handler itself is cancelled (server shutdown): asyncio.wait does not
            # pass a cancellation on, so the work task is cancelled here and its upstream closed.
            if work is not None and not work.done():
                await _cancel(work)
            if (result is None and work is not None and work.done() and not work.cancelled()
                    and work.exception() is None):
                result = work.result()
            if watcher is not None:
                await _cancel(watcher)
            if isinstance(result, RelayResponse):
                await result.stream.aclose()
            record.finish(state.metrics)

    @staticmethod
    def _error(exc: GatewayError, record: RequestRecord) -> BufferedResponse:
        record.status = exc.status
        record.error = exc.message
        if record.outcome == "ok":
            record.outcome = "error"
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        if record.pool != NO_POOL:
            extra.append((b"x-kimi-gateway-pool", record.pool.encode()))
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
        record.status = result.status
        if result.status >= 400 and record.outcome == "ok":
            record.outcome = "error"
        with contextlib.suppress(OSError):
            await send(self._start(result.status, result.content_type, result.headers, record, len(result.body)))
            await send({"type": "http.response.body", "body": result.body, "more_body": False})

    async def _relay(self, result: RelayResponse, record: RequestRecord, send: Send,
                     watcher: asyncio.Task[None] | None, deadline: float | None, total: float | None) -> None:
        """Pump upstream bytes to the client until the end, the client disconnects or the overall
        cap (`deadline`, event-loop time) passes."""
        started: list[bool] = []

        async def pump() -> None:
            body = result.stream.body()
            try:
                await send(self._start(200, result.content_type, result.headers, record, None))
                started.append(True)
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await body.aclose()

        pumping = asyncio.ensure_future(pump())
        waiting = {pumping} if watcher is None else {pumping, watcher}
        timed_out = False
        try:
            done, _ = await asyncio.wait(waiting, timeout=_remaining(deadline), return_when=asyncio.FIRST_COMPLETED)
            timed_out = not done
        finally:
            if not pumping.done() and not timed_out and not (watcher is not None and watcher.done()):
                await _cancel(pumping)  # this handler was cancelled: stop relaying
        if timed_out:
            await self._cut_at_cap(pumping, result, record, send, bool(started), _over_cap_message(total))
            return
        if not pumping.done():
            await _cancel(pumping)
            record.client_gone("mid_stream")
        elif pumping.exception() is not None:
            if isinstance(pumping.exception(), OSError):  # the server says the client is gone
                record.client_gone("mid_stream")
            else:
                raise pumping.exception()  # type: ignore[misc]

    async def _cut_at_cap(self, pumping: asyncio.Task[None], result: RelayResponse, record: RequestRecord,
                          send: Send, started: bool, message: str) -> None:
        """End a relay that ran past the overall cap: the upstream is closed (the engine aborts the
        request); the client gets one SSE error event and no `[DONE]` (a 504 if nothing was sent yet).
        The relay only yields whole events, so the error never lands inside one."""
        await _cancel(pumping)
        await result.stream.aclose()
        record.outcome = "timeout"
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
                tail = sse_error_event(message + " The response is incomplete.", code="request_timeout")
            await send({"type": "http.response.body", "body": tail, "more_body": False})
