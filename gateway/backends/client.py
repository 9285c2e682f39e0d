"""The one pooled HTTP client for requests to the engines, and the per-request timeout budget.

Generation requests go through aiohttp: measured side by side with httpx against the same fast
fake engine (`python -m loadtest.upstream_clients`), httpx 0.28 spent 2.7 ms of CPU per streamed
request at 32 concurrent streams and 7 ms at 256 (its connection pool scans every connection on
each request), aiohttp 3.14 0.26 ms and 0.35 ms. Health probes and `/metrics` scrapes (a few per
second) keep using httpx (`AppState.http`).

`UpstreamResponse` hides the library from the relay: status, headers, the body as raw chunks
(transfer decoding only: compression is refused, so bytes relay unchanged) and `aclose()`, which
returns a fully read connection to the pool and closes any other, so the engine sees the client
leave and aborts the request (vLLM and SGLang abort on disconnect).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from aiohttp.connector import Connection

from gateway.config import TimeoutConfig

DEFAULT_KEEP_ALIVE_S = 4.0  # below the 5 s idle keep-alive of uvicorn (vLLM, SGLang) and cpp-httplib (llama.cpp)

# What a failed exchange with an engine raises (aiohttp's timeouts are TimeoutErrors too).
TransportError = (aiohttp.ClientError, TimeoutError)


def is_connect_error(exc: BaseException) -> bool:
    """The connection was never made (refused, unreachable, connect timeout): safe to retry anywhere."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Timeouts of one upstream request, in seconds: `connect`, and `read` = the longest wait for
    any single read of headers or body."""

    connect: float
    read: float


class UpstreamResponse:
    """An engine's answer once its headers arrived; the body is not read yet."""

    __slots__ = ("_raw",)

    def __init__(self, raw: aiohttp.ClientResponse) -> None:
        self._raw = raw

    @property
    def status_code(self) -> int:
        return self._raw.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Response headers, case-insensitive."""
        return self._raw.headers

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (each chunk non-empty); raises TransportError if the engine fails."""
        return self._raw.content.iter_any()

    async def aclose(self) -> None:
        """Release a fully read response's connection for reuse; close any other (the engine sees
        the disconnect and aborts the request). Idempotent."""
        if self._raw.content.at_eof():
            self._raw.release()
        else:
            self._raw.close()


class _Reuse:
    """One request's note: did it go out on a pooled (reused) connection?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


# The note of the request being sent in this task; `_PoolConnector.connect` runs in the caller's task.
_REUSE: ContextVar[_Reuse | None] = ContextVar("upstream_reuse", default=None)


class _PoolConnector(aiohttp.TCPConnector):
    """aiohttp's TCP pool, noting for each request whether its connection had carried one before.

    (aiohttp's `on_connection_reuseconn` trace signal says the same, but a trace config made every
    streamed request cost ~0.3 ms more CPU in `loadtest.overhead`.)"""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[Any] = weakref.WeakSet()

    async def connect(self, req: aiohttp.ClientRequest, traces: list[Any],
                      timeout: aiohttp.ClientTimeout) -> Connection:
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            if (note := _REUSE.get()) is not None:
                note.reused = protocol in self._used
            self._used.add(protocol)
        return conn


class UpstreamClient:
    """Keep-alive pools to every engine, one per gateway pool (each with its pool's
    `upstream_keep_alive`), with no connection cap (the engines' own queues and the pool gates
    bound load). Call `start()` on the event loop that will use it, `aclose()` at the end.

    A request that fails on a reused connection before any response byte (the engine had closed
    it: `ServerDisconnectedError`, a reset) is sent once more on a new connection: the engine
    never saw it (RFC 9112 9.3.1.1), and it is no sign of a broken worker.
    """

    def __init__(self, timeouts: TimeoutConfig, keep_alive: Mapping[str, float] | None = None) -> None:
        self._timeouts = timeouts
        self._keep_alive = dict(keep_alive or {})
        self._sessions: dict[str | None, aiohttp.ClientSession] = {}
        self._fresh: aiohttp.ClientSession | None = None

    def _session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector, auto_decompress=False, trust_env=False,
            headers={"accept-encoding": "identity"}, skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeouts.connect,
                                          sock_read=self._timeouts.read),
        )

    async def start(self) -> None:
        for pool, seconds in [(None, DEFAULT_KEEP_ALIVE_S), *self._keep_alive.items()]:
            connector = _PoolConnector(limit=0, keepalive_timeout=seconds, ttl_dns_cache=10)
            self._sessions[pool] = self._session(connector)
        # Only for the resend after a dead pooled connection: always a new connection.
        self._fresh = self._session(aiohttp.TCPConnector(limit=0, force_close=True, ttl_dns_cache=10))

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   timeouts: UpstreamTimeouts, pool: str | None = None) -> UpstreamResponse:
        """POST `body` on `pool`'s connections and return once the response headers arrived.
        Raises TransportError."""
        session = self._sessions.get(pool) or self._sessions.get(None)
        assert session is not None and self._fresh is not None, "UpstreamClient.start() was not called"
        reuse = _Reuse()
        timeout = _client_timeout(timeouts)
        token = _REUSE.set(reuse)
        try:
            raw = await session.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not reuse.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            raw = await self._fresh.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        finally:
            _REUSE.reset(token)
        return UpstreamResponse(raw)

    async def aclose(self) -> None:
        for session in [*self._sessions.values(), self._fresh]:
            if session is not None:
                await session.close()


@functools.lru_cache(maxsize=1024)
def _client_timeout(timeouts: UpstreamTimeouts) -> aiohttp.ClientTimeout:
    """aiohttp's timeout object for `timeouts`, built once per distinct value (building one per
    request showed in the profile; the read budget takes few distinct values)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, sock_read=timeouts.read)


def first_byte_budget(timeouts: TimeoutConfig, prompt_tokens: int) -> float:
    """Seconds to wait for an engine's first content: a base plus a prefill allowance per 1K tokens."""
    return timeouts.first_byte_base + timeouts.first_byte_per_1k_tokens * prompt_tokens / 1000.0


def answer_budget(timeouts: TimeoutConfig, prompt_tokens: int, output_tokens: int) -> float:
    """Seconds a non-streaming answer may take (its headers come with its last byte): the
    first-byte budget, `generation`, and `generation_per_token` per requested output token."""
    return (first_byte_budget(timeouts, prompt_tokens) + timeouts.generation
            + timeouts.generation_per_token * output_tokens)


def request_timeout(timeouts: TimeoutConfig, prompt_tokens: int, stream: bool,
                    output_tokens: int = 0) -> UpstreamTimeouts:
    """Timeouts of one upstream request.

    Streaming: each read may wait the first-byte budget (prefill) or the gap limit, whichever is
    longer. Non-streaming: the first byte comes with the whole answer, so a read may take the
    whole `answer_budget`.
    """
    if stream:
        read = max(timeouts.read, first_byte_budget(timeouts, prompt_tokens))
    else:
        read = answer_budget(timeouts, prompt_tokens, output_tokens)
    return UpstreamTimeouts(connect=timeouts.connect, read=read)


def build_control_client(timeouts: TimeoutConfig, keep_alive: float = DEFAULT_KEEP_ALIVE_S) -> httpx.AsyncClient:
    """The httpx client for health probes and `/metrics` scrapes (each call sets its own deadline, body
    cap and headers: `backends/control.py`).

    Idle connections are kept `keep_alive` seconds: below the engines' own idle keep-alive, so a
    probe never goes out on a connection the engine is closing (and fails the worker for it)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=keep_alive),
        follow_redirects=False, trust_env=False,
    )
