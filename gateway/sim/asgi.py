"""Minimal ASGI plumbing for the simulator: body reading, replies, and client-disconnect racing.

Disconnects are noticed by listening on `receive()` (which yields `http.disconnect` when the client
goes away) rather than by waiting for `send()` to fail: uvicorn's `send()` silently drops data
after a disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

T = TypeVar("T")

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class ClientDisconnected(Exception):
    """The client went away before the response completed."""


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected while sending it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def lower_headers(scope: Scope) -> dict[str, str]:
    """Request headers as a dict with lowercase names (later duplicates win)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def send_bytes(send: Send, status: int, body: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A complete response with a fixed body."""
    all_headers = list(headers if headers is not None else JSON_HEADERS)
    all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, payload: Any) -> None:
    """A complete JSON response."""
    await send_bytes(send, status, orjson.dumps(payload))


class DisconnectWatch:
    """Listens on `receive()` in the background once the request body has been read.

    `run(coro)` races `coro` against the client's disconnect: if the client goes first, `coro` is
    cancelled and `ClientDisconnected` is raised. Use as an async context manager.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._gone = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def disconnected(self) -> bool:
        """Whether the client has gone."""
        return self._gone.is_set()

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._gone.set()
                return

    async def run(self, work: Awaitable[T]) -> T:
        """Await `work` unless the client disconnects first (then raise `ClientDisconnected`)."""
        if self._gone.is_set():
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientDisconnected
        task = asyncio.ensure_future(work)
        gone = asyncio.create_task(self._gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected

    async def sleep(self, seconds: float) -> None:
        """Sleep, unless the client disconnects first (then raise `ClientDisconnected`).

        A zero sleep still yields to the loop once, so a disconnect is noticed between tokens.
        """
        if seconds > 0:
            await self.run(asyncio.sleep(seconds))
            return
        await asyncio.sleep(0)
        if self._gone.is_set():
            raise ClientDisconnected

    async def until_disconnected(self) -> None:
        """Wait for the client to go away (used by the hang faults); always raises."""
        await self._gone.wait()
        raise ClientDisconnected
