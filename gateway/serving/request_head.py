"""Limits on a client's request head (request line + headers), which uvicorn does not set.

uvicorn's httptools protocol buffers a header of any size and waits for a head forever: a
client that sends `X-Big: ` and then 100 MiB, or opens connections and trickles half a request
line, holds gateway memory or a connection slot for as long as it likes, before auth ever runs.
`GuardedHttpToolsProtocol` adds the two limits nginx calls `large_client_header_buffers` and
`client_header_timeout`:

- more than `max_header_bytes` of head → 431 (RFC 6585) with an OpenAI error object, connection
  closed;
- no complete head within `timeouts.header` seconds of the connection opening or of the request's
  first byte → 408 (or a silent close when not one byte came), connection closed;
- a request httptools cannot parse → uvicorn's 400, with an OpenAI error object instead of text
  (after the answer to a whole request before it, as the 408/431 are).
- an upgrade offer the server does not take (`Upgrade: h2c`; a websocket offer on a method other
  than GET) → ignored, the request served over HTTP/1.1 with its body (uvicorn stopped parsing the
  connection at its head: an empty body, later requests never read);
- a websocket handshake (a GET offering `Upgrade: websocket`, RFC 6455 §4.1) → 403 with an OpenAI
  error object, connection closed: the gateway serves no websocket endpoint. Refused in its turn,
  after the answers to the requests pipelined before it, as the other refusals are (uvicorn
  switched the connection to its websocket protocol as soon as the handshake was parsed, so the
  requests before it were never answered and their answers failed on the closed transport).

The head is counted from the parser's callbacks (request target and header fields, plus a few
bytes per line for the separators) once it is complete, and by the raw bytes of each read while it
is still incomplete (in the read where it began, the bytes of the requests before it are taken
off), so the limit holds to within a few bytes per header line.

It also ends responses a client stopped reading (uvicorn waits for it for ever): when the
socket's buffers are full and `timeouts.send_stall` seconds pass with no byte taken by the client,
the connection is aborted. The app sees the client's disconnect (the proxy closes its upstream, so
the engine aborts the request) and finds `SEND_STALLED` set in its scope.

An idle keep-alive connection between requests is uvicorn's own `timeout_keep_alive`
(`timeouts.keep_alive`). Cost per request: one timer armed and cancelled, a few flag tests.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import GatewayConfig

SEND_STALLED = "kimi_gateway.send_stalled"
"""Scope key set (True) on the request whose connection was aborted because its client stopped
reading for `timeouts.send_stall` seconds."""

NOSNIFF = (b"x-content-type-options", b"nosniff")
"""On every answer (uvicorn's default headers): a browser must not read a JSON or SSE answer as
HTML or script (https://fetch.spec.whatwg.org/#x-content-type-options-header)."""

_LINE_OVERHEAD = 4  # ": " and CRLF around each header field
_REQUEST_LINE_OVERHEAD = 16  # method, spaces, "HTTP/1.1", CRLF, the blank line: at least this many


async def _head_too_large(scope: Any, receive: Any, send: Any) -> None:
    """ASGI answer for a complete head over the limit (its request never reaches the app)."""
    body = orjson.dumps({"error": {"message": scope["kimi_gateway.head_message"], "type": "invalid_request_error",
                                   "param": None, "code": "request_header_fields_too_large"}})
    await send({"type": "http.response.start", "status": 431,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head size limit (bytes) and a head time limit (seconds);
    `http_options` makes a subclass carrying a config's values."""

    max_header_bytes = 64 * 1024
    header_timeout = 10.0
    send_stall = 30.0
    linger_s = 1.0  # after a refusal, read and drop the client's bytes this long before closing

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._began_in_this_read = False
        self._pending: tuple[int, str, str] | None = None  # a refusal waiting for the response before it
        self._head_offset = 0  # estimated bytes of this read before the current head began
        self._read_consumed = 0  # estimated bytes of this read the parser gave to earlier requests
        self._send_timer: asyncio.TimerHandle | None = None
        self._stalled_at = 0  # write-buffer bytes when the client last showed progress
        self._upgrade_body: bytes | None = None  # framing headers of an ignored upgrade's body still to come
        self._reframing = False  # parsing `_ignore_upgrade`'s stand-in head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: drop what still comes
        self._began_in_this_read = False
        self._read_consumed = 0
        self._unset_keepalive_if_required()
        self._feed(data)
        # Still inside a head after the parser took these bytes. A head that began in an earlier
        # read owns all of them; one that began in this read owns what followed the requests before
        # it (their heads and bodies as the parser reported them).
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data) - (self._head_offset if self._began_in_this_read else 0)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(431, "request_header_fields_too_large",
                             f"The request line and headers are larger than {self.max_header_bytes} bytes.")

    def _feed(self, data: bytes) -> None:
        """uvicorn's `data_received` (parse; a parse error is `send_400_response`; a websocket
        handshake switches protocols), but an upgrade offer it does not take is ignored instead of
        ending the connection's parsing (`_ignore_upgrade`)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self._refuse(403, "websocket_not_supported",
                             "This server has no WebSocket endpoint; the handshake is refused.")
            else:
                self._ignore_upgrade(data[upgrade.args[0]:])

    def _should_upgrade(self) -> bool:
        """Whether the request is a websocket handshake: a GET (RFC 6455 §4.1) offering
        `Upgrade: websocket` (whatever websocket library is installed: the answer is the same). No
        request cycle is made for it (uvicorn's `on_headers_complete`); `_feed` refuses it. An
        offer on another method is ignored (`_ignore_upgrade`)."""
        return self.scope.get("method") == "GET" and self._get_upgrade() == b"websocket"

    def _ignore_upgrade(self, rest: bytes) -> None:
        """Serve a request that offered a protocol upgrade the server does not take (`Upgrade: h2c`
        from Java's HttpClient or `curl --http2`; RFC 9110 §7.8 lets a server ignore it) as plain
        HTTP/1.1, as nginx and the engines' h11 servers do. llhttp ends an upgrade request at its
        head and hands back the bytes after it (`rest`) as another protocol's; so a fresh parser
        takes over the connection, and a request whose head announced a body first reads a
        stand-in head with just its framing headers (`Content-Length` or `Transfer-Encoding`), whose
        callbacks are skipped, so the body goes to the request as if no upgrade had been offered."""
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's own
        framing, self._upgrade_body = self._upgrade_body, None
        if framing is not None:
            url, headers = self.url, self.headers  # the request's (`headers` is its scope's list)
            self.url, self.headers, self._reframing = b"", [], True
            try:
                self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n")
            except httptools.HttpParserError:  # the request's own head passed the same checks
                self.send_400_response("Invalid HTTP request received.")
                return
            finally:
                self._reframing = False
                self.url, self.headers = url, headers
        if rest:
            self._feed(rest)

    def on_message_begin(self) -> None:
        if self._reframing:
            return
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._began_in_this_read = True
        self._head_offset = self._read_consumed
        self._arm()

    def on_body(self, body: bytes) -> None:
        self._read_consumed += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._upgrade_body is None:  # else llhttp's end of an upgrade request: its body is still to come
            super().on_message_complete()

    def on_headers_complete(self) -> None:
        if self._reframing:
            return
        if self.parser.should_upgrade() and not self._should_upgrade():  # an offer `_ignore_upgrade` declines
            framing = b"".join(b"%s: %s\r\n" % (name, value) for name, value in self.headers
                               if name in (b"content-length", b"transfer-encoding"))
            if framing and framing != b"content-length: 0\r\n":
                self._upgrade_body = framing  # llhttp ends the request here: its body comes after
        self._in_head = False
        size = (len(self.url) + _REQUEST_LINE_OVERHEAD
                + sum(len(name) + len(value) + _LINE_OVERHEAD for name, value in self.headers))
        self._read_consumed += max(0, size - self._head_bytes)  # its part in earlier reads was theirs
        self._head_bytes = 0
        self._disarm()
        if size <= self.max_header_bytes:
            super().on_headers_complete()
            return
        # Whole in one read, so no read was counted: answer 431 in place of the app. uvicorn still
        # owns the request (its body is parsed and dropped, pipelining stays in order).
        self.scope["kimi_gateway.head_message"] = (
            f"The request line and headers are larger than {self.max_header_bytes} bytes.")
        app = self.app
        self.app = _head_too_large
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stalled_at = self.transport.get_write_buffer_size()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_stall, self._check_send)

    def resume_writing(self) -> None:
        self._stop_send_timer()
        super().resume_writing()

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _check_send(self) -> None:
        """`send_stall` seconds after writing paused (or after the last progress seen): abort the
        connection if the client has not taken a byte since."""
        self._send_timer = None
        if self.transport.is_closing() or not self.flow.write_paused:
            return
        size = self.transport.get_write_buffer_size()
        if size < self._stalled_at:  # slow, but reading
            self._stalled_at = size
            self._send_timer = self.loop.call_later(self.send_stall, self._check_send)
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope[SEND_STALLED] = True  # type: ignore[literal-required]
        self.transport.abort()  # close() would wait for the client to read the buffer

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

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (a garbage request line, a bad `Content-Length`, broken
        chunked framing): a 400 with an OpenAI error object instead of uvicorn's plain text, then the
        connection closes. Broken framing inside a body is answered at once; garbage after a whole
        request once that request's answer is complete. The app never sees the bad request."""
        message = f"The request is not valid HTTP/1.1 ({msg.rstrip('.')})."
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.more_body:
            # Broken framing inside the body being read (a bad chunk size): as uvicorn, answer and
            # close; the app reading it sees its client go.
            self.transport.write(self._refusal(400, "invalid_http_request", message))
            self.transport.close()
            return
        # Garbage after a whole request (pipelined, or arriving while its answer streams) is the next
        # request's: refused once the answer before it is complete, as a late or oversize head is.
        self._refuse(400, "invalid_http_request", message)

    def _refuse(self, status: int, code: str, message: str) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still being sent: stop reading, refuse after it.
            self._pending = (status, code, message)
            self._in_head = False  # decided: no head timer or size count may replace this refusal
            self._disarm()
            self.transport.pause_reading()
            return
        self._write_refusal(status, code, message)

    @staticmethod
    def _refusal(status: int, code: str, message: str) -> bytes:
        """A whole HTTP/1.1 answer with an OpenAI error object that closes the connection."""
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}})
        reason = {400: b"Bad Request", 403: b"Forbidden", 408: b"Request Timeout",
                  431: b"Request Header Fields Too Large"}[status]
        return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-content-type-options: nosniff\r\nconnection: close\r\n\r\n%s" % (status, reason, len(body), body))

    def _write_refusal(self, status: int, code: str, message: str) -> None:
        self.transport.write(self._refusal(status, code, message))
        self._disarm()
        self._refused = True
        # Closing with the client's bytes unread would send a TCP reset, which can destroy the
        # answer before the client reads it: end our side, drop what still comes, close later.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.linger_s, self.transport.close)


def http_options(config: GatewayConfig) -> dict[str, Any]:
    """uvicorn settings for a gateway server: the guarded protocol with this config's head limits
    (`max_header_bytes`, `timeouts.header`) and send stall (`timeouts.send_stall`), no websocket
    protocol (a handshake is refused by the guarded protocol), the idle keep-alive
    (`timeouts.keep_alive`), and `NOSNIFF` on every answer."""
    protocol = type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {
        "max_header_bytes": config.max_header_bytes, "header_timeout": config.timeouts.header,
        "send_stall": config.timeouts.send_stall})
    return {"http": protocol, "ws": "none", "timeout_keep_alive": config.timeouts.keep_alive,
            "headers": [(NOSNIFF[0].decode(), NOSNIFF[1].decode())]}
