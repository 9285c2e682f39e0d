"""A minimal HTTP/1.1 client for generation requests (and the control GETs of
`backends/control.py`): asyncio protocols and httptools, keep-alive pools.

Why not aiohttp: measured side by side against the overhead benchmark's fast fake engine (64
streams of 32 SSE events, client alone, one core), aiohttp 3.14 spent 0.19-0.22 ms of CPU per
streamed request and this connection 0.075-0.08 ms: aiohttp runs ~8 Python calls per body
read (parser feed, stream buffer, flow control, timeout rescheduling), this one two (the parser's
`on_body` and the reader's wake-up). It does only what the relay needs: POST with a body (GET without), a response
after any 1xx interim ones (skipped), a body framed by chunked transfer coding, content-length or
the connection's end, keep-alive reuse (RFC 9112 §9), TLS for https workers. Bytes after an
answer's end close its connection (no pipelining: nobody asked for them). No transfer coding but
chunked, no redirects, proxies or cookies; content codings an engine applies although it was
asked for identity are undone above it (`backends/encoding.py`, through `backends/client.py`).

`H1Pool.post` returns an `H1Response` once the response head arrived. Its body is read with
`chunks()`; `aclose()` returns a fully read keep-alive connection to the pool and closes any other
(an engine sees the client leave and aborts the request). Reading pauses above `HIGH_WATER` bytes
buffered (a slow client slows its engine, not this process's memory). A read timeout counts only
while the engine is silent and the reader is waiting: a paused or busy reader never times out.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 128 * 1024  # bytes buffered before reading pauses (aiohttp's default high water mark)
MAX_HEAD_BYTES = 64 * 1024  # a longer response head is a protocol error (no engine sends one; it bounds memory)
# A pooled connection that ends without a response byte within this many seconds of the request
# is resent: an idle close crossing the request ends it within one round trip (plus loop lag).
# One that ends later may have carried a request the engine read and ran (then died): not resent.
RESEND_WINDOW_S = 1.0
_CONNECTING = "connecting"
_WAITING = "waiting for the response headers"


class H1Error(Exception):
    """A failed exchange with an engine: the connection, its framing or a timeout."""


class H1ConnectError(H1Error):
    """The connection was never made (refused, unreachable, TLS handshake failed, connect timeout)."""


class H1ConnectTimeout(H1ConnectError, TimeoutError):
    """No connection within the connect timeout."""


class H1Disconnected(H1Error):
    """The engine closed or reset the connection before the response ended."""


class H1ProtocolError(H1Error):
    """The engine's bytes are not a valid HTTP/1.1 response."""


class H1ReadTimeout(H1Error, TimeoutError):
    """No byte from the engine within the read timeout while the reader waited."""


class _Origin:
    """Where a URL's requests go: scheme, host, port, TLS context, the `Host` header; parsed once."""

    __slots__ = ("host", "host_header", "port", "ssl")

    def __init__(self, url: str, tls: ssl.SSLContext | None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url[:100]!r}")
        https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if https else 80)
        self.ssl = tls if https else None
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")


class H1Connection(asyncio.Protocol):
    """One HTTP/1.1 connection carrying one request at a time (no pipelining)."""

    def __init__(self, read_timeout: float) -> None:
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._read_timeout = read_timeout
        self.busy = False  # a request is in flight
        self.used = 0  # requests sent on it
        self.idle_since = 0.0
        self.sent_at = 0.0  # loop time of the last request's write
        self.lost_at = 0.0  # loop time the connection ended
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.header_list: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.interim = False  # parsing a 1xx interim answer (RFC 9110 §15.2): the final one follows
        self.got_bytes = False
        self.error: H1Error | None = None
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        if not self.busy or self.complete:  # bytes nobody asked for (idle, or after the answer): never reuse it
            self.close()
            return
        self.got_bytes = True
        buffered = self.buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:  # a callback's own error is its __context__
            if not self.complete:  # (after the answer's end: bytes nobody asked for; the answer stands)
                cause = exc.__context__
                self._fail(cause if isinstance(cause, H1ProtocolError)
                           else H1ProtocolError(f"invalid HTTP response from the engine: {exc}"))
            self.close()
        # httptools buffers a header line until its end: count every byte that brought no body, so
        # one endless line (or trailer, or 1xx after 1xx) is bounded too, not only whole lines.
        if self.buffered > buffered:
            self.head_bytes = 0
        elif not self.complete:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(H1ProtocolError(f"the engine's response head (or trailer section) is longer than "
                                           f"{MAX_HEAD_BYTES} bytes"))
                self.close()
        if self._waiter is not None and (self.chunks or self.complete or self.error is not None):
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.lost_at = self._loop.time()
        if self.busy and not self.complete:
            if self.status and not self._framed() and exc is None:  # a body delimited by the connection's (clean) end
                self.complete = True
            else:
                self._fail(H1Disconnected("the engine closed the connection" if exc is None else
                                          f"the connection failed: {type(exc).__name__}: {exc}"))
        self._cancel_timer()
        if self._waiter is not None:
            self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer in the same read: nobody asked for it (no pipelining)
            raise H1ProtocolError("bytes after the answer's end")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.status:  # (trailers, after the head, are dropped: nothing reads them)
            self.header_list.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 100 or status == 101:  # no upgrade was asked for
            raise H1ProtocolError(f"the engine answered with status {status} (no switch of protocols was asked)")
        if status < 200:  # 100 Continue, 103 Early Hints: skipped, as aiohttp did
            self.interim = True
            self.header_list.clear()
            return
        for name, value in self.header_list:  # only chunked is asked for (no TE header, RFC 9112 §7.4)
            if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
                raise H1ProtocolError(f"the engine's transfer coding {value[:40]!r} is not chunked")
        self.status = status
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()  # (llhttp forgets it once the message ended)

    # the request
    def _framed(self) -> bool:
        """The body's end is marked (chunked or content-length), so the connection's end is an error."""
        return any(name.lower() in (b"transfer-encoding", b"content-length") for name, _ in self.header_list)

    def _fail(self, error: H1Error) -> None:
        if self.error is None:
            self.error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self) -> None:
        self._last = self._loop.time()
        self._timer = self._loop.call_at(self._last + self._read_timeout, self._on_timer)

    def _on_timer(self) -> None:
        """Fail the exchange when the engine was silent for the read timeout while the reader
        waited for it (headers pending, or an empty buffer being waited on)."""
        self._timer = None
        if self.complete or self.error is not None or not self.busy:
            return
        now = self._loop.time()
        waiting = (self._head is not None and not self._head.done()) or (self._waiter is not None and not self.chunks)
        if not waiting:
            self._last = max(self._last, now)  # the reader is busy or paused: the engine is not late
        if waiting and now >= self._last + self._read_timeout:
            self._fail(H1ReadTimeout(f"no byte from the engine in {self._read_timeout:g}s"))
            self.close()
            self._wake()
            return
        self._timer = self._loop.call_at(self._last + self._read_timeout, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def set_read_timeout(self, seconds: float) -> None:
        """From now on fail the exchange after `seconds` of engine silence (counted from its last
        byte), e.g. the gap limit between tokens once a stream's first content arrived."""
        self._read_timeout = seconds
        if self._timer is not None:
            self._cancel_timer()
            self._timer = self._loop.call_at(self._last + seconds, self._on_timer)

    async def send(self, head: bytes, body: bytes, read_timeout: float) -> None:
        """Write one request and wait for its response head. Raises H1Error (the connection is closed)."""
        self._reset()
        self.busy = True
        self.used += 1
        self._read_timeout = read_timeout
        self._head = self._loop.create_future()
        assert self.transport is not None
        self.transport.writelines((head, body))
        self._arm()
        self.sent_at = self._last
        try:
            await self._head
        except BaseException:
            self.close()
            raise

    async def read(self) -> bytes:
        """The next body bytes (b"" at the end). Raises H1Error."""
        while True:
            if self.chunks:
                chunks = self.chunks
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                if len(chunks):
                    chunks.clear()
                self.buffered = 0
                if self._paused and self.transport is not None and not self.lost:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            if self.lost:
                raise H1Disconnected("the engine closed the connection")
            self._last = self._loop.time()  # silence counts from the later of the last byte and now
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def finished(self) -> bool:
        """The response was read to its end and the connection may carry another request."""
        self._cancel_timer()
        self.busy = False
        reusable = self.complete and self.keep_alive and self.error is None and not self.lost and not self.chunks
        if reusable:
            self.idle_since = time.monotonic()
            self._parser = httptools.HttpResponseParser(self)
        return reusable

    def close(self) -> None:
        self._cancel_timer()
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class H1Response:
    """An engine's answer once its head arrived: `status`, `headers` (lower-case names, repeated
    ones joined with ", "), the body by `read()`, `aclose()`."""

    __slots__ = ("_conn", "_pool", "_released", "headers", "status")

    def __init__(self, conn: H1Connection, pool: H1Pool) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False
        self.status = conn.status
        headers: dict[str, str] = {}
        for name, value in conn.header_list:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self.headers = headers

    def at_eof(self) -> bool:
        return self._conn.complete and not self._conn.chunks

    def read(self) -> Any:
        """An awaitable of the next body bytes (b"" at the end); raises H1Error."""
        return self._conn.read()

    def set_read_timeout(self, seconds: float) -> None:
        """The longest engine silence (seconds) from here on (`H1Connection.set_read_timeout`)."""
        self._conn.set_read_timeout(seconds)

    def aclose(self) -> None:
        """Return a fully read connection to the pool, close any other. Idempotent."""
        if not self._released:
            self._released = True
            self._pool.release(self._conn)


class H1Pool:
    """Keep-alive connections per origin (scheme, host, port), idle at most `keep_alive` seconds,
    most recently used first; no cap on connections (the engines' queues and the pool gates bound load)."""

    def __init__(self, keep_alive: float, tls: ssl.SSLContext | None = None,
                 resend_window: float = RESEND_WINDOW_S) -> None:
        self.keep_alive = keep_alive
        self.resend_window = resend_window
        self._tls = tls
        self._origins: dict[str, tuple[_Origin, bytes]] = {}
        self._idle: dict[tuple[str, int, bool], list[H1Connection]] = {}
        self._homes: dict[H1Connection, tuple[str, int, bool]] = {}

    def origin(self, url: str) -> tuple[_Origin, bytes]:
        """The origin of `url` and its request target (path and query), parsed once per URL."""
        known = self._origins.get(url)
        if known is None:
            if len(self._origins) > 4096:
                self._origins.clear()
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if self._tls is None and parts.scheme == "https":  # once: it parses the system's CA file (~30 ms)
                self._tls = ssl.create_default_context()
            known = self._origins[url] = (_Origin(url, self._tls), target.encode("ascii"))
        return known

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], connect_timeout: float,
                   read_timeout: float) -> H1Response:
        """POST `body` to `url` and return once the response head arrived. Raises H1Error.

        A request whose kept-alive connection ends before any response byte and within
        `resend_window` seconds (the engine had closed it: a reset, an end of stream crossing the
        request) is sent once more on a new connection: the engine never saw it (RFC 9112
        §9.3.1.1), and it is no sign of a broken worker. aiohttp resent at any delay, even after
        part of a head; a later end may follow a request the engine read, so it is raised."""
        return await self._exchange(b"POST", url, body, headers, connect_timeout, read_timeout, None)

    async def get(self, url: str, headers: Mapping[str, str], connect_timeout: float, read_timeout: float,
                  trace: Callable[[str], None] | None = None) -> H1Response:
        """GET `url` (no body, no `Content-Length`) and return once the response head arrived; as
        `post` otherwise. `trace(phase)` hears "connecting" before a new connection is made and
        "waiting for the response headers" once the request is written. Raises H1Error."""
        return await self._exchange(b"GET", url, b"", headers, connect_timeout, read_timeout, trace)

    async def _exchange(self, method: bytes, url: str, body: bytes, headers: Mapping[str, str],
                        connect_timeout: float, read_timeout: float,
                        trace: Callable[[str], None] | None) -> H1Response:
        origin, target = self.origin(url)
        head = _request_head(method, target, origin.host_header, headers, len(body))
        key = (origin.host, origin.port, origin.ssl is not None)
        conn = self._take(key)
        if conn is not None:
            if trace is not None:
                trace(_WAITING)
            try:
                await conn.send(head, body, read_timeout)
            except H1Disconnected:
                self._forget(conn)
                if conn.got_bytes or conn.lost_at - conn.sent_at > self.resend_window:
                    raise
            except BaseException:
                self._forget(conn)
                raise
            else:
                return H1Response(conn, self)
        if trace is not None:
            trace(_CONNECTING)
        conn = await self._connect(origin, connect_timeout, read_timeout)
        self._homes[conn] = key
        if trace is not None:
            trace(_WAITING)
        try:
            await conn.send(head, body, read_timeout)
        except BaseException:
            self._forget(conn)
            raise
        return H1Response(conn, self)

    def _take(self, key: tuple[str, int, bool]) -> H1Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = time.monotonic() - self.keep_alive
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.idle_since > oldest:
                return conn
            self._forget(conn)
        return None

    async def _connect(self, origin: _Origin, connect_timeout: float, read_timeout: float) -> H1Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(lambda: H1Connection(read_timeout), origin.host, origin.port,
                                                       ssl=origin.ssl)
        except TimeoutError:
            raise H1ConnectTimeout(f"no connection to {origin.host}:{origin.port} within {connect_timeout:g}s") \
                from None
        except (OSError, ssl.SSLError) as exc:
            raise H1ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return conn

    def release(self, conn: H1Connection) -> None:
        """After a response: keep its connection for reuse if it may carry another request, else close it."""
        if conn.finished():
            key = self._homes.get(conn)
            if key is not None:
                self._idle.setdefault(key, []).append(conn)
                return
        conn.close()
        self._forget(conn)

    def _forget(self, conn: H1Connection) -> None:
        conn.close()
        self._homes.pop(conn, None)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._homes.clear()


def _request_head(method: bytes, target: bytes, host: bytes, headers: Mapping[str, str], length: int) -> bytes:
    """The request line and headers (`Content-Length` unless a GET has no body, RFC 9110 §8.6).
    Raises ValueError for a header holding CR or LF (no injection)."""
    lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers.items():
        line = f"{name}: {value}\r\n"
        if "\n" in line[:-2] or "\r" in line[:-2]:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(line.encode("latin-1"))
    if length or method != b"GET":
        lines.append(b"accept-encoding: identity\r\ncontent-length: %d\r\n\r\n" % length)
    else:
        lines.append(b"accept-encoding: identity\r\n\r\n")
    return b"".join(lines)
