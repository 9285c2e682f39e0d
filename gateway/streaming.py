"""One upstream attempt and the byte relay (design §2 steps 7-10).

An attempt succeeds once the engine sent 2xx headers AND its first body byte; until then every
failure is an `AttemptFailed` the service may retry elsewhere. After that the relay passes raw
bytes through as they arrive (`UpstreamResponse.chunks`, no re-encoding); a tap observes a copy. A failure after
the first byte becomes one SSE error event and the stream ends without `[DONE]`. Closing the
upstream response in `finally` is what makes the engine abort a request whose client hung up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from enum import StrEnum

from gateway.backends.capacity import PoolGate
from gateway.backends.client import (
    TransportError,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeouts,
    is_connect_error,
    is_timeout,
)
from gateway.backends.engines import is_context_too_long
from gateway.backends.patches import drop_usage_events
from gateway.backends.worker import Worker
from gateway.metrics import GatewayMetrics
from gateway.protocol.sse import SSETap, event_end, sse_error_event
from gateway.record import RequestRecord

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an engine's error answer we read
KEEPALIVE_COMMENT = b": keep-alive\n\n"  # an SSE comment: clients ignore it (WHATWG SSE spec)
MAX_PARTIAL_EVENT = 1 << 20  # a longer unfinished event is passed on rather than held


class Outcome(StrEnum):
    """How one upstream attempt ended (a bounded metric label)."""

    OK = "ok"
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    PROTOCOL_ERROR = "protocol_error"
    STATUS_5XX = "status_5xx"
    STATUS_429 = "status_429"
    TOO_LONG = "too_long"
    CLIENT_ERROR = "client_error"
    AUTH_ERROR = "auth_error"


RETRYABLE = frozenset({Outcome.CONNECT_ERROR, Outcome.TIMEOUT, Outcome.PROTOCOL_ERROR, Outcome.STATUS_5XX,
                       Outcome.STATUS_429})


class AttemptFailed(Exception):
    """An attempt failed before the engine's first body byte. `status`/`body` are the engine's answer
    when it gave one (4xx/5xx), `retry_after` its Retry-After header in seconds."""

    def __init__(self, outcome: Outcome, detail: str, status: int | None = None, body: bytes = b"",
                 retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.status = status
        self.body = body
        self.retry_after = retry_after


class Lease:
    """This replica's in-flight count on a worker and a slot of its pool, released exactly once."""

    __slots__ = ("_gate", "_metrics", "_released", "worker")

    def __init__(self, worker: Worker, metrics: GatewayMetrics, gate: PoolGate) -> None:
        self.worker = worker
        self._metrics = metrics
        self._gate = gate
        self._released = False
        worker.in_flight += 1
        gate.acquired()
        metrics.in_flight.labels(worker.pool, worker.id).inc()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.worker.in_flight -= 1
            self._gate.released()
            self._metrics.in_flight.labels(self.worker.pool, self.worker.id).dec()


def _classify_transport_error(exc: BaseException) -> Outcome:
    if is_connect_error(exc):
        return Outcome.CONNECT_ERROR
    if is_timeout(exc):
        return Outcome.TIMEOUT
    return Outcome.PROTOCOL_ERROR


def _retry_after(response: UpstreamResponse) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


async def _read_error(response: UpstreamResponse) -> bytes:
    body = bytearray()
    try:
        async for chunk in response.chunks():
            body += chunk
            if len(body) >= ERROR_BODY_LIMIT:
                break
    except TransportError:
        pass
    return bytes(body[:ERROR_BODY_LIMIT])


async def open_upstream(client: UpstreamClient, url: str, body: bytes, headers: dict[str, str],
                        timeout: UpstreamTimeouts, pool: str | None = None) -> UpstreamResponse:
    """POST `body` (on `pool`'s connections) and return the response once 2xx headers arrived
    (body not read yet).

    Raises AttemptFailed: transport errors, 5xx, 429, the engine's "context too long", other 4xx.
    """
    try:
        response = await client.post(url, body, headers, timeout, pool)
    except TransportError as exc:
        raise AttemptFailed(_classify_transport_error(exc), f"{type(exc).__name__} from {url}") from exc
    status = response.status_code
    if status == 200:
        return response
    try:
        error_body = await _read_error(response)
    finally:
        await response.aclose()
    if status < 400:  # 204, redirects...: not an answer we can relay
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered HTTP {status}", status, error_body)
    if status == 429:
        raise AttemptFailed(Outcome.STATUS_429, "engine is rate limiting (429)", status, error_body,
                            _retry_after(response))
    if status >= 500:
        raise AttemptFailed(Outcome.STATUS_5XX, f"engine answered HTTP {status}", status, error_body,
                            _retry_after(response))
    if is_context_too_long(status, error_body):
        raise AttemptFailed(Outcome.TOO_LONG, "engine says the prompt is too long", status, error_body)
    if status in (401, 403, 407):  # the gateway's engine credentials, not the client's fault
        raise AttemptFailed(Outcome.AUTH_ERROR, f"engine refused the gateway's credentials ({status})", status,
                            error_body)
    raise AttemptFailed(Outcome.CLIENT_ERROR, f"engine answered HTTP {status}", status, error_body)


async def first_chunk(response: UpstreamResponse, patience: float | None = None
                      ) -> tuple[bytes | None, AsyncIterator[bytes], asyncio.Task[bytes] | None]:
    """Wait for the first body bytes of an accepted response: `(first, rest, None)`.

    With `patience` (seconds), stop waiting after that long and return `(None, rest, pending)`
    where `pending` is the still-running read of the first chunk (the caller owns it).
    Raises AttemptFailed (and closes the response) if the engine fails or ends before sending any.
    """
    chunks = response.chunks()
    try:
        if patience is None:
            first = await anext(chunks, b"")
        else:
            pending = asyncio.ensure_future(anext(chunks, b""))
            try:
                await asyncio.wait((pending,), timeout=patience)
            except BaseException:  # the handler was cancelled (client gone, shutdown)
                pending.cancel()
                raise
            if not pending.done():
                return None, chunks, pending
            first = pending.result()
    except TransportError as exc:
        await response.aclose()
        raise AttemptFailed(_classify_transport_error(exc), f"{type(exc).__name__} before the first byte") from exc
    except BaseException:
        await response.aclose()
        raise
    if not first:
        await response.aclose()
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, "engine answered 200 with an empty body")
    return first, chunks, None


def early_stream_error(first: bytes) -> AttemptFailed | None:
    """An SSE error event as a 200 stream's first event that says "context too long".

    Some engines (SGLang before 2026) validate a streaming request's length only after sending
    200 headers; the error arrives as `data: {"error": ...}`. Caught here, it is retried like a 400.
    """
    if not first.startswith(b"data:") or first.find(b'"error"', 0, ERROR_BODY_LIMIT) < 0:  # no copy
        return None
    payload = first.split(b"\n", 1)[0][5:].strip()
    if not is_context_too_long(400, payload):
        return None
    return AttemptFailed(Outcome.TOO_LONG, "engine says the prompt is too long (in-stream error)", 400, payload)


class AnswerTooLarge(ValueError):
    """A non-streaming answer grew past the gateway's buffer limit (`max_body_bytes`): the request
    asked for that much (huge `n`, a batch of prompts), so it is not the worker's fault."""


async def read_rest(response: UpstreamResponse, first: bytes, chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The whole body of a non-streaming response, given its first chunk.

    Raises TransportError if the engine fails midway, AnswerTooLarge above `limit` bytes.
    """
    body = bytearray(first)
    async for chunk in chunks:
        if len(body) > limit:
            break
        body += chunk
    if len(body) > limit:
        raise AnswerTooLarge(f"engine response is larger than {limit} bytes")
    return bytes(body)


class UpstreamStream:
    """An accepted streaming response: the primed first chunk, then the rest, relayed as bytes.

    Owns the upstream response and the worker lease; `aclose()` (idempotent, also safe when the
    body was never iterated) closes both. Facts for the record: first byte time, usage, outcome.
    """

    def __init__(self, response: UpstreamResponse, first: bytes | None, rest: AsyncIterator[bytes], lease: Lease,
                 record: RequestRecord, pending: asyncio.Task[bytes] | None = None,
                 keepalive_interval: float = 15.0, on_end: Callable[[str | None], None] | None = None,
                 strip_usage: bool = False) -> None:
        self.response = response
        self._on_end = on_end
        self._first = first
        self._pending = pending
        self._keepalive = keepalive_interval
        self._rest = rest
        self._lease = lease
        self._record = record
        self._closed = False
        self.tap = SSETap()
        self.sse = response.headers.get("content-type", "").startswith("text/event-stream")
        self._strip_usage = strip_usage and self.sse  # the usage patch's second half (backends/patches.py)

    async def body(self) -> AsyncIterator[bytes]:
        """Yield the upstream bytes unchanged (but for the usage patch's own chunk when
        `strip_usage`), cut only at SSE event ends.

        Whole events pass as soon as their last byte arrives (an engine that writes one event
        per write is relayed write for write); a partial event waits for its end, so a failure
        mid-event never leaves the client a corrupt event. A failure, or an end without
        `data: [DONE]`, is reported with one SSE error event and no `[DONE]`. A non-SSE body
        passes through as it arrives.
        """
        tap = self.tap
        carry = b""
        try:
            for_client = self._first
            if for_client is None:  # a long prefill: keep idle proxies from cutting the stream
                async for comment in self._keepalives():
                    yield comment
                for_client = await self._pending  # type: ignore[misc]
                mark_first_byte(self._record)
            chunks = self._rest
            while True:
                tap.feed(for_client)
                if self.sse:
                    data = carry + for_client if carry else for_client
                    end = event_end(data)
                    if end < len(data) and len(data) - end <= MAX_PARTIAL_EVENT:
                        carry, for_client = data[end:], data[:end]
                    else:
                        carry, for_client = b"", data
                    if for_client:
                        for_client = self._patched(for_client)
                if for_client:
                    yield for_client
                for_client = await anext(chunks, b"")
                if not for_client:
                    break
            tap.end()
            if self.sse and not tap.done:
                self._broken("the stream ended without data: [DONE]")
                yield sse_error_event("The inference server ended the stream early; the response is incomplete.")
            else:
                if carry:  # a complete answer whose last event lacks its blank line: pass it on as it is
                    yield self._patched(carry)
                self._ended(None)
        except TransportError as exc:
            if tap.done:
                if carry:
                    yield self._patched(carry)
                self._ended(None)
                return  # the answer was complete; only the connection's end was untidy
            self._broken(f"{type(exc).__name__} mid-stream after {tap.events} events")
            yield sse_error_event(f"The inference server failed mid-stream ({type(exc).__name__}); "
                                  "the response is incomplete.")
        finally:
            await self.aclose()

    def _patched(self, events: bytes) -> bytes:
        """Whole events as the client gets them: without the usage patch's own bytes when it is on."""
        return drop_usage_events(events) if self._strip_usage else events

    async def _keepalives(self) -> AsyncIterator[bytes]:
        """SSE comment lines every `keepalive_interval` seconds until the first chunk is read."""
        assert self._pending is not None
        while not self._pending.done():
            await asyncio.wait((self._pending,), timeout=self._keepalive)
            if not self._pending.done():
                yield KEEPALIVE_COMMENT

    def _broken(self, detail: str) -> None:
        self._record.outcome = "upstream_error"
        self._record.error = detail
        self._ended(detail)  # a dead or broken engine counts against its worker

    def _ended(self, failure: str | None) -> None:
        """Report how the engine's answer ended (None: complete) to the owner, once; a client that
        hung up is no verdict on the engine and reports nothing."""
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end(failure)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        try:
            await self.response.aclose()
        finally:
            self._lease.release()
            self._record.usage = self.tap.usage or self._record.usage


def mark_first_byte(record: RequestRecord) -> None:
    """Note the first upstream body byte (TTFT for streams)."""
    if record.first_byte_at is None:
        record.first_byte_at = time.perf_counter()
