"""`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: forwarded
to the worker that stores the response (gateway/routing/response_affinity.py), its answer relayed.

What the engines serve (their own routers): vLLM and SGLang answer GET (the stored response; 404
`Response with id '…' not found.` for an unknown id) and POST …/cancel (a `background` response
that is queued or in progress; 400 for any other); neither serves DELETE (FastAPI's 405
`{"detail": "Method Not Allowed"}`: vLLM 0.32 `vllm/entrypoints/openai/responses/api_router.py` has
GET and POST …/cancel only; the simulator answers so too unless `SimConfig.responses_delete`), which
OpenAI serves (`{"id", "object": "response", "deleted": true}`). llama.cpp's
server stores nothing (404 for every id), so the gateway records no ids for its pools.

DELETE forgets the gateway's record when the engine deleted the response (2xx) or no longer knows
it (404); otherwise (a 405 from an engine that cannot delete) the record stays, since the engine
still holds the response and GET still finds it there. That 405 reaches the client as OpenAI's error
object saying the engine does not support deleting stored responses (`_cannot_delete`), status 405.
These are control calls, not generations: they go through the gateway's control HTTP client, are
never retried elsewhere, and take no pool slot.

Ownership: only the API key that created the response (or an admin key) may use it; any other key
gets the unknown id's 404 (gateway/routing/response_affinity.py). Accounting: each call is one
request against its key's request limit (`AuthGuard.count_request`: they cost no tokens, and a
404 costs its request too, so probing ids is not free), and is recorded like a proxied request
(`RequestRecord`: the access log line, `kimi_gateway_requests_total{api=responses_get|
responses_delete|responses_cancel}`, the request duration; `x-request-id` on the answer).

`GET …?stream=true` (with `starting_after`): vLLM replays the SSE events of a background response
(`retrieve_responses` → `responses_background_stream_generator`). The gateway passes both query
parameters on and, when the engine answers `200 text/event-stream`, relays its bytes unchanged as
they come, through the proxied endpoints' own relay (`gateway.api.proxy.relay`: no deadline but
`timeouts.total`, counted from the request's arrival; the client's hang-up closes the upstream, as
does a server shutdown, recorded as `shutting_down`, not as a client disconnect: `_Replay`). Any other
answer (the stored response as JSON, an engine's error) is read whole and relayed as JSON. The SSE
or JSON choice follows the engine's content type, never the query: an SSE body is never read
into a JSON answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from gateway.api.proxy import Receive, Send, cancelled, relay, request_id_of, start_message, watch_hang_up
from gateway.api.schemas import ResponseObject, error_responses
from gateway.auth.middleware import principal_of
from gateway.backends.control import describe_transport_error
from gateway.backends.encoding import DecodeError, UnsupportedEncoding, codings_of, decoded
from gateway.dialects.names import RESPONSES
from gateway.dialects.registry import dialect_for
from gateway.dispatch.answers import SSE_CONTENT_TYPE, RelayResponse
from gateway.dispatch.ledger import Ledger
from gateway.errors import (
    GatewayError,
    UpstreamError,
    UpstreamTimeout,
    error_bytes_from_upstream,
    upstream_error_object,
)
from gateway.http_answers import error_response
from gateway.protocol.responses import RESPONSE_ID_MAX
from gateway.protocol.sse import SSETap
from gateway.routing.response_affinity import ResponseNotFound, owner_of
from gateway.state import AppState
from gateway.streaming import EventTooLarge, cut_events

_PASSED_QUERY = ("include", "include_obfuscation", "stream", "starting_after")


async def retrieve_response(request: Request, response_id: str) -> Response:
    """GET: the stored response as the owning engine answers it (an SSE replay relayed as a stream)."""
    return await _forward(request, "GET", "", "responses_get")


async def delete_response(request: Request, response_id: str) -> Response:
    """DELETE: the owning engine's answer; the gateway's record goes on 2xx or 404 (module docstring)."""
    return await _forward(request, "DELETE", "", "responses_delete")


async def cancel_response(request: Request, response_id: str) -> Response:
    """POST …/cancel: the owning engine's answer (the cancelled response, or its 400)."""
    return await _forward(request, "POST", "/cancel", "responses_cancel")


def router() -> APIRouter:
    """The stored-response routes (under `/v1`: the auth middleware guards them), for `create_app`.
    `response_id` is in the handlers' signatures for the OpenAPI document; `_forward` reads it from
    the path parameters."""
    stored = APIRouter(tags=["inference"], responses=error_responses(400, 401, 403, 404, 405, 429, 502, 503, 504))
    one = "/v1/responses/{response_id}"
    replay = {"text/event-stream": {"schema": {"type": "string", "description": "With `?stream=true`: the "
                                               "engine's replay of a streamed response's events, relayed."}}}
    stored.add_api_route(one, retrieve_response, methods=["GET"], response_model=ResponseObject,
                         summary="Retrieve a stored response (from the worker that stores it)",
                         responses={200: {"content": replay}})
    stored.add_api_route(one, delete_response, methods=["DELETE"], response_model=ResponseObject,
                         summary="Delete a stored response")
    stored.add_api_route(one + "/cancel", cancel_response, methods=["POST"], response_model=ResponseObject,
                         summary="Cancel a background response")
    return stored


async def _forward(request: Request, method: str, suffix: str, api: str) -> Response:
    """Count, find the owner (ownership checked), call it and answer; the record is finished when
    the answer was given (a relayed stream's at its end)."""
    state: AppState = request.state.service.state
    arrived = asyncio.get_running_loop().time()
    principal = principal_of(request.scope)  # None when auth is off
    ledger = Ledger(api, request_id_of(dict(request.headers)), principal.name if principal is not None else None,
                    state.metrics, state.registry)
    record = ledger.record
    finish = True
    try:
        response_id = request.path_params["response_id"]
        try:
            if principal is not None and state.auth is not None:
                await state.auth.count_request(principal)  # one request, no tokens; never refunded
            if not response_id or len(response_id) > RESPONSE_ID_MAX:
                raise ResponseNotFound(f"Response with id '{response_id[:64]}' not found.")
            pool, worker = await owner_of(response_id, None, state.responses, state.registry, state.config.pools,
                                          state.metrics, principal)
            ledger.in_pool(pool.name)
            ledger.served_by(worker)
            headers = {"accept": "application/json, text/event-stream", "accept-encoding": "identity"}
            if pool.api_key is not None:
                headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
            params = {k: v for k, v in request.query_params.items() if k in _PASSED_QUERY}
            url = f"{worker.url}/v1/responses/{response_id}{suffix}"
            upstream = await _open(state.http, method, url, headers, params)
        except GatewayError as exc:
            ledger.answered_with_error(exc.status, exc.message)
            answer = error_response(exc)
            answer.headers["x-request-id"] = record.request_id
            if record.worker is not None:
                answer.headers.update({"x-kimi-gateway-pool": record.pool, "x-kimi-gateway-worker": record.worker})
            return answer
        if upstream.status_code == 200 and _is_sse(upstream):
            ledger.streamed(200)
            finish = False
            total = state.config.timeouts.total
            where = [(b"x-kimi-gateway-pool", pool.name.encode()), (b"x-kimi-gateway-worker", worker.id.encode())]
            return _Replay(ReplayStream(upstream, ledger, state.config.max_decoded_bytes, state.config.max_body_bytes),
                           ledger, None if total is None else arrived + total, total, where,
                           state.config.timeouts.keepalive_interval)
        route = {"x-kimi-gateway-pool": pool.name, "x-kimi-gateway-worker": worker.id,
                 "x-request-id": record.request_id}
        try:
            status, body = upstream.status_code, await _drain(upstream, url, state.config.max_body_bytes,
                                                              state.config.max_decoded_bytes)
        except GatewayError as exc:
            ledger.answered_with_error(exc.status, exc.message)
            answer = error_response(exc)
            answer.headers.update(route)
            return answer
        if method == "DELETE" and (200 <= status < 300 or status == 404) and state.responses is not None:
            state.responses.forget(response_id)
        if 200 <= status < 300:
            ledger.answered(status)
        elif method == "DELETE" and status == 405:  # the engine has no DELETE route (module docstring)
            ledger.answered_with_error(status, "the engine does not delete stored responses")
            body = _cannot_delete(state.upstream.redactor(body))
        else:  # an engine's error in whatever shape it uses, as an OpenAI error object
            ledger.answered_with_error(status)
            body = error_bytes_from_upstream(status, state.upstream.redactor(body), None, None)
        # always JSON: never serve an engine's text/html from the gateway's origin
        return Response(body, status_code=status, media_type="application/json", headers=route)
    finally:
        if finish:
            ledger.finish()


def _cannot_delete(engine_body: bytes) -> bytes:
    """The client's 405 when the engine storing a response answers DELETE with its 405: OpenAI's error
    object saying the engine cannot delete stored responses, with the engine's own message."""
    error = upstream_error_object(405, engine_body)
    error["message"] = ("The inference engine storing this response does not support deleting stored responses "
                        f"(it answered HTTP 405: {error['message']}). The response is still stored and can still "
                        "be retrieved.")
    return orjson.dumps({"error": error})


OPENING_WAIT_S = 10.0
"""Seconds a replay's answer waits for the engine's first bytes before it starts (so a replay that
fails at once gets an error status, not an empty stream); a replay still silent then (a background
response's next event not generated yet) starts streaming and goes on waiting under the relay's cap."""

CONTROL_DEADLINE_S = 30.0
"""Seconds for a whole GET/DELETE/cancel exchange with the engine (a JSON answer): they read or
change a stored object (a cancel waits for the engine to stop a background task), no generation.
A replayed stream is bounded by `timeouts.total` instead (it lasts as long as the generation)."""


def _is_sse(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").partition(";")[0].strip().lower() == "text/event-stream"


async def _open(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str],
                params: dict[str, str]) -> httpx.Response:
    """The engine's response, headers read, body not yet. Raises UpstreamTimeout past
    CONTROL_DEADLINE_S, UpstreamError for a transport failure."""
    try:
        async with asyncio.timeout(CONTROL_DEADLINE_S):
            request = client.build_request(method, url, headers=headers, params=params,
                                           timeout=httpx.Timeout(CONTROL_DEADLINE_S, read=None))
            return await client.send(request, stream=True)
    except (TimeoutError, httpx.TimeoutException):
        raise UpstreamTimeout(f"The worker storing the response did not answer within {CONTROL_DEADLINE_S:g} "
                              "seconds.") from None
    except httpx.HTTPError as exc:
        raise UpstreamError(f"The worker storing the response could not be reached "
                            f"({describe_transport_error(exc, url)}).") from None


def _identity_body(response: httpx.Response, decoded_limit: int) -> AsyncIterator[bytes]:
    """An opened response's body as identity bytes, as they arrive: the transfer-decoded bytes
    (`aiter_raw`), a content coding the engine applied although it was asked for identity decoded
    incrementally by the relay's own decoder (`backends/encoding.py`: gzip and deflate, at most
    64 KiB per step, DecodeError past `decoded_limit` decoded bytes), never by httpx's (which
    decodes a whole read at once, with no limit). Raises UnsupportedEncoding at once for a coding it
    cannot decode."""
    codings = codings_of(response.headers.get("content-encoding"))
    raw = response.aiter_raw()
    return decoded(raw, codings, decoded_limit) if codings else raw


async def _drain(response: httpx.Response, url: str, max_bytes: int, decoded_limit: int) -> bytes:
    """The whole body of an opened response (identity bytes, `_identity_body`), within
    CONTROL_DEADLINE_S and `max_bytes`; closes it. Raises UpstreamTimeout or UpstreamError (also
    for a body over `max_bytes`, one encoded in a coding the gateway cannot decode, or a broken
    encoded one)."""
    try:
        async with asyncio.timeout(CONTROL_DEADLINE_S):
            chunks: list[bytes] = []
            size = 0
            async for chunk in _identity_body(response, decoded_limit):
                size += len(chunk)
                if size > max_bytes:
                    raise UpstreamError(f"The stored response is larger than this gateway relays ({max_bytes} "
                                        "bytes).")
                chunks.append(chunk)
    except (TimeoutError, httpx.TimeoutException):
        raise UpstreamTimeout(f"The worker storing the response did not answer within {CONTROL_DEADLINE_S:g} "
                              "seconds.") from None
    except httpx.HTTPError as exc:
        raise UpstreamError(f"The worker storing the response broke off its answer "
                            f"({describe_transport_error(exc, url)}).") from None
    except (DecodeError, UnsupportedEncoding) as exc:
        raise UpstreamError(f"The worker storing the response sent an answer the gateway cannot relay ({exc}).") \
            from None
    finally:
        await response.aclose()
    return b"".join(chunks)


class ReplayStream:
    """The engine's SSE replay as a relayed stream (`RelayStream`: `body`, `aclose`, `sse`), relayed
    by the proxied endpoints' own relay (`gateway.api.proxy.relay`): its bytes unchanged, whole events
    as they come. Facts for the ledger, once per stream: the first byte, a broken end
    (`upstream_error`).

    Bounds, as the generation relay's (`gateway.streaming.UpstreamStream`): the body is decoded to
    identity incrementally, at most `decoded_limit` bytes (`max_decoded_bytes`) of a content coding
    the engine applied unasked (`_identity_body`), and an unfinished event is held at most
    `max_event` bytes (`max_body_bytes`: a line without end); past either the replay is broken.

    A replay is whole when it reaches a Responses stream's last event (`response.completed`,
    `response.incomplete`, `response.failed`: `gateway.protocol.sse.SSETap`). One that breaks (the
    connection fails, a bound above is passed, or it ends before that event) is told to the client:
    before any byte by `opening` (the answer is then an error status), after by one Responses
    `error` event (`Dialect.stream_error`) and no terminal event; an engine that sent its own
    `error` event and then broke its connection gets no second one."""

    sse = True

    def __init__(self, response: httpx.Response, ledger: Ledger, decoded_limit: int, max_event: int) -> None:
        self._response = response
        self._ledger = ledger
        self._decoded_limit = decoded_limit
        self._max_event = max_event
        self._chunks: AsyncIterator[bytes] | None = None  # the identity body, from `opening`
        self._head = b""  # bytes `opening` read before the answer started
        self._pending: asyncio.Future[bytes] | None = None  # a read `opening` left running
        self._tap = SSETap(RESPONSES)

    async def opening(self, wait: float) -> str | None:
        """Wait up to `wait` seconds for the replay's first bytes, before the client's answer starts:
        why the replay failed when it broke or ended before any byte (or came in a content coding
        the gateway cannot decode), else None (they came, or are still on their way: the relay waits
        for them)."""
        try:
            self._chunks = _identity_body(self._response, self._decoded_limit)
        except UnsupportedEncoding as exc:
            return str(exc)
        pending = asyncio.ensure_future(anext(self._chunks, b""))
        try:
            done, _ = await asyncio.wait((pending,), timeout=wait)
        except BaseException:
            pending.cancel()
            raise
        if not done:
            self._pending = pending
            return None
        try:
            self._head = pending.result()
        except httpx.HTTPError as exc:
            return f"the worker's replay broke before its first byte ({type(exc).__name__})"
        except DecodeError as exc:
            return f"the worker's replay broke before its first byte ({exc})"
        return None if self._head else "the worker ended the replay without sending an event"

    async def _next(self) -> bytes:
        if self._head:
            head, self._head = self._head, b""
            return head
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return await pending
        assert self._chunks is not None, "opening() was not awaited"
        return await anext(self._chunks, b"")

    async def body(self) -> AsyncIterator[bytes]:
        """The engine's bytes cut at event ends; a broken end adds the error event (class docstring)."""
        tap, carry, long = self._tap, b"", None
        said = True  # an engine's own error event, as the client's last, says why it broke
        try:
            while chunk := await self._next():
                self._ledger.first_byte()
                tap.feed(chunk)
                carry, long, whole = cut_events(carry, long, chunk, self._max_event)
                if whole:
                    yield whole
            tap.end()
            why = None if tap.done else "the worker's replay ended without its last event"
        except httpx.HTTPError as exc:
            why = None if tap.done else f"the worker's replay broke ({type(exc).__name__})"
        except DecodeError as exc:
            why = None if tap.done else f"the worker's replay broke ({exc})"
        except EventTooLarge:
            why, said, long = f"the worker's replay sent an event of over {self._max_event} bytes", False, None
        if long is not None:
            carry = bytes(long)
            long.clear()
        if why is None:
            if carry:  # a whole replay whose last event lacks its blank line
                yield carry
            await self.aclose()
            return
        await self.aclose()
        if said and tap.failed and not carry:  # the engine said why: its error event was the client's last
            self._ledger.stream_broken(f"{why}, after its error event")
            return
        self._ledger.stream_broken(f"{why} after {tap.events} events")
        yield _RESPONSES.stream_error(f"The inference server's replay of this response broke off ({why}); "
                                      "the replay is incomplete.")

    async def aclose(self) -> None:
        """Close the engine's response (idempotent): the engine ends its replay."""
        if self._pending is not None:
            self._pending.cancel()
        with contextlib.suppress(Exception):
            await self._response.aclose()


_RESPONSES = dialect_for(RESPONSES)  # a replay is a Responses stream: its errors in that API's shape


class _Replay(Response):
    """The relayed SSE replay, answered as the proxied endpoints answer a stream: the shared relay
    (`relay`: the overall cap counted from the request's arrival) under a hang-up watch
    (`watch_hang_up`), so a client's hang-up (`client_disconnect`, or `send_stalled`), the end of the
    shutdown grace period (serve's guard) and uvicorn cancelling the request at its own
    graceful-shutdown timeout (`shutting_down`) are told apart as there; silences get heartbeats
    (`heartbeat_s`, `timeouts.keepalive_interval`). The ledger is finished here."""

    def __init__(self, stream: ReplayStream, ledger: Ledger, deadline: float | None, total: float | None,
                 headers: list[tuple[bytes, bytes]], heartbeat_s: float | None = None) -> None:
        super().__init__()
        self._heartbeat_s = heartbeat_s
        self._stream = stream
        self._route = headers
        self._result = RelayResponse(self._stream, SSE_CONTENT_TYPE, headers)
        self._ledger = ledger
        self._deadline = deadline
        self._total = total

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ledger = self._ledger
        watch = watch_hang_up(receive)
        started = False
        try:
            wait = OPENING_WAIT_S
            if self._deadline is not None:
                wait = max(0.0, min(wait, self._deadline - asyncio.get_running_loop().time()))
            failure = await self._stream.opening(wait)
            started = True
            if failure is not None:
                await self._fail(failure, send)
                return
            await relay(_RESPONSES, self._result, ledger, send, self._deadline, self._total, self._heartbeat_s)
        except asyncio.CancelledError:
            if not cancelled(watch, scope, ledger, response_started=started):
                raise
        finally:
            await watch.stop()
            await self._result.stream.aclose()
            ledger.finish()

    async def _fail(self, why: str, send: Send) -> None:
        """The replay failed before its first byte: a 502 in OpenAI's shape instead of an empty stream."""
        ledger = self._ledger
        error = UpstreamError(f"The inference server's replay of this response failed ({why}).")
        ledger.stream_broken(why)
        ledger.answered_with_error(error.status)
        body = _RESPONSES.error_bytes(error, ledger.record.request_id)
        with contextlib.suppress(OSError):
            await send(start_message(_RESPONSES, error.status, b"application/json", self._route,
                                     ledger.record.request_id, len(body)))
            await send({"type": "http.response.body", "body": body, "more_body": False})
