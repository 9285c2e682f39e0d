"""`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: forwarded
to the worker that stores the response (gateway/routing/response_affinity.py), its answer relayed.

What the engines serve (their own routers): vLLM and SGLang answer GET (the stored response; 404
`Response with id '…' not found.` for an unknown id) and POST …/cancel (a `background` response
that is queued or in progress; 400 for any other); neither serves DELETE (a 405 from FastAPI),
which the simulator and OpenAI do (`{"id", "object": "response", "deleted": true}`). llama.cpp's
server stores nothing (404 for every id), so the gateway records no ids for its pools.

DELETE forgets the gateway's record when the engine deleted the response (2xx) or no longer knows
it (404); otherwise (a 405 from an engine that cannot delete) the record stays, since the engine
still holds the response and GET still finds it there. These are control calls, not generations:
they go through the gateway's control HTTP client with the health-probe timeouts, are never
retried elsewhere, and take no pool slot. A `stream=true` GET (vLLM's replay of a background
stream) is answered as JSON by the gateway: only the non-streaming form is relayed.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.responses import error_response
from gateway.backends.control import describe_transport_error
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout, error_bytes_from_upstream
from gateway.protocol.responses import RESPONSE_ID_MAX
from gateway.routing.response_affinity import ResponseNotFound, owner_of
from gateway.state import AppState

_PASSED_QUERY = ("include", "include_obfuscation")


async def retrieve_response(request: Request) -> Response:
    """GET: the stored response as the owning engine answers it."""
    return await _forward(request, "GET", "")


async def delete_response(request: Request) -> Response:
    """DELETE: the owning engine's answer; the gateway's record goes on 2xx or 404 (module docstring)."""
    return await _forward(request, "DELETE", "")


async def cancel_response(request: Request) -> Response:
    """POST …/cancel: the owning engine's answer (the cancelled response, or its 400)."""
    return await _forward(request, "POST", "/cancel")


async def _forward(request: Request, method: str, suffix: str) -> Response:
    state: AppState = request.state.service.state
    response_id = request.path_params["response_id"]
    try:
        if not response_id or len(response_id) > RESPONSE_ID_MAX:
            raise ResponseNotFound(f"Response with id '{response_id[:64]}' not found.")
        pool, worker = await owner_of(response_id, None, state.responses, state.registry, state.config.pools,
                                      state.metrics)
        headers = {"accept": "application/json"}
        if pool.api_key is not None:
            headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
        params = {k: v for k, v in request.query_params.items() if k in _PASSED_QUERY}
        url = f"{worker.url}/v1/responses/{response_id}{suffix}"
        status, body = await _call(state.http, method, url, headers, params, state.config.max_body_bytes)
    except GatewayError as exc:
        return error_response(exc)
    if method == "DELETE" and (200 <= status < 300 or status == 404) and state.responses is not None:
        state.responses.forget(response_id)
    if not 200 <= status < 300:  # an engine's error in whatever shape it uses, as an OpenAI error object
        body = error_bytes_from_upstream(status, body, None, None)
    # always JSON: never serve an engine's text/html from the gateway's origin
    return Response(body, status_code=status, media_type="application/json",
                    headers={"x-kimi-gateway-pool": pool.name, "x-kimi-gateway-worker": worker.id})


CONTROL_DEADLINE_S = 30.0
"""Seconds for a whole GET/DELETE/cancel exchange with the engine: they read or change a stored
object (a cancel waits for the engine to stop a background task), no generation."""


async def _call(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str], params: dict[str, str],
                max_bytes: int) -> tuple[int, bytes]:
    """One bounded exchange: (status, body). Raises UpstreamTimeout past CONTROL_DEADLINE_S,
    UpstreamError for a transport failure or a body over `max_bytes`."""
    try:
        async with asyncio.timeout(CONTROL_DEADLINE_S):
            request = client.build_request(method, url, headers=headers, params=params,
                                           timeout=httpx.Timeout(CONTROL_DEADLINE_S))
            response = await client.send(request, stream=True)
            try:
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise UpstreamError(f"The stored response is larger than this gateway relays ({max_bytes} "
                                            "bytes).")
                    chunks.append(chunk)
            finally:
                await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        raise UpstreamTimeout(f"The worker storing the response did not answer within {CONTROL_DEADLINE_S:g} "
                              "seconds.") from None
    except httpx.HTTPError as exc:
        raise UpstreamError(f"The worker storing the response could not be reached "
                            f"({describe_transport_error(exc, url)}).") from None
    return response.status_code, b"".join(chunks)
