"""The engines' HTTP/1.1 client (gateway/backends/h1.py) against scripted servers on loopback:
body framings, keep-alive reuse, the resend after a dead pooled connection, broken and cut
answers, the read timeout, flow control and header injection."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from gateway.backends.h1 import (
    HIGH_WATER,
    H1ConnectError,
    H1Disconnected,
    H1Pool,
    H1ProtocolError,
    H1ReadTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
HEADERS = {"content-type": "application/json"}


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (content-length framed, as the client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server whose each connection runs `handler(reader, writer, index)`; its URL; connections seen."""
    seen: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        try:
            await handler(reader, writer, seen[-1])
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions", seen


async def body_of(pool: H1Pool, url: str, body: bytes = b"{}") -> tuple[int, dict[str, str], bytes]:
    response = await pool.post(url, body, HEADERS, 2.0, 2.0)
    data = b""
    while chunk := await response.read():
        data += chunk
    response.aclose()
    return response.status, response.headers, data


def test_framings_and_keep_alive_reuse() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        request = await read_request(reader)
        if index:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return
        assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"content-type: application/json\r\n" in request and request.endswith(b"\r\n\r\nhello")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await read_request(reader)  # a second request on the same connection: chunked
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nX-A: 1\r\nx-a: 2\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n3\r\n 1\n\r\n0\r\n\r\n")
        await read_request(reader)  # a third: delimited by the connection's end
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nto the end")
        await writer.drain()

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        assert await body_of(pool, url, b"hello") == (200, {"content-type": "application/json",
                                                             "content-length": "2"}, b"{}")
        status, headers, data = await body_of(pool, url)
        assert (status, headers["x-a"], data) == (200, "1, 2", b"data: 1\n")
        assert await body_of(pool, url) == (200, {"connection": "close"}, b"to the end")
        assert seen == [0]  # one connection carried all three
        status, _, data = await body_of(pool, url)  # the server closed it: a new connection
        assert seen == [0, 1] and status == 200
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_dead_pooled_connection_is_resent_once_on_a_new_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if index == 0:  # drop it without a word when the next request arrives: a reset, no answer
            await reader.readuntil(b"\r\n\r\n")
            writer.transport.abort()
            return
        await read_request(reader)

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        assert (await body_of(pool, url))[2] == b"ok"
        assert (await body_of(pool, url))[2] == b"ok"  # reset on the pooled one, answered on a new one
        assert seen == [0, 1]
        pool.close()
        server.close()

    asyncio.run(main())


def test_an_endless_response_head_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for n in range(100_000):  # ~2.5 MB of headers, never ending
            writer.write(b"x-filler-%06d: abcdefgh\r\n" % n)
            if n % 1000 == 0:
                await writer.drain()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        with pytest.raises(H1ProtocolError, match="longer than"):
            await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("answer, error", [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", H1Disconnected),  # cut mid-body
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", H1Disconnected),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n", H1ProtocolError),
])
def test_a_cut_or_broken_body_raises_after_what_arrived(answer: bytes, error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        response = await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        with pytest.raises(error):
            while await response.read():
                pass
        response.aclose()
        assert not pool._idle.get(("127.0.0.1", server.sockets[0].getsockname()[1], False))  # not reused
        server.close()

    asyncio.run(main())


def test_a_broken_head_and_a_refused_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        with pytest.raises(H1ProtocolError):
            await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        server.close()
        await server.wait_closed()
        with pytest.raises(H1ConnectError):
            await pool.post(url, b"{}", HEADERS, 2.0, 2.0)

    asyncio.run(main())


def test_the_read_timeout_counts_only_the_engines_silence() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # then silence

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        response = await pool.post(url, b"{}", HEADERS, 2.0, 0.2)
        await asyncio.sleep(0.4)  # the reader is away, not waiting: no timeout yet
        assert await response.read() == b"a"
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(H1ReadTimeout):
            await response.read()
        assert 0.15 < loop.time() - started < 1.0
        response.aclose()
        server.close()

    asyncio.run(main())


def test_reading_pauses_when_the_reader_falls_behind() -> None:
    piece = b"x" * 65536

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * 160))
        for _ in range(160):  # 10 MiB
            writer.write(piece)
            await writer.drain()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        response = await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        await asyncio.sleep(0.3)  # the server writes as fast as it can meanwhile
        held = response._conn.buffered
        assert held <= HIGH_WATER + 4 * len(piece)  # a paused transport, not the whole answer in memory
        total = 0
        while chunk := await response.read():
            total += len(chunk)
        assert total == len(piece) * 160
        response.aclose()
        server.close()

    asyncio.run(main())


def test_a_header_with_a_line_break_is_refused() -> None:
    async def main() -> None:
        pool = H1Pool(keep_alive=10)
        with pytest.raises(ValueError, match="line break"):
            await pool.post("http://127.0.0.1:9/x", b"", {"x-request-id": "a\r\nx-evil: 1"}, 1.0, 1.0)

    asyncio.run(main())


@pytest.mark.parametrize("after", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nevil!",  # a whole second answer nobody asked for
    b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nev",  # the start of one
    b"garbage",
])
@pytest.mark.parametrize("framing", [b"content-length: 2\r\n\r\nok",
                                     b"transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"])
def test_bytes_after_the_answers_end_never_join_it_nor_stay_in_the_pool(framing: bytes, after: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-n: %d\r\n%s%s" % (index, framing, after))  # one write: one read
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nnext")
        await writer.drain()

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        status, headers, data = await body_of(pool, url)
        assert (status, headers["x-n"], data) == (200, "0", b"ok")
        assert "5" not in headers.get("content-length", "")  # the unasked answer's head is not this one's
        status, headers, data = await body_of(pool, url)  # on a new connection: the old one is poisoned
        assert (headers["x-n"], data, seen) == ("1", b"ok", [0, 1])
        pool.close()
        server.close()

    asyncio.run(main())


def test_interim_1xx_answers_are_skipped_for_the_final_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        for _ in range(2):
            await read_request(reader)
            for interim in (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"):
                writer.write(interim)  # each in its own read
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        for _ in range(2):
            assert await body_of(pool, url) == (200, {"content-length": "2"}, b"ok")
        assert seen == [0]  # the connection was reused after the interim answers
        pool.close()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("answer, match", [
    (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\nxyz", "101"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nuntil the end", "transfer coding"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n", "transfer coding"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", "transfer coding"),
])
def test_an_unasked_upgrade_or_transfer_coding_is_a_protocol_error(answer: bytes, match: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        with pytest.raises(H1ProtocolError, match=match):
            await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        pool.close()
        server.close()

    asyncio.run(main())
    assert "Fatal error" not in caplog.text  # handled, not an exception escaping the protocol


@pytest.mark.parametrize("start, filler", [
    (b"HTTP/1.1 200 OK\r\nx-a: ", b"a"),  # one header value that never ends
    (b"HTTP/1.1 200 OK\r\nx-", b"a"),  # one header name
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n0\r\nx-t: ", b"a"),  # a trailer
    (b"", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"),  # interim answers without end
])
def test_an_endless_header_line_is_a_protocol_error(start: bytes, filler: bytes) -> None:
    sent = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        # A fixed send buffer: with the kernel's autotuned one (up to net.ipv4.tcp_wmem's max, 4 MiB)
        # the loopback took ~4.2 MB before the client's first read, counted as sent though unread.
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        await read_request(reader)
        writer.write(start)
        piece = filler * (16384 // len(filler))
        while sent[0] < 8 * 2**20:  # then silence, never the line's end
            writer.write(piece)
            sent[0] += len(piece)
            await writer.drain()
        await asyncio.sleep(10)

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        with pytest.raises(H1ProtocolError, match="longer than"):
            response = await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
            while await response.read():
                pass
        assert sent[0] < 4 * 2**20  # refused early: not buffered to the engine's end
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_pooled_connection_that_dies_after_the_engine_read_the_request_is_not_resent() -> None:
    """The resend is for an idle close crossing the request on the wire (it ends within one round
    trip); an engine that read the request and died later may have run it: the caller decides."""
    requests = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        requests[0] += 1
        await asyncio.sleep(0.3)  # working on it... then gone without a word

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10, resend_window=0.1)
        assert (await body_of(pool, url))[2] == b"ok"
        with pytest.raises(H1Disconnected):
            await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        assert seen == [0] and requests == [1]  # sent once, never again on a new connection
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_reset_ends_a_body_delimited_by_the_connections_end_as_an_error() -> None:
    """Only a clean end (FIN) ends such a body; a reset cuts it (the engine crashed or was killed)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"cut")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()

    async def main() -> None:
        server, url, _ = await serve(handler)
        pool = H1Pool(keep_alive=10)
        response = await pool.post(url, b"{}", HEADERS, 2.0, 2.0)
        assert await response.read() == b'{"cut'
        with pytest.raises(H1Disconnected, match="Reset"):
            await response.read()
        response.aclose()
        pool.close()
        server.close()

    asyncio.run(main())


def test_https_origins_of_a_pool_share_one_tls_context() -> None:
    """Building a default context reads the system's CA file (~30 ms of CPU on the event loop):
    once per pool, not once per worker URL (each worker has several API paths)."""
    pool = H1Pool(keep_alive=10)
    urls = [f"https://engine-{n}.internal:8000/v1/{path}"
            for n in range(3) for path in ("chat/completions", "completions")]
    contexts = {id(pool.origin(url)[0].ssl) for url in urls}
    assert len(contexts) == 1 and pool.origin(urls[0])[0].ssl is not None
    assert pool.origin("http://engine-0.internal:8000/v1/completions")[0].ssl is None


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@pytest.mark.parametrize("pieces, body, reused", [
    ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nA;ext=1;q=\"x\"\r\n0123456789\r\n"  # extensions, hex A
      b"0;last\r\nx-trailer: t\r\n\r\n"], b"0123456789", True),  # and a trailer
    ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n3\r\nabc\r\n0", b"\r", b"\n\r", b"\n"], b"abc", True),
    ([b"HTTP/1.1 204 No Content\r\n\r\n"], b"", True),
    ([b"HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\n\r\n"], b"", True),  # no body, whatever the length
    ([b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"], b"ok", True),
    ([b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"], b"ok", False),  # HTTP/1.0: closed unless kept alive
    ([b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"], b"ok", False),
])
def test_framing_edge_cases_that_parse(pieces: list[bytes], body: bytes, reused: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        for piece in pieces if index == 0 else [OK]:  # each in its own read
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        await read_request(reader)
        writer.write(OK)
        await writer.drain()

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        _, headers, data = await body_of(pool, url)
        assert data == body and "x-trailer" not in headers
        assert (await body_of(pool, url))[2] == b"ok"
        assert seen == ([0] if reused else [0, 1])
        pool.close()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",  # smuggling
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\nokabc",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1fffffffffffffffff\r\nabc",  # chunk size overflow
    b"HTTP/1.1 200 OK\r\nx-a: one\r\n two\r\ncontent-length: 2\r\n\r\nok",  # obs-fold (RFC 9112 §5.2: 502)
    b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\nok",
])
def test_ambiguous_framing_is_refused_and_the_connection_closed(answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(OK if index else answer)
        await writer.drain()
        await read_request(reader)
        writer.write(OK)
        await writer.drain()

    async def main() -> None:
        server, url, seen = await serve(handler)
        pool = H1Pool(keep_alive=10)
        with pytest.raises(H1ProtocolError):
            await body_of(pool, url)
        assert (await body_of(pool, url))[2] == b"ok" and seen == [0, 1]
        pool.close()
        server.close()

    asyncio.run(main())
