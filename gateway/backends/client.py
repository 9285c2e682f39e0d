"""The one pooled HTTP client for requests to the engines, and the per-request timeout budget.

Generation requests go through `backends/h1.py`, a minimal HTTP/1.1 client on asyncio protocols
and httptools. Measured against the overhead benchmark's fast fake engine (64 streams of 32 SSE
events, the client alone on one core): httpx 0.28 spent 2.7 ms of CPU per streamed request at 32
concurrent streams and 7 ms at 256 (its pool scans every connection per request); aiohttp 3.14
0.19-0.26 ms; h1.py 0.075-0.08 ms. Health probes and `/metrics` scrapes (a few per second) keep
using httpx (`AppState.http`).

`UpstreamResponse` hides the client from the relay: status, headers, the body as identity chunks
(transfer decoding, and the content coding an engine applied although it was asked for identity:
`backends/encoding.py`, gzip and deflate, bounded), `redact` (the config's secrets out of an
engine's error answer: `gateway/redact.py`) and `aclose()`, which returns a fully read connection
to the pool and closes any other, so the engine sees the client leave and aborts the request
(vLLM and SGLang abort on disconnect).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx

from gateway.backends.encoding import codings_of, decoded
from gateway.backends.h1 import H1ConnectError, H1Error, H1Pool, H1Response
from gateway.dispatch.params import TimeoutConfig
from gateway.redact import Redactor

DEFAULT_MAX_DECODED_BYTES = 256 * 1024 * 1024  # GatewayConfig.max_decoded_bytes' default
DEFAULT_KEEP_ALIVE_S = 4.0  # below the 5 s idle keep-alive of uvicorn (vLLM, SGLang) and cpp-httplib (llama.cpp)

# What a failed exchange with an engine raises (every timeout is a TimeoutError too).
TransportError = (H1Error, TimeoutError)


def is_connect_error(exc: BaseException) -> bool:
    """The connection was never made (refused, unreachable, connect timeout): safe to retry anywhere."""
    return isinstance(exc, H1ConnectError)


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Timeouts of one upstream request, in seconds: `connect`, and `read` = the longest wait for
    any single read of headers or body."""

    connect: float
    read: float


class _Body:
    """The body of a response as an async iterator of non-empty chunks."""

    __slots__ = ("_raw",)

    def __init__(self, raw: H1Response) -> None:
        self._raw = raw

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        data: bytes = await self._raw.read()
        if not data:
            raise StopAsyncIteration
        return data


class UpstreamResponse:
    """An engine's answer once its headers arrived; the body is not read yet. `redact` takes the
    gateway's configured secrets out of bytes read from it (an engine's error answer)."""

    __slots__ = ("_limit", "_raw", "redact")

    def __init__(self, raw: H1Response, redact: Redactor | None = None,
                 decoded_limit: int = DEFAULT_MAX_DECODED_BYTES) -> None:
        self._raw = raw
        self._limit = decoded_limit
        self.redact = redact if redact is not None else Redactor()

    @property
    def status_code(self) -> int:
        return self._raw.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Response headers, by lower-case name."""
        return self._raw.headers

    def codings(self) -> tuple[str, ...]:
        """The content codings the engine applied to the body (`encoding.codings_of`); raises
        UnsupportedEncoding for one the gateway cannot decode."""
        return codings_of(self._raw.headers.get("content-encoding"))

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded to identity (each chunk non-empty); raises TransportError
        if the engine fails, DecodeError (a TransportError) for an encoded body that is broken or
        decodes past the limit, UnsupportedEncoding (at once) for a coding it cannot decode."""
        if "content-encoding" not in self._raw.headers:
            return _Body(self._raw)
        codings = self.codings()
        return decoded(_Body(self._raw), codings, self._limit) if codings else _Body(self._raw)

    def content_started(self, gap: float) -> None:
        """A stream's first content arrived: from here each read may wait at most `gap` seconds
        (`timeouts.read`, the longest gap between tokens) instead of the first-byte budget the
        request was sent with (`request_timeout`)."""
        self._raw.set_read_timeout(gap)

    async def aclose(self) -> None:
        """Release a fully read response's connection for reuse; close any other (the engine sees
        the disconnect and aborts the request). Idempotent."""
        self._raw.aclose()


class UpstreamClient:
    """Keep-alive pools to every engine, one per gateway pool (each with its pool's
    `upstream_keep_alive`), with no connection cap (the engines' own queues and the pool gates
    bound load). Call `start()` on the event loop that will use it, `aclose()` at the end.

    A request that fails on a reused connection before any response byte, within a second of its
    sending (an idle close crossing it), is sent once more on a new connection (`H1Pool.post`).

    `redactor` holds the config's secrets (applied by the relay to engines' error answers);
    `decoded_limit` is the most bytes one encoded answer may decode to.
    """

    def __init__(self, timeouts: TimeoutConfig, keep_alive: Mapping[str, float] | None = None,
                 redactor: Redactor | None = None, decoded_limit: int = DEFAULT_MAX_DECODED_BYTES) -> None:
        self._timeouts = timeouts
        self._keep_alive = dict(keep_alive or {})
        self._pools: dict[str | None, H1Pool] = {}
        self.redactor = redactor if redactor is not None else Redactor()
        self._decoded_limit = decoded_limit

    async def start(self) -> None:
        for pool, seconds in [(None, DEFAULT_KEEP_ALIVE_S), *self._keep_alive.items()]:
            self._pools[pool] = H1Pool(seconds)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   timeouts: UpstreamTimeouts, pool: str | None = None) -> UpstreamResponse:
        """POST `body` on `pool`'s connections and return once the response headers arrived.
        Raises TransportError."""
        client = self._pools.get(pool) or self._pools.get(None)
        assert client is not None, "UpstreamClient.start() was not called"
        return UpstreamResponse(await client.post(url, body, headers, timeouts.connect, timeouts.read),
                                self.redactor, self._decoded_limit)

    async def aclose(self) -> None:
        for client in self._pools.values():
            client.close()


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
    longer, until the first content; from there the gap limit (`UpstreamResponse.content_started`).
    Non-streaming: the first byte comes with the whole answer, so a read may take the
    whole `answer_budget`.
    """
    if stream:
        read = max(timeouts.read, first_byte_budget(timeouts, prompt_tokens))
    else:
        read = answer_budget(timeouts, prompt_tokens, output_tokens)
    return UpstreamTimeouts(connect=timeouts.connect, read=read)


def build_control_client(timeouts: TimeoutConfig, keep_alive: float = DEFAULT_KEEP_ALIVE_S) -> httpx.AsyncClient:
    """The httpx client of the control calls other than health probes and `/metrics` scrapes (those
    go through their own `H1Pool`, `backends/control.py`): LoRA adapter loads, stored responses,
    the Mooncake bootstrap query.

    Idle connections are kept `keep_alive` seconds: below the engines' own idle keep-alive, so a
    probe never goes out on a connection the engine is closing (and fails the worker for it)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=keep_alive),
        follow_redirects=False, trust_env=False,
    )
