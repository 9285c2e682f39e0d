"""One upstream attempt and the byte relay (design §2 steps 7-10).

An attempt succeeds once the engine sent 2xx headers AND its first body byte; until then every
failure is an `AttemptFailed` the service may retry elsewhere. After that the relay passes the
body's bytes through as they arrive (`UpstreamResponse.chunks`: identity bytes, a content coding
the engine applied unasked decoded, backends/encoding.py; no re-encoding); a tap observes a copy. A
failure after the first byte becomes one SSE error event and the stream ends without `[DONE]`,
unless the stream migrates to another worker (gateway/dispatch/migration.py).
Closing the upstream response in `finally` is what makes the engine abort a request whose client
hung up. The config's secrets are taken out of an engine's error answer (its non-2xx body, its
in-stream error events) before it is relayed or logged (`UpstreamResponse.redact`, gateway/redact.py).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from gateway.backends.capacity import PoolGate
from gateway.backends.client import (
    TransportError,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeouts,
    is_connect_error,
    is_timeout,
)
from gateway.backends.encoding import DecodeError, UnsupportedEncoding
from gateway.backends.engine_kinds import is_context_too_long
from gateway.backends.patches import drop_usage_events
from gateway.backends.worker import Worker
from gateway.observability.metrics import GatewayMetrics
from gateway.protocol.anthropic import ERROR_STATUS
from gateway.protocol.responses import ERROR_EVENTS, PREAMBLE_EVENTS
from gateway.protocol.sse import SSETap, event_end, sse_error_event
from gateway.redact import Redactor
from gateway.routing.prefill import PrefillTicket

if TYPE_CHECKING:  # the ledger's own imports do not include this module
    from gateway.dispatch.ledger import Ledger

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an engine's error answer we read
MAX_RETRY_AFTER_S = 3600.0  # an engine's longer (or infinite) Retry-After is taken as this
KEEPALIVE_COMMENT = b": keep-alive\n\n"  # an SSE comment: clients ignore it (WHATWG SSE spec)
# Every error event holds this JSON string (OpenAI's `{"error": ...}`, Anthropic's and the Responses
# API's `"type":"error"`, `response.failed`'s `"error"`); generated text cannot (its quotes are escaped).
ERROR_KEY = b'"error"'
MAX_PARTIAL_EVENT = 1 << 20  # before any content: more bytes of small content-less events fail over
LONG_EVENT = 64 * 1024  # an unfinished event past this is held in a growing buffer (linear, not copied per read)
MAX_EVENT = 64 << 20  # the longest SSE event a stream relays by default (`max_body_bytes`'s default)


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
    MOVED = "moved"  # its worker failed a health probe before answering: the request went elsewhere


RETRYABLE = frozenset({Outcome.CONNECT_ERROR, Outcome.TIMEOUT, Outcome.PROTOCOL_ERROR, Outcome.STATUS_5XX,
                       Outcome.STATUS_429, Outcome.MOVED})


class AttemptFailed(Exception):
    """An attempt failed before anything reached the client. `status`/`body` are the engine's answer
    when it gave one (4xx/5xx), `retry_after` its Retry-After header in seconds, `headers` the
    engine's `x-ratelimit-*` headers of a 429 (lower-case names), passed on to the client, and
    `answered` whether the engine had sent its response headers (it was working on the request)."""

    def __init__(self, outcome: Outcome, detail: str, status: int | None = None, body: bytes = b"",
                 retry_after: float | None = None, headers: dict[str, str] | None = None,
                 answered: bool = False) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.status = status
        self.body = body
        self.retry_after = retry_after
        self.headers = headers or {}
        self.answered = answered


class Ticket(Protocol):
    """What a lease closes with its slot besides a prefill ticket: a flow-controlled pool's count
    of a request not yet started on its worker (gateway/flow/saturation.py `StartTicket`)."""

    def close(self) -> None: ...


class Lease:
    """One leg's slot: this replica's in-flight count on a worker and (`counted`) a slot of its
    pool, taken at creation and released exactly once (`release`, idempotent). Owned by a
    `Holding`. A PD attempt's prefill leg is not `counted`: a pool's `max_in_flight` counts requests.
    `prefill` (a cost-aware policy's prefill ticket) and `started` (a flow-controlled pool's
    not-started count) are closed with it: a request that ends or fails before its first byte has
    no prefill pending and is not waiting on its worker any more."""

    __slots__ = ("_adapter", "_gate", "_metrics", "_prefill", "_released", "_started", "worker")

    def __init__(self, worker: Worker, metrics: GatewayMetrics, gate: PoolGate, counted: bool = True,
                 prefill: PrefillTicket | None = None, adapter: str | None = None,
                 started: Ticket | None = None) -> None:
        self.worker = worker
        self._metrics = metrics
        self._gate = gate if counted else None
        self._prefill = prefill
        self._started = started
        self._adapter = adapter
        self._released = False
        worker.in_flight += 1
        if adapter is not None:  # the LoRA adapter is in use here: never unloaded meanwhile (lora_loader)
            worker.adapter_in_flight[adapter] = worker.adapter_in_flight.get(adapter, 0) + 1
            worker.adapter_used_at[adapter] = time.monotonic()
        if counted:
            gate.acquired()
        metrics.worker_in_flight(worker.pool, worker.id, 1)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.worker.in_flight -= 1
            if self._adapter is not None:
                _adapter_done(self.worker, self._adapter)
            if self._gate is not None:
                self._gate.released()
            self._metrics.worker_in_flight(self.worker.pool, self.worker.id, -1)
            if self._prefill is not None:
                self._prefill.close()
            if self._started is not None:
                self._started.close()


def _adapter_done(worker: Worker, adapter: str) -> None:
    """One request naming LoRA `adapter` on `worker` ended: counted down, its last use now."""
    left = worker.adapter_in_flight.get(adapter, 0) - 1
    if left > 0:
        worker.adapter_in_flight[adapter] = left
    else:
        worker.adapter_in_flight.pop(adapter, None)
    worker.adapter_used_at[adapter] = time.monotonic()


class Closable(Protocol):
    """What a Holding closes: an upstream response, or a leg that owns one (`aclose()` idempotent)."""

    def aclose(self) -> Awaitable[None]: ...


Closed = TypeVar("Closed", bound=Closable)


class Holding:
    """Everything an attempt holds, released together on every exit path: the slots of its legs
    (`Lease`, one per worker it uses) and the upstream responses it opened.

    One owner at a time: the attempt holds it while it waits for the engine; on success `hand_over()`
    moves the whole content into a new Holding for the next owner (the `UpstreamStream` that relays
    the answer) and leaves this one empty, so the attempt's own cleanup (`if holding: await
    holding.aclose()`) then has nothing to release. `aclose()` frees the slots first (a waiter may
    take one), then closes the responses (which makes an engine abort an unfinished request); it is
    idempotent, and closing a response twice is harmless (`first_content` may have closed it).
    """

    __slots__ = ("_leases", "_responses")

    def __init__(self) -> None:
        self._leases: list[Lease] = []
        self._responses: list[Closable] = []

    def __bool__(self) -> bool:
        """Whether anything is still held (a cheap test before awaiting `aclose`)."""
        return bool(self._leases or self._responses)

    def lease(self, worker: Worker, metrics: GatewayMetrics, gate: PoolGate, counted: bool = True,
              prefill: PrefillTicket | None = None, adapter: str | None = None,
              started: Ticket | None = None) -> Lease:
        """Take a slot on `worker` (and, `counted`, one of its pool's `gate`; `prefill`: the
        request's prefill ticket, `started`: its flow-controlled pool's not-started count, both
        closed with the slot; `adapter`: the LoRA adapter the request names, counted in use
        there), held until this Holding is closed."""
        lease = Lease(worker, metrics, gate, counted, prefill, adapter, started)
        self._leases.append(lease)
        return lease

    def opened(self, response: Closed) -> Closed:
        """Hold an upstream response just opened, or another leg's closable (a PD prefill leg's
        task), closed with this Holding; returns it."""
        self._responses.append(response)
        return response

    def hand_over(self) -> Holding:
        """Move everything held to a new Holding (the next owner's) and hold nothing from now on."""
        moved = Holding()
        moved._leases, self._leases = self._leases, []
        moved._responses, self._responses = self._responses, []
        return moved

    def aclose(self) -> Awaitable[None]:
        """Release the slots now; return the closing of the responses, to await at once (a single
        response's own `aclose()`, so a Holding adds no coroutine of its own to the request path).
        Empty afterwards. Closing the responses goes on when one of them fails to close."""
        leases, self._leases = self._leases, []
        responses, self._responses = self._responses, []
        for lease in leases:
            lease.release()
        return responses[0].aclose() if len(responses) == 1 else _close_all(responses)


async def _close_all(responses: list[Closable]) -> None:
    """Close every response (a two-leg attempt's), raising the first failure after trying all."""
    failure: Exception | None = None
    for response in responses:
        try:
            await response.aclose()
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def _classify_transport_error(exc: BaseException) -> Outcome:
    if is_connect_error(exc):
        return Outcome.CONNECT_ERROR
    if is_timeout(exc):
        return Outcome.TIMEOUT
    return Outcome.PROTOCOL_ERROR


def _retry_after(response: UpstreamResponse) -> float | None:
    """An engine's Retry-After in seconds, 0..MAX_RETRY_AFTER_S: delay-seconds or an HTTP-date
    (RFC 9110 §10.2.3; proxies in front of engines send dates); None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if math.isnan(seconds):
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


def _describe(exc: BaseException) -> str:
    """A transport error as a failure's detail: a decoding failure's own words, else its class."""
    return str(exc) if isinstance(exc, DecodeError) else type(exc).__name__


async def _read_error(response: UpstreamResponse) -> bytes:
    """An error answer's body (at most ERROR_BODY_LIMIT bytes, decoded, secrets redacted); empty
    when its content coding cannot be decoded (its bytes are never shown)."""
    body = bytearray()
    try:
        async for chunk in response.chunks():
            body += chunk
            if len(body) >= ERROR_BODY_LIMIT:
                break
    except TransportError:
        pass
    except UnsupportedEncoding:
        return b""
    return response.redact(bytes(body))[:ERROR_BODY_LIMIT]


async def open_upstream(client: UpstreamClient, url: str, body: bytes, headers: dict[str, str],
                        timeout: UpstreamTimeouts, pool: str | None = None) -> UpstreamResponse:
    """POST `body` (on `pool`'s connections) and return the response once 2xx headers arrived
    (body not read yet).

    Raises AttemptFailed: transport errors, 5xx, 429, the engine's "context too long", other 4xx,
    a 200 whose content coding the gateway cannot decode (protocol_error, before any body byte).
    """
    try:
        response = await client.post(url, body, headers, timeout, pool)
    except TransportError as exc:
        raise AttemptFailed(_classify_transport_error(exc), f"{type(exc).__name__} from {url}") from exc
    status = response.status_code
    if status == 200:
        if "content-encoding" in response.headers:
            try:
                response.codings()
            except UnsupportedEncoding as exc:
                await response.aclose()
                raise AttemptFailed(Outcome.PROTOCOL_ERROR, str(exc), answered=True) from None
        return response
    try:
        error_body = await _read_error(response)
    finally:
        await response.aclose()
    if status < 400:  # 204, redirects...: not an answer we can relay
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered HTTP {status}", status, error_body)
    if status == 429:
        limits = {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-ratelimit-")}
        raise AttemptFailed(Outcome.STATUS_429, "engine is rate limiting (429)", status, error_body,
                            _retry_after(response), limits)
    if status >= 500:
        raise AttemptFailed(Outcome.STATUS_5XX, f"engine answered HTTP {status}", status, error_body,
                            _retry_after(response))
    if is_context_too_long(status, error_body):
        raise AttemptFailed(Outcome.TOO_LONG, "engine says the prompt is too long", status, error_body)
    if status in (401, 403, 407):  # the gateway's engine credentials, not the client's fault
        raise AttemptFailed(Outcome.AUTH_ERROR, f"engine refused the gateway's credentials ({status})", status,
                            error_body)
    raise AttemptFailed(Outcome.CLIENT_ERROR, f"engine answered HTTP {status}", status, error_body)


async def first_chunk(response: UpstreamResponse) -> tuple[bytes, AsyncIterator[bytes]]:
    """Wait for the first body bytes of an accepted response: `(first, rest)`.

    Raises AttemptFailed (and closes the response) if the engine fails or ends before sending any.
    """
    chunks = response.chunks()
    try:
        first = await anext(chunks, b"")
    except TransportError as exc:
        await response.aclose()
        raise AttemptFailed(_classify_transport_error(exc), f"{_describe(exc)} before the first byte",
                            answered=True) from exc
    except BaseException:
        await response.aclose()
        raise
    if not first:
        await response.aclose()
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, "engine answered 200 with an empty body", answered=True)
    return first, chunks


class Held(StrEnum):
    """What one SSE event of a stream that has shown no content yet says."""

    EMPTY = "empty"  # nothing for the client yet: a role-only or empty delta, a comment
    CONTENT = "content"  # content, reasoning, a tool call, a finish, usage, [DONE], or a shape we do not know
    ERROR = "error"  # an error object


_EMPTY_VALUES: tuple[object, ...] = (None, "", [], {})
# Anthropic's stream opens with `message_start` (the message shell and input usage) and `ping`s:
# nothing for the client yet. Content starts with the first `content_block_start` (text, thinking
# or tool_use); an `error` event is an error (https://docs.claude.com/en/docs/build-with-claude/streaming).
_ANTHROPIC_EMPTY = frozenset({"message_start", "ping"})


def classify_event(event: bytes | bytearray) -> tuple[Held, bytes]:
    """Whether one SSE event (its lines, without the blank line) carries anything for the client:
    `(verdict, data)` where data is its joined `data:` payload.

    Content-less: comments only (`: keep-alive`), or chunks whose every choice has no finish
    reason, no `text`, and a delta of `role` and empty fields only (content, reasoning, tool calls:
    null, "", [] or {}; OpenAI's chat chunk format, and vLLM and SGLang open a stream with
    `{"role": "assistant", "content": ""}`); Anthropic's `message_start` and `ping` events. Anything
    else counts as content (Anthropic's from its first `content_block_start`), so an unknown shape
    is never held back.
    """
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return Held.EMPTY, data
    if data.strip() == b"[DONE]":
        return Held.CONTENT, data
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Held.CONTENT, data
    if not isinstance(chunk, dict):
        return Held.CONTENT, data
    if "error" in chunk:
        return Held.ERROR, data
    kind = chunk.get("type")
    if kind is not None and "choices" not in chunk:
        # Anthropic's events (content from the first block on) and the Responses API's (protocol/responses.py)
        if kind in _ANTHROPIC_EMPTY or kind in PREAMBLE_EVENTS:
            return Held.EMPTY, data
        return (Held.ERROR if kind in ERROR_EVENTS else Held.CONTENT), data
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or chunk.get("usage") not in (None, {}):
        return Held.CONTENT, data  # `choices: []` is the usage chunk at the end
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return Held.CONTENT, data
        if choice.get("text") not in _EMPTY_VALUES:
            return Held.CONTENT, data
        delta = choice.get("delta")
        if delta is None:
            continue
        if not isinstance(delta, dict) or any(value not in _EMPTY_VALUES for key, value in delta.items()
                                              if key != "role"):
            return Held.CONTENT, data
    return Held.EMPTY, data


async def first_content(response: UpstreamResponse, hold: float | None, sse: bool,
                        max_event: int = MAX_EVENT) -> tuple[bytes, AsyncIterator[bytes], bool]:
    """Read a stream until its first content, holding what comes before: `(held, rest, content)`.

    `held` is every byte read so far, unchanged; `content` is False when `hold` seconds passed
    first (a long prefill: the caller commits the response and relays the rest). Events without
    content (`classify_event`) are held so that an engine that fails before its first token fails
    over to another worker unseen by the client. A non-SSE body counts its first byte as content.

    Token-level data before the first token is output (`_scan`: an event over LONG_EVENT bytes;
    vLLM's first chat chunk carries the prompt's `prompt_token_ids` with `return_token_ids`,
    `vllm/entrypoints/openai/chat_completion/serving.py`, its completions chunk with `echo` and
    `prompt_logprobs` a record per prompt token, `vllm/entrypoints/openai/completion/serving.py`):
    the worker answered, so the response is committed and never tried on another worker. One event
    that has not ended yet is held whole up to `max_event` bytes (the relay's own bound); past it
    EventTooLarge (the response closed): the worker sent what the request asked for, or a line
    without end; either way no other worker is to repeat it.

    Raises AttemptFailed (and closes the response) when the engine fails, ends or sends an error
    event before any content, or over `MAX_PARTIAL_EVENT` bytes of small events without content (a
    flood of comments or empty chunks); an error saying the prompt is too long is Outcome.TOO_LONG.
    """
    chunks = response.chunks()
    held: bytes | bytearray = b""  # a bytearray once it holds over LONG_EVENT bytes (appends in place)
    scanned = 0
    try:
        try:
            async with asyncio.timeout(hold) as window:
                while True:
                    chunk = await anext(chunks, b"")
                    if not chunk:
                        if held and sse and _scan(held, scanned, len(held), response.redact):
                            return _taken(held), chunks, True  # a whole answer whose last event lacks its blank line
                        raise AttemptFailed(Outcome.PROTOCOL_ERROR, "engine ended the stream before any content"
                                            if held else "engine answered 200 with an empty body", answered=True)
                    seam = max(scanned, len(held) - 3)  # an event's end (up to 4 bytes) may straddle the reads
                    if type(held) is bytes and len(held) + len(chunk) > LONG_EVENT:
                        held = bytearray(held)
                    held += chunk
                    if not sse:
                        return _taken(held), chunks, True
                    end = event_end(held, start=seam)
                    if end > scanned:
                        if _scan(held, scanned, end, response.redact):
                            return _taken(held), chunks, True
                        scanned = end
                    if scanned > MAX_PARTIAL_EVENT:  # a flood of content-less events: fail over
                        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine sent {scanned} bytes of events "
                                            "without content", answered=True)
                    if len(held) - scanned > max_event:  # one event past the relay's bound (or a line without end)
                        raise EventTooLarge(len(held) - scanned)
        except TimeoutError:
            if window.expired():
                return _taken(held), chunks, False
            raise
    except TransportError as exc:
        await response.aclose()
        raise AttemptFailed(_classify_transport_error(exc), f"{_describe(exc)} before any content",
                            answered=True) from exc
    except BaseException:
        await response.aclose()
        raise


def _taken(held: bytes | bytearray) -> bytes:
    """What `first_content` held, as bytes; a bytearray is emptied (its memory freed at once)."""
    if not isinstance(held, bytearray):
        return held
    data = bytes(held)
    held.clear()
    return data


_EVENT_BREAK = re.compile(rb"\r?\n\r?\n")


def _scan(data: bytes | bytearray, start: int, end: int, redact: Redactor) -> bool:
    """True when an event of `data[start:end]` has content; raises AttemptFailed on an error event
    (its payload with `redact`'s secrets taken out).

    Looks at one event at a time and stops at the first with content: an engine's first read often
    holds the whole answer, and splitting all of it cost ~10 % of the relay's CPU. An event over
    LONG_EVENT bytes counts as content whatever it says (a role chunk carrying token-level data is
    the worker's output: the response is committed); one over MAX_PARTIAL_EVENT bytes is not even
    parsed (its objects would take many times its size)."""
    pos = start
    while pos < end:
        brk = _EVENT_BREAK.search(data, pos, end)
        stop = brk.start() if brk else end
        if stop - pos > MAX_PARTIAL_EVENT:
            return True
        verdict, payload = classify_event(data[pos:stop])
        if verdict is Held.CONTENT or (verdict is Held.EMPTY and stop - pos > LONG_EVENT):
            return True
        if verdict is Held.ERROR:
            raise _error_event(redact(payload))
        if brk is None:
            break
        pos = brk.end()
    return False


def _error_event(payload: bytes) -> AttemptFailed:
    """The failure an engine's in-stream error event (before any content) stands for.

    Some engines (SGLang before 2026) validate a streaming request only after sending 200 headers;
    the error then arrives as `data: {"error": ...}`. "Context too long" is retried like a 400; an
    error with a 4xx `code` is the engine's answer to the request; anything else fails over.
    """
    if is_context_too_long(400, payload):
        return AttemptFailed(Outcome.TOO_LONG, "engine says the prompt is too long (in-stream error)", 400, payload,
                             answered=True)
    error = orjson.loads(payload).get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if code is None and isinstance(error, dict):  # Anthropic's error event names its type, not a status
        code = ERROR_STATUS.get(error.get("type"))  # type: ignore[arg-type]
    if isinstance(code, int) and 400 <= code < 500 and code not in (401, 403, 407, 429):
        return AttemptFailed(Outcome.CLIENT_ERROR, f"engine answered with an in-stream error {code}", code, payload,
                             answered=True)
    return AttemptFailed(Outcome.PROTOCOL_ERROR, "engine sent an error event before any content: "
                         + payload[:200].decode("utf-8", "replace"), answered=True)


class AnswerTooLarge(ValueError):
    """A non-streaming answer grew past the gateway's buffer limit (`max_body_bytes`): the request
    asked for that much (huge `n`, a batch of prompts), so it is not the worker's fault."""


async def read_rest(response: UpstreamResponse, first: bytes, chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The whole body of a non-streaming response, given its first chunk.

    Raises TransportError if the engine fails midway, AnswerTooLarge above `limit` bytes (DecodeError
    when they are the decoded bytes of a content coding the engine applied unasked: its fault).
    """
    body = bytearray(first)
    async for chunk in chunks:
        if len(body) > limit:
            break
        body += chunk
    if len(body) > limit:
        if "content-encoding" in response.headers and response.codings():
            raise DecodeError(f"the engine's encoded answer decodes to more than {limit} bytes (max_body_bytes)")
        raise AnswerTooLarge(f"engine response is larger than {limit} bytes")
    return bytes(body)


class EventTooLarge(Exception):
    """An engine's unfinished SSE event grew past the relay's limit (`UpstreamStream`'s `max_event`)."""


def _grow(long: bytearray, chunk: bytes, limit: int) -> tuple[bytearray | None, bytes, bytes]:
    """An unfinished event held in `long` (over `LONG_EVENT` bytes) and the `chunk` read after it:
    `(long, carry, events)`: the unfinished event still held (None once it ended), the small rest
    after the last event's end, and the whole events to relay now. Raises EventTooLarge when the
    event passes `limit` bytes without ending. Once the event ended, `long` is emptied (its memory
    freed at once, not when the caller drops it): the event is then held once, as `events`."""
    seam = max(0, len(long) - 3)  # an event's end (up to 4 bytes) may straddle the two
    long += chunk
    end = event_end(long, start=seam)
    if not end:
        if len(long) > limit:
            raise EventTooLarge(len(long))
        return long, b"", b""
    with memoryview(long) as view:
        events, rest = bytes(view[:end]), bytes(view[end:])
    long.clear()
    if len(rest) > LONG_EVENT:
        return bytearray(rest), b"", events
    return None, rest, events


def cut_events(carry: bytes, long: bytearray | None, chunk: bytes, limit: int) -> tuple[bytes, bytearray | None, bytes]:
    """One read of an SSE body cut at its last event end, as `UpstreamStream.body` cuts it, for
    another relay (the stored-response replay): given the unfinished event so far (`carry`, or
    `long` once over LONG_EVENT bytes, held in place by `_grow`) and the next `chunk`, returns
    `(carry, long, events)`: the unfinished event now and the whole events to relay. Raises
    EventTooLarge when the unfinished event passes `limit` bytes."""
    if long is not None:
        long, carry, events = _grow(long, chunk, limit)
        return carry, long, events
    data = carry + chunk if carry else chunk
    end = event_end(data)
    if end == len(data):
        return b"", None, data
    if len(data) - end > LONG_EVENT:
        with memoryview(data) as view:
            long = bytearray(view[end:])
        if len(long) > limit:
            raise EventTooLarge(len(long))
        return b"", long, data[:end]
    return data[end:], None, data[:end]


class _InBandError(Exception):
    """An engine's error event mid-stream, to continue after (args[0]: that event and what followed)."""


class Migrating(Protocol):
    """What a stream asks of its migration (`gateway.dispatch.migration.Migration`)."""

    @property
    def progress(self) -> Any: ...

    def ready(self) -> bool: ...

    def resume(self, why: str) -> Awaitable[Continuing | None]: ...

    def relay(self, stream: Continuing) -> AsyncIterator[bytes]: ...

    def seam(self) -> bytes: ...

    def settled(self, continued: dict[str, Any] | None) -> dict[str, Any] | None: ...


class Continuing(Protocol):
    """A stream an answer goes on in after a migration: an `UpstreamStream`, or a PD pool's
    `DeferredStream` (committed before its decode leg opened, `gateway/dispatch/pd/deferred.py`),
    which hands `migration` and `continuation` to its decode stream when that opens."""

    migration: Migrating | None
    continuation: bool

    def body(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def error_event_at(events: bytes) -> int:
    """Where in whole SSE events the first one holding an error object (`data: {"error": ...}`)
    starts; -1 when none does."""
    pos = 0
    while pos < len(events):
        brk = _EVENT_BREAK.search(events, pos)
        end = brk.start() if brk else len(events)
        event = events[pos:end]
        if ERROR_KEY in event:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and ERROR_KEY in line:
                    try:
                        data = orjson.loads(line[5:].strip())
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(data, dict) and "error" in data:
                        return pos
        if brk is None:
            break
        pos = brk.end()
    return -1


class UpstreamStream:
    """An accepted streaming response: the bytes held before it was accepted, then the rest,
    relayed as bytes.

    `waiting` says the response was committed before the engine's first content (a prefill longer
    than `timeouts.hold_headers`): until its next byte arrives, an SSE comment goes out every
    `keepalive_interval` seconds (None: none). Owns the attempt's `Holding` (its slots and the
    upstream `response`, among any other legs' responses); `aclose()` (idempotent, also safe when
    the body was never iterated) releases them all. `max_event`: the longest SSE event relayed
    (bytes; an unfinished event is held until its end, and one growing past this ends the stream
    with an SSE error event). Facts for the request's `ledger` (gateway/dispatch/ledger.py), reported
    once per stream, never per chunk: the first byte after a wait, a broken end, the usage at the end;
    `on_end` gets the engine's verdict (None: a whole answer, else why it failed). `gap`: the
    longest engine silence (seconds) once content flows (`timeouts.read`; None: the request's own
    read timeout, which also allows a prefill).
    """

    def __init__(self, response: UpstreamResponse, first: bytes, rest: AsyncIterator[bytes], holding: Holding,
                 ledger: Ledger, waiting: bool = False, keepalive_interval: float | None = None,
                 on_end: Callable[[str | None], None] | None = None, strip_usage: bool = False,
                 max_event: int = MAX_EVENT, cache_in_input: bool = False, api: str | None = None,
                 gap: float | None = None) -> None:
        self.response = response
        self._gap = gap
        if gap is not None and not waiting:
            response.content_started(gap)
        self._max_event = max_event
        self._on_end = on_end
        self._aborted: str | None = None
        self._first = first
        self._waiting = waiting
        self._keepalive = keepalive_interval
        self._rest = rest
        self._holding = holding
        self._ledger = ledger
        self._api = api or ledger.record.api  # the engine's API (a migration may continue on another)
        self._closed = False
        self.tap = SSETap(self._api, cache_in_input)
        self.sse = response.headers.get("content-type", "").startswith("text/event-stream")
        self._strip_usage = strip_usage and self.sse  # the usage patch's second half (backends/patches.py)
        self._redact = response.redact if response.redact else None
        self.migration: Migrating | None = None  # set by the dispatch: a failure may continue elsewhere
        self._next: Continuing | None = None  # the continuation this stream's answer went on in
        self.continuation = False  # this stream continues another one's answer (relayed by its migration)

    async def body(self) -> AsyncIterator[bytes]:
        """Yield the upstream bytes unchanged (but for the usage patch's own chunk when
        `strip_usage`), cut only at SSE event ends.

        Whole events pass as soon as their last byte arrives (an engine that writes one event
        per write is relayed write for write); a partial event waits for its end, so a failure
        mid-event never leaves the client a corrupt event. A failure, an end without
        `data: [DONE]`, or an event longer than `max_event` bytes (a line that never ends) is
        reported with one SSE error event and no `[DONE]`; with a `migration` (set by the dispatch on
        a chat or completions stream) such a failure, or the engine's in-band error event, is
        continued on another worker instead when it can be (`_continue`,
        gateway/dispatch/migration.py): the client reads one answer. A non-SSE body passes through as it
        arrives. Events that carry an error (`ERROR_KEY`) have the config's secrets
        taken out.
        """
        tap = self.tap
        redact = self._redact
        migration = self.migration
        keep = migration.progress.keep if migration is not None else None
        carry = b""
        long: bytearray | None = None  # an unfinished event over LONG_EVENT bytes (`_grow`)
        try:
            for_client, self._first = self._first, b""  # held here only (a large first read is freed with it)
            chunks = self._rest
            waiting = self._waiting
            while True:
                if for_client:
                    tap.feed(for_client)
                    if self.sse:
                        if long is not None:
                            long, carry, for_client = _grow(long, for_client, self._max_event)
                        else:
                            data = carry + for_client if carry else for_client
                            end = event_end(data)
                            if end < len(data):
                                if len(data) - end > LONG_EVENT:  # held in place from here (`_grow`)
                                    with memoryview(data) as view:
                                        long, carry = bytearray(view[end:]), b""
                                else:
                                    carry = data[end:]
                                for_client = data[:end]
                            else:
                                carry, for_client = b"", data
                            data = b""
                        if for_client:
                            for_client = self._patched(for_client)
                        if keep is not None and for_client:
                            if ERROR_KEY in for_client and (cut := error_event_at(for_client)) >= 0:
                                assert migration is not None
                                keep(for_client[:cut])
                                if migration.ready():  # relay what came before it, then continue elsewhere
                                    if cut:
                                        head = for_client[:cut]
                                        yield redact(head) if redact is not None and ERROR_KEY in head else head
                                    raise _InBandError(for_client[cut:])
                                keep(for_client[cut:])
                            else:
                                keep(for_client)
                    if redact is not None and ERROR_KEY in for_client:
                        for_client = redact(for_client)
                    if for_client:
                        yield for_client
                if waiting:  # a long prefill: keep idle proxies from cutting the stream
                    waiting = False
                    pending = asyncio.ensure_future(anext(chunks, b""))
                    try:
                        while not pending.done():
                            await asyncio.wait((pending,), timeout=self._keepalive if self.sse else None)
                            if not pending.done():
                                yield KEEPALIVE_COMMENT
                    finally:
                        if not pending.done():
                            pending.cancel()
                    for_client = pending.result()
                    self._ledger.first_byte()
                    if self._gap is not None:
                        self.response.content_started(self._gap)
                else:
                    for_client = await anext(chunks, b"")
                if not for_client:
                    break
            if long is not None:
                carry = bytes(long)
            tap.end()
            if self.sse and not tap.done:
                if migration is not None and migration.ready():
                    async for part in self._continue("the engine ended the stream early", None):
                        yield part
                    return
                if tap.failed and not carry:  # the engine's own error event was the client's last: no second one
                    self._broken("the engine ended the stream with an error event")
                else:
                    self._broken("the stream ended without its last event (data: [DONE] or event: message_stop)")
                    yield sse_error_event("The inference server ended the stream early; the response is "
                                          "incomplete.", api=self._api)
            else:
                if carry:  # a complete answer whose last event lacks its blank line: pass it on as it is
                    yield self._tail(carry)
                self._ended(None)
        except _InBandError as exc:
            async for part in self._continue("the engine sent an error event mid-stream", exc.args[0]):
                yield part
        except EventTooLarge:
            self._broken(f"an SSE event of over {self._max_event} bytes without its end")
            yield sse_error_event(f"The inference server sent an event longer than the gateway relays "
                                  f"({self._max_event} bytes); the response is incomplete.", api=self._api)
        except TransportError as exc:
            if long is not None:
                carry = bytes(long)
            if tap.done:
                if carry:
                    yield self._tail(carry)
                self._ended(None)
                return  # the answer was complete; only the connection's end was untidy
            if migration is not None and not self._aborted and migration.ready():
                async for part in self._continue(f"{_describe(exc)} mid-stream after {tap.events} events", None):
                    yield part
                return
            self._broken(f"{_describe(exc)} mid-stream after {tap.events} events")
            if tap.failed and not carry:  # the engine said why before it went: no second error event
                return
            why = self._aborted or f"The inference server failed mid-stream ({_describe(exc)})"
            yield sse_error_event(f"{why}; the response is incomplete.", api=self._api)
        finally:
            await self.aclose()

    async def _continue(self, why: str, engine_error: bytes | None) -> AsyncIterator[bytes]:
        """Go on in a continuation on another worker (`Migration.resume`) after this worker failed
        (`why`, held against it; its slot and response released first); without one, end as
        without migration: the engine's own error event (`engine_error`) or the gateway's."""
        assert self.migration is not None
        self._ended(why)
        await self._holding.aclose()
        stream = await self.migration.resume(why)
        if stream is None:
            self._broken(why)
            if engine_error is not None:
                yield self._redact(engine_error) if self._redact is not None else engine_error
            else:
                yield sse_error_event(f"The inference server failed mid-stream ({why}); the response is "
                                      "incomplete.", api=self._api)
            return
        self._next = stream
        if self.continuation:  # the migration's relay of this stream rewrites the next one's events too
            yield self.migration.seam()
            async for part in stream.body():
                yield part
            return
        async for part in self.migration.relay(stream):
            yield part

    def _patched(self, events: bytes) -> bytes:
        """Whole events as the client gets them: without the usage patch's own bytes when it is on."""
        return drop_usage_events(events) if self._strip_usage else events

    def _tail(self, carry: bytes) -> bytes:
        """The last, unfinished event as the client gets it (patched, an error's secrets out)."""
        carry = self._patched(carry)
        return self._redact(carry) if self._redact is not None and ERROR_KEY in carry else carry

    async def abort(self, why: str) -> None:
        """End the upstream response on the gateway's own decision (another leg of the attempt
        failed): the relay ends with one SSE error event saying `why`, and this worker is not
        blamed (no verdict is reported)."""
        self._on_end = None
        self._aborted = why
        await self.response.aclose()

    def _broken(self, detail: str) -> None:
        self._ledger.stream_broken(f"{self._aborted} ({detail})" if self._aborted else detail)
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
        try:
            await self._holding.aclose()
        finally:
            if self._next is None:
                self._ledger.stream_usage(self.tap.usage)
        if self._next is not None and self.migration is not None and not self.continuation:
            # the answer's usage: the last continuation's, made the whole answer's once
            await self._next.aclose()
            self._ledger.migrated_usage(self.migration.settled(self._ledger.record.usage))
