"""Limits on a client's request head (request line + headers), which uvicorn does not set.

uvicorn's httptools protocol buffers a header of any size and waits for a head forever: a
client that sends `X-Big: ` and then 100 MiB, or opens connections and trickles half a request
line, holds gateway memory or a connection slot for as long as it likes, before auth ever runs.
`GuardedHttpToolsProtocol` adds the two limits nginx calls `large_client_header_buffers` and
`client_header_timeout`:

- more than `max_header_bytes` of head → 431 (RFC 6585) with an OpenAI error object, connection
  closed;
- no complete head within `timeouts.header` seconds of the connection opening or of the request's
  first byte → 408 (or a silent close when not one byte came), connection closed.

An idle keep-alive connection between requests is uvicorn's own `timeout_keep_alive`
(`timeouts.keep_alive`). Cost per request: one timer armed and cancelled, one flag test per read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import GatewayConfig


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head size limit (bytes) and a head time limit (seconds);
    `http_options` makes a subclass carrying a config's values."""

    max_header_bytes = 64 * 1024
    header_timeout = 10.0
    linger_s = 1.0  # after a refusal, read and drop the client's bytes this long before closing

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._began_in_this_read = False
        self._pending: tuple[int, str, str] | None = None  # a refusal waiting for the response before it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: drop what still comes
        self._began_in_this_read = False
        super().data_received(data)
        # Still inside a head after the parser took these bytes. A head that began in an earlier
        # read owns all of them; one that began in this read owns an unknown tail (the rest was the
        # request before it), so counting starts with the next read: the limit is exact to a read.
        if self._in_head and not self._began_in_this_read and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(431, "request_header_fields_too_large",
                             f"The request line and headers are larger than {self.max_header_bytes} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._began_in_this_read = True
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._pending is not None and not self.transport.is_closing():
            self._refuse(*self._pending)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes == 0 and not getattr(self, "url", b""):  # not one byte of a request: just hang up
            self.transport.close()
            return
        self._refuse(408, "request_timeout",
                     f"The request line and headers did not arrive within {self.header_timeout:g} seconds.")

    def _refuse(self, status: int, code: str, message: str) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still being sent: stop reading, refuse after it.
            self._pending = (status, code, message)
            self.transport.pause_reading()
            return
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}})
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self._disarm()
        self._refused = True
        # Closing with the client's bytes unread would send a TCP reset, which can destroy the
        # answer before the client reads it: end our side, drop what still comes, close later.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.linger_s, self.transport.close)


def http_options(config: GatewayConfig) -> dict[str, Any]:
    """uvicorn settings for a gateway server: the guarded protocol with this config's head limits
    (`max_header_bytes`, `timeouts.header`) and the idle keep-alive (`timeouts.keep_alive`)."""
    protocol = type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {
        "max_header_bytes": config.max_header_bytes, "header_timeout": config.timeouts.header})
    return {"http": protocol, "timeout_keep_alive": config.timeouts.keep_alive}
