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
from urllib.parse import urlsplit

import httpx

from gateway.backends.h1 import H1ConnectError, H1Disconnected, H1Error, H1Pool, H1ProtocolError
from gateway.backends.pool_params import PoolConfig

# A chunk is what arrived since the last read (reading pauses above h1.HIGH_WATER, after at
# most one more socket read), so a call holds at most max_bytes + HIGH_WATER + 256 KiB of body
# before it gives up.
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
    much body was read before giving up (bytes); `gone` is true when nothing serves at the worker's
    address (`engine_gone`), as opposed to an engine that is there but slow or failing."""

    def __init__(self, reason: str, bytes_read: int = 0, gone: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bytes_read = bytes_read
        self.gone = gone


class _Phase:
    """Where a call is (`H1Pool.get`'s trace), to say what a deadline cut."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = "connecting"

    def __call__(self, name: str) -> None:
        self.name = name


async def control_get(client: H1Pool, url: str, headers: Mapping[str, str], deadline: float,
                      max_bytes: int) -> ControlAnswer:
    """GET `url` within `deadline` seconds overall, reading at most `max_bytes` of body.

    `client`: the keep-alive pool of the control calls (`AppState.control`; its own connections,
    not the generation requests'). Returns the status and body of any complete answer (the caller
    judges the status). Raises ControlError when the deadline passes, the body is larger than
    `max_bytes` or compressed, or the exchange fails (`describe_transport_error` gives the words).
    """
    phase = _Phase()
    received = 0
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(deadline):
            # (H1Pool sends `Accept-Encoding: identity` itself)
            response = await client.get(url, {k: v for k, v in headers.items() if k != "accept-encoding"},
                                        deadline, deadline, phase)
            try:
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise ControlError(f"answered a compressed body (Content-Encoding: {encoding}) "
                                       "though identity was asked")
                phase.name = "reading the body"
                while chunk := await response.read():
                    received += len(chunk)
                    if received > max_bytes:
                        raise ControlError(f"body larger than {max_bytes} bytes", received)
                    chunks.append(chunk)
            finally:
                response.aclose()  # an unread rest is not drained: the connection is dropped
    except TimeoutError:  # the overall deadline (or H1's own timers, set to it, winning the race)
        so_far = f", {received} bytes so far" if phase.name == "reading the body" else ""
        raise ControlError(f"no complete answer within {deadline:g} s ({phase.name}{so_far})", received) from None
    except (H1Error, ValueError) as exc:
        raise ControlError(describe_transport_error(exc, url), received, gone=engine_gone(exc)) from exc
    return ControlAnswer(response.status, b"".join(chunks))


_NO_SUCH_NAME = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA") else set())


def engine_gone(exc: BaseException) -> bool:
    """True when a failed exchange shows that no engine process serves the address: its host name
    does not exist (a deleted pod's DNS record; not a resolver that failed to answer, EAI_AGAIN) or
    the connection was refused (nothing listens on the port: the engine process exited). An
    unreachable network or host (ENETUNREACH, EHOSTUNREACH) is not: a network blip looks the same
    while the engine process lives on; nor is a timeout: a busy engine (a long prefill) or a stalled
    gateway event loop looks the same."""
    for cause in _causes(exc):
        if isinstance(cause, socket.gaierror):
            return cause.errno in _NO_SUCH_NAME
        if isinstance(cause, ConnectionRefusedError):
            return True
    return False


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
    if isinstance(exc, H1Disconnected | H1ProtocolError):
        return f"the worker broke the HTTP exchange ({exc})"
    if isinstance(exc, H1ConnectError):
        return str(exc)
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
