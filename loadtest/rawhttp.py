"""A cheap HTTP/1.1 load client on raw asyncio connections (uvloop + httptools), for overhead figures.

httpx spends a few hundred microseconds of Python per request; at thousands of requests a second
on one shared core that would measure the client, not the router. Here each connection is an
`asyncio.Protocol` whose response is parsed by httptools (C): per request the client does one
`writelines`, a few callbacks per received segment, and counts SSE events with `bytes.count`.

What one request reports (`Reply`): the status, the time to the first SSE `data:` bytes of the
body (streaming) or to the whole body (non-streaming), the time to the end, the number of SSE
data events other than `[DONE]`, and an error string (None when the answer was complete: 200, and
for a stream one ending in `data: [DONE]` with no `"error"` in it; for JSON a body with `"choices"`).
Connections are kept alive and reused; one that the server closes is reopened by `Connection.open`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass

import httptools

DONE_MARK = b"data: [DONE]"


@dataclass(slots=True)
class Reply:
    """One request as the client saw it. Times in nanoseconds from the start of the send."""

    status: int = 0
    first_ns: int | None = None
    total_ns: int | None = None
    events: int = 0
    error: str | None = None


class _Response(asyncio.Protocol):
    """The protocol of one connection; at most one request in flight (no pipelining)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[Reply] | None = None
        self.reply = Reply()
        self.started = 0
        self.stream = False
        self.tail = b""
        self.body: list[bytes] = []
        self.keep_alive = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP response: {exc}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail("connection closed" + (f": {exc}" if exc else ""))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.reply.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if not self.stream or reply.status != 200:
            self.body.append(body)
            return
        if reply.first_ns is None and b"data:" in body:
            reply.first_ns = time.perf_counter_ns() - self.started
        # Events end with a blank line; one may straddle two reads.
        reply.events += body.count(b"\n\n") + (1 if self.tail.endswith(b"\n") and body.startswith(b"\n") else 0)
        if b'"error"' in body:
            reply.error = "error event in the stream"
        self.tail = (self.tail + body)[-32:] if len(body) < 32 else body[-32:]

    def on_message_complete(self) -> None:
        reply = self.reply
        reply.total_ns = time.perf_counter_ns() - self.started
        if reply.status != 200:
            reply.error = f"HTTP {reply.status}: {b''.join(self.body)[:120]!r}"
        elif self.stream:
            if self.tail.rstrip().endswith(DONE_MARK):
                reply.events -= 1  # [DONE] is not a chunk
            elif reply.error is None:
                reply.error = "stream ended without data: [DONE]"
        else:
            body = b"".join(self.body)
            reply.first_ns = reply.total_ns
            reply.events = 1
            if b'"choices"' not in body:
                reply.error = f"not a completion: {body[:120]!r}"
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)
        if not self.keep_alive:
            self.close()

    # ours
    def _fail(self, why: str) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            self.reply.error = self.reply.error or why
            waiter.set_result(self.reply)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Connection:
    """One keep-alive HTTP/1.1 connection to `host:port`; `request()` sends and waits for the answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._proto: _Response | None = None

    @property
    def usable(self) -> bool:
        return self._proto is not None and not self._proto.closed

    async def open(self, timeout: float = 10.0) -> None:
        """(Re)connect; raises OSError or TimeoutError."""
        self.close()
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(loop.create_connection(_Response, self.host, self.port), timeout)
        sock = proto.transport.get_extra_info("socket") if proto.transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._proto = proto

    async def request(self, parts: list[bytes], stream: bool, timeout: float) -> Reply:
        """Send the request bytes `parts` (head and body, written at once) and wait for the answer.

        Never raises for HTTP or connection failures: they come back in `Reply.error`. A timed-out
        request closes the connection (its answer could still arrive on it).
        """
        if not self.usable:
            try:
                await self.open()
            except (OSError, TimeoutError) as exc:
                return Reply(error=f"connect failed: {type(exc).__name__}: {exc}")
        proto = self._proto
        assert proto is not None and proto.transport is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Reply] = loop.create_future()
        proto.waiter, proto.reply, proto.stream = waiter, Reply(), stream
        proto.tail, proto.body = b"", []
        proto.started = time.perf_counter_ns()
        proto.transport.writelines(parts)
        timer = loop.call_later(timeout, proto._fail, f"timeout after {timeout:g} s")
        try:
            reply = await waiter
        finally:
            timer.cancel()
        if reply.error is not None and reply.total_ns is None:
            proto.close()
        return reply

    def close(self) -> None:
        if self._proto is not None:
            self._proto.close()
            self._proto = None


def request_head(host: str, port: int, path: str, content_length: int, bearer: str) -> bytes:
    """The head of a JSON POST (keep-alive is HTTP/1.1's default)."""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"accept: */*\r\nauthorization: Bearer {bearer}\r\ncontent-length: {content_length}\r\n\r\n").encode()
