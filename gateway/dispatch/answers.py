"""What the dispatch gives the request path back: a buffered answer or an accepted stream, and the
shapes of the answers it builds itself (an engine's own error, the route headers).

`BufferedResponse` is a complete answer (errors, non-streaming answers); `RelayResponse` an accepted
upstream stream to relay. The checks of an engine's 200 (its content type, a non-streaming
answer's JSON) live here too: they decide what the client may be shown. (A content coding the
engine applied is undone, or refused, by the engine client: backends/encoding.py.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.backends.client import UpstreamResponse
from gateway.dialects.registry import dialect_for
from gateway.dispatch.ledger import Ledger
from gateway.observability.record import RequestRecord
from gateway.protocol.responses import response_id_of
from gateway.streaming import AttemptFailed, Outcome, UpstreamStream

# A 504 after the whole answer budget: a client retry would repeat the same long generation. The
# OpenAI SDKs honour this header (their `_should_retry` reads `x-should-retry` before the status).
NO_CLIENT_RETRY = {"x-should-retry": "false"}

Headers = list[tuple[bytes, bytes]]

SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = b"application/json"


@dataclass(slots=True)
class BufferedResponse:
    """A complete answer: status, headers (lower-case names) and body bytes."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: Headers = field(default_factory=list)


class RelayStream(Protocol):
    """What the relay needs of an accepted stream: its bytes (`body()`, to iterate once), `aclose()`
    (idempotent: releases every slot and upstream response it owns) and whether it is SSE. An
    `UpstreamStream`, or a PD `DeferredStream` (committed before its decode leg opened)."""

    sse: bool

    def body(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class RelayResponse:
    """An accepted upstream stream (HTTP 200) to relay: the stream that owns the upstream, headers."""

    stream: UpstreamStream | RelayStream
    content_type: bytes = b"text/event-stream"
    headers: Headers = field(default_factory=list)


def route_headers(record: RequestRecord) -> Headers:
    """The `x-kimi-gateway-*` headers that tell the client where its request went and why."""
    headers = [(b"x-kimi-gateway-pool", record.pool.encode()),
               (b"x-kimi-gateway-attempts", str(record.attempts).encode())]
    if record.worker:
        headers.append((b"x-kimi-gateway-worker", record.worker.encode()))
    if record.prefill_worker:  # a PD pool: both legs' workers
        headers.append((b"x-kimi-gateway-prefill-worker", record.prefill_worker.encode()))
        if record.worker:
            headers.append((b"x-kimi-gateway-decode-worker", record.worker.encode()))
    if record.reason:
        headers.append((b"x-kimi-gateway-route-reason", record.reason.encode()))
    if record.skipped_pools:  # they fit, but their engines do not serve the request's API
        headers.append((b"x-kimi-gateway-skipped-pools", ", ".join(record.skipped_pools).encode()))
    if record.estimated_prompt_tokens is not None:
        headers.append((b"x-kimi-gateway-estimated-prompt-tokens",
                        f"{record.estimated_prompt_tokens}; method={record.estimate_method}".encode()))
    return headers


def engine_error(failure: AttemptFailed, ledger: Ledger, error: str | None = None) -> BufferedResponse:
    """Pass an engine's own 4xx answer to the client, as its API's error object
    (`Dialect.engine_error_bytes`: OpenAI's, Anthropic's on Messages; `error`: the log's words for
    it, else the failure's detail). An engine's "too long" names the request's prompt as `param`
    (`Dialect.prompt_param`: `messages`, `prompt` on completions, `input` on Responses), as OpenAI's
    context_length_exceeded does; the engines name other things or nothing."""
    status = failure.status or 502
    ledger.error_answer(status, failure.detail if error is None else error)
    record = ledger.record
    too_long = failure.outcome is Outcome.TOO_LONG
    dialect = dialect_for(record.api)
    param = dialect.prompt_param if too_long else None
    body = dialect.engine_error_bytes(status, failure.body, "context_length_exceeded" if too_long else None, param,
                                      record.request_id)
    return BufferedResponse(status, body, b"application/json", route_headers(record))


def request_fault(failure: AttemptFailed, ledger: Ledger) -> BufferedResponse:
    """The engine's error for a request two workers failed the same way: passed on as the
    engine gave it, with `x-should-retry: false` (the OpenAI SDKs then do not resend it)."""
    response = engine_error(failure, ledger, f"two workers failed the request the same way ({failure.detail}): "
                                             "the request's fault")
    response.headers.append((b"x-should-retry", b"false"))
    return response


def relayed_content_type(response: UpstreamResponse, stream: bool) -> bytes:
    """The content type the client gets for an engine's 200: the API's own (`text/event-stream` for a
    stream, `application/json` otherwise), never the engine's text. Raises AttemptFailed
    (protocol_error: tried elsewhere, held against the worker) for any other declared type, so an
    engine's `text/html` is never served from the gateway's origin."""
    declared = response.headers.get("content-type", "" if stream else "application/json")
    if declared.partition(";")[0].strip().lower() == ("text/event-stream" if stream else "application/json"):
        return SSE_CONTENT_TYPE if stream else JSON_CONTENT_TYPE
    raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered 200 with content type {declared[:60]!r}")


def json_answer_usage(content: bytes, content_type: bytes, api: str,
                      cache_in_input: bool = False) -> dict[str, Any] | None:
    """The usage of a non-streaming JSON answer of `api`, in the chat names (`Dialect.answer_usage`);
    ValueError when the JSON is cut or broken. `cache_in_input`: an Anthropic usage counts the cached
    prompt inside `input_tokens` (`EngineSpec.messages_cache_in_input`)."""
    if b"json" not in content_type:
        return None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"its JSON answer is incomplete or invalid: {exc}") from None
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    return dialect_for(api).answer_usage(usage, cache_in_input)


def response_id_in_json(body: bytes) -> str | None:
    """The `id` of a Responses API JSON answer; None when there is none or it is not JSON."""
    try:
        return response_id_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
