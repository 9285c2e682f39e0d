"""The engines' HTTP/1.1 client (gateway/backends/h1.py) against scripted servers on loopback:
body framings, keep-alive reuse, the resend after a dead pooled connection, broken and cut
answers, the read timeout, flow control and header injection."""

from __future__ import annotations

import asyncio
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
