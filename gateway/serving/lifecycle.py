"""Graceful shutdown for `kimi-gateway serve`: drain readiness, stop listening, let streams finish.

On the first SIGTERM (or SIGINT), with `shutdown:` from the config:

1. `on_drain()` runs at once: the gateway's `/ready` answers 503 (`"draining": true`). The listener
   stays open for `drain_delay` seconds and new requests are still served normally: the load
   balancer has not noticed yet, and refusing them would fail requests it still sends here.
2. uvicorn's shutdown: the listener closes (new connections are refused), idle keep-alive
   connections are closed, busy ones are closed once their response is complete.
3. In-flight requests may run for `grace_period` seconds more.
4. Then `ShutdownGuard.hang_up()`: every request still running is told its client disconnected,
   so the proxy does what it does for a client that hung up: cancels the work or the relay and
   closes the upstream response (the engine aborts the request). The guard ends the client's
   response properly: a 503 OpenAI error if nothing was sent yet, else one SSE error event and
   the end of the stream (no `data: [DONE]`).
5. The app's lifespan ends (AppState.stop closes the upstream client); the process exits 0.

Why not uvicorn's own `timeout_graceful_shutdown` cancellation for step 4: it cancels the ASGI
task only: a request still in prefill gets a text/plain 500 and every cut stream logs an
"Exception in ASGI application" traceback, where a hang-up gives the client a proper ending.
It remains as a backstop, `HANG_UP_BACKSTOP_S` after the hang-up.

A second signal skips what is left of the drain delay; a third stops waiting for in-flight
requests (uvicorn's force exit: no lifespan shutdown; the OS closes the connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType
from typing import Any

import uvicorn

from gateway.dialects.base import Dialect
from gateway.dialects.registry import dialect_for_path
from gateway.errors import NoCapacity
from gateway.serving.params import ShutdownConfig
from gateway.serving.server import uvicorn_config

log = logging.getLogger("gateway.serving.lifecycle")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HANG_UP_BACKSTOP_S = 2.0
"""Seconds after the hang-up before uvicorn cancels what is still running (e.g. a body upload)."""

SHUTDOWN_MESSAGE = "The gateway is shutting down"

SHUTDOWN_GUARD = "kimi_gateway.shutdown_guard"
"""Scope key of the `ShutdownGuard` a request runs under: the proxy asks it whether a hang-up was
the server's (`hung_up`) and records that as a shutdown, not as a client disconnect."""

REQUEST_ID = "kimi_gateway.request_id"
"""Scope key where the proxy leaves the request id, so the guard's own 503 carries it too."""
DISCONNECT: Message = {"type": "http.disconnect"}


class _ResponseWatch:
    """Wraps `send` to know whether the response started, ended, and is an SSE stream."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.sse = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                           for name, value in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


class ShutdownGuard:
    """ASGI middleware: at the end of the grace period, hang up on the requests still running.

    After `hang_up()`, a request that has read its whole body and waits for the client's
    disconnect (the proxy always does) receives `http.disconnect`. Once the app returns, an
    unfinished response is ended here: a 503 `shutting_down` error if nothing was sent, one SSE
    error event and the end of the body for a stream. A request still uploading its body is left
    to uvicorn's backstop cancellation (it has no upstream yet).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.hung_up = False
        self._waiting: set[asyncio.Task[Any]] = set()  # tasks inside a guarded receive() after the body
        self._told: set[asyncio.Task[Any]] = set()

    def hang_up(self) -> None:
        """Tell every in-flight request (and any later one) that its client disconnected: a task
        waiting in `receive()` is cancelled there and gets `http.disconnect` instead."""
        self.hung_up = True
        for task in self._waiting:
            self._told.add(task)
            task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _ResponseWatch(send)
        scope[SHUTDOWN_GUARD] = self
        await self.app(scope, self._guard(receive), response.send)
        if self.hung_up and not response.complete:
            with contextlib.suppress(OSError):  # the client may be gone for real
                await self._finish(response, scope.get(REQUEST_ID), dialect_for_path(scope.get("path", "")))

    def _guard(self, receive: Receive) -> Receive:
        body_done = False

        async def guarded() -> Message:
            nonlocal body_done
            if not body_done:  # body messages pass straight through: no extra tasks per chunk
                message = await receive()
                body_done = message["type"] != "http.request" or not message.get("more_body", False)
                return message
            if self.hung_up:
                return DISCONNECT
            # No task or future per request: hang_up() cancels the waiting task (told apart from
            # any other cancellation by `_told`).
            task = asyncio.current_task()
            assert task is not None
            self._waiting.add(task)
            try:
                return await receive()
            except asyncio.CancelledError:
                if task not in self._told:
                    raise
                self._told.discard(task)
                task.uncancel()
                return DISCONNECT
            finally:
                self._waiting.discard(task)

        return guarded

    @staticmethod
    async def _finish(response: _ResponseWatch, request_id: str | None, dialect: Dialect[Any]) -> None:
        """End an unfinished response in its API's shape (`dialect`'s, by its path: on Anthropic's
        endpoints the 503 is their 529 `overloaded_error`, as every answer there)."""
        if not response.started:
            error = NoCapacity(f"{SHUTDOWN_MESSAGE}; retry the request.", code="shutting_down")
            status, body = dialect.answer_status(error.status), dialect.error_bytes(error, request_id)
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]  # another replica can take it
            if request_id is not None:
                headers.append((b"x-request-id", request_id.encode()))
                if dialect.request_id_header is not None:
                    headers.append((dialect.request_id_header, request_id.encode()))
            headers.append((b"content-length", str(len(body)).encode()))
            await response.send({"type": "http.response.start", "status": status, "headers": headers})
            await response.send({"type": "http.response.body", "body": body, "more_body": False})
        elif response.sse:
            event = dialect.stream_error(f"{SHUTDOWN_MESSAGE}; the response is incomplete.", code="shutting_down")
            await response.send({"type": "http.response.body", "body": event, "more_body": True})
            await response.send({"type": "http.response.body", "body": b"", "more_body": False})
        # A started non-SSE body is left unfinished: uvicorn closes the connection, so the client
        # sees a cut response rather than a truncated one that looks whole.


GC_THRESHOLDS = (20_000, 20, 10)
"""Python's are (700, 10, 10). A loaded gateway allocates a lot of short-lived objects per request:
with the defaults a py-spy'd run spent ~14 % of its CPU in the collector, and its full (gen 2)
passes over the long-lived heap (imported libraries, a 200K-entry affinity store) paused the event
loop ~80 ms each; with these thresholds and `gc.freeze()` after start-up: ~0.7 %, 2 full passes
instead of 19 for 20K requests, and 14 % more requests/s (loadtest, c=64, 16 KiB streams)."""


def tune_gc() -> None:
    """Freeze what start-up built (imported modules, config) out of the collector's reach and raise
    its thresholds (`GC_THRESHOLDS`). For serving processes only (`serve`): it is process-wide."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class GracefulServer(uvicorn.Server):
    """A uvicorn server for `app` that shuts down in the order of this module's docstring.

    `on_drain` is called from the signal handler (keep it to attribute writes). Signals are
    handled in the main thread only (uvicorn's rule); elsewhere set `should_exit` to stop.
    """

    def __init__(self, app: ASGIApp, host: str, port: int, shutdown: ShutdownConfig,
                 on_drain: Callable[[], None], heartbeat: Callable[[], None] | None = None,
                 heartbeat_every: float = 1.0, **uvicorn_kwargs: Any) -> None:
        """`heartbeat` (optional) is called every `heartbeat_every` seconds from a task on the event
        loop for as long as the server runs: a supervisor that stops hearing it knows the loop is
        blocked or the process stopped (gateway/process/supervisor.py)."""
        self.guard = ShutdownGuard(app)
        self._heartbeat = heartbeat
        self._heartbeat_every = heartbeat_every
        self.shutdown_config = shutdown
        super().__init__(uvicorn_config(self.guard, host, port, **uvicorn_kwargs,
                                        timeout_graceful_shutdown=shutdown.grace_period + HANG_UP_BACKSTOP_S))
        self._on_drain = on_drain
        self.drain_deadline: float | None = None
        """`time.monotonic()` seconds at which the listener closes; None until a signal arrived."""
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not super().handle_exit: uvicorn records the signal and re-raises it once serve() has
        # returned, so a completed drain would still end the process by SIGTERM (status -15 / 143)
        # instead of a clean 0. Runs as a signal handler: attribute writes only, no logging.
        if self.drain_deadline is None and not self.should_exit:
            self.drain_deadline = time.monotonic() + self.shutdown_config.drain_delay
            self._on_drain()
        elif not self.should_exit:
            self.should_exit = True  # second signal: close the listener now
        else:
            self.force_exit = True  # third: stop waiting for in-flight requests

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        beating = asyncio.create_task(self._beat(), name="heartbeat") if self._heartbeat is not None else None
        try:
            await super().serve(sockets)
        finally:
            if beating is not None:
                beating.cancel()

    async def _beat(self) -> None:
        assert self._heartbeat is not None
        while True:
            self._heartbeat()
            await asyncio.sleep(self._heartbeat_every)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop ticks every 0.1 s: the drain delay is kept to that precision.
        if self.drain_deadline is not None and not self.should_exit:
            if not self._drain_logged:
                self._drain_logged = True
                log.info("shutdown: draining (/ready answers 503); the listener closes in %.1f s",
                         self.shutdown_config.drain_delay)
            if time.monotonic() >= self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.shutdown_config.grace_period
        log.info("shutdown: listener closing; in-flight requests have %.1f s", grace)
        timer = asyncio.get_running_loop().call_later(grace, self._hang_up)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _hang_up(self) -> None:
        running = len(self.server_state.tasks)
        if running:
            log.warning("shutdown: grace period over; ending %d request(s) still running", running)
        self.guard.hang_up()
