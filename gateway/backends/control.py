"""Bounded GETs to the workers for health probes and `/metrics` scrapes, and their failures in words.

A worker's port may hold anything (a wedged engine, a proxy, a hostile process), so every such
call has an overall deadline (connect, headers and body together, not per read: a body trickled
one byte at a time cannot stretch it) and a capped body: at most `max_bytes` are read, then the
connection is dropped. Bodies are asked for uncompressed (`Accept-Encoding: identity`) and a
compressed one is refused, so the cap bounds memory too. Each call carries the pool's
credentials (`PoolConfig.api_key` as `Authorization: Bearer`), as inference requests do:
vLLM's `--api-key` guards only `/v1/*` and SGLang's skips `/health` and `/metrics`, but an
authenticating proxy in front of an engine guards every path.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.backends.pool_params import PoolConfig

# A chunk is at most one socket read (httpcore reads 64 KiB), so a call holds at most
# max_bytes + 64 KiB of body before it gives up.
_IDENTITY = {"accept-encoding": "identity"}


def pool_headers(pools: Iterable[PoolConfig]) -> dict[str, dict[str, str]]:
    """Pool name → headers of every control call to its workers (its `Authorization` when it has
    an `api_key`, and `Accept-Encoding: identity`)."""
    headers: dict[str, dict[str, str]] = {}
    for pool in pools:
        entry = dict(_IDENTITY)
        if pool.api_key is not None:
            entry["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
        headers[pool.name] = entry
    return headers


@dataclass(frozen=True, slots=True)
class ControlAnswer:
    """A worker's complete answer: HTTP status and body (at most the cap, in bytes)."""

    status: int
    body: bytes


class ControlError(Exception):
    """A probe or scrape that got no usable answer; `str()` says why in words, `bytes_read` is how
    much body was read before giving up (bytes)."""

    def __init__(self, reason: str, bytes_read: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bytes_read = bytes_read


class _Phase:
    """Where a call is, from httpcore's trace events, to say what a deadline cut."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = "connecting"

    async def trace(self, event: str, info: Mapping[str, Any]) -> None:
        if event == "http11.send_request_headers.started":
            self.name = "sending the request"
        elif event == "http11.receive_response_headers.started":
            self.name = "waiting for the response headers"


async def control_get(client: httpx.AsyncClient, url: str, headers: Mapping[str, str], deadline: float,
                      max_bytes: int) -> ControlAnswer:
    """GET `url` within `deadline` seconds overall, reading at most `max_bytes` of body.

    Returns the status and body of any complete answer (the caller judges the status). Raises
    ControlError when the deadline passes, the body is larger than `max_bytes` or compressed, or
    the transport fails (`describe_transport_error` gives the words).
    """
    phase = _Phase()
    received = 0
    try:
        async with asyncio.timeout(deadline):
            request = client.build_request("GET", url, headers={**_IDENTITY, **headers},
                                           timeout=httpx.Timeout(deadline), extensions={"trace": phase.trace})
            response = await client.send(request, stream=True)
            try:
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise ControlError(f"answered a compressed body (Content-Encoding: {encoding}) "
                                       "though identity was asked")
                phase.name = "reading the body"
                chunks: list[bytes] = []
                async for chunk in response.aiter_raw():
                    received += len(chunk)
                    if received > max_bytes:
                        raise ControlError(f"body larger than {max_bytes} bytes", received)
                    chunks.append(chunk)
            finally:
                await response.aclose()  # an unread rest is not drained: the connection is dropped
    except (TimeoutError, httpx.TimeoutException):  # httpx's own timeout (set to the deadline) may win the race
        so_far = f", {received} bytes so far" if phase.name == "reading the body" else ""
        raise ControlError(f"no complete answer within {deadline:g} s ({phase.name}{so_far})", received) from None
    except httpx.HTTPError as exc:
        raise ControlError(describe_transport_error(exc, url), received) from exc
    return ControlAnswer(response.status_code, b"".join(chunks))


def describe_transport_error(exc: BaseException, url: str) -> str:
    """The real cause of a failed HTTP exchange with `url`, in words.

    httpx wraps the socket error (often twice: httpx → httpcore → OSError), and its own message
    may only say `All connection attempts failed`; this walks the chain to the first cause that
    names what happened: a host name that does not resolve (socket.gaierror), a refused or
    unreachable address, a TLS failure, a connection the worker dropped, or a broken HTTP answer.
    """
    host = urlsplit(url).hostname or url
    for cause in _causes(exc):
        if isinstance(cause, socket.gaierror):
            detail = cause.strerror or str(cause)
            return f"host name {host!r} does not resolve ({detail})"
        if isinstance(cause, ConnectionRefusedError):
            return f"connection to {host} refused"
        if isinstance(cause, ssl.SSLError):
            return f"TLS with {host} failed ({cause.reason or cause})"
        if isinstance(cause, OSError) and cause.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT):
            return f"{host}: {os.strerror(cause.errno)}"
        if isinstance(cause, ConnectionResetError | BrokenPipeError):
            return f"connection to {host} dropped by the worker"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the worker broke the HTTP exchange ({str(exc) or 'no detail'})"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return f"connection to {host} dropped ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from, outermost first (cycles cut)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
