"""`POST /tokenize` and `POST /detokenize`: the engines' tokenizer routes, relayed to a worker of the
model's cheapest healthy pool.

What the engines serve at those paths:

- vLLM (0.32: `vllm/entrypoints/serve/tokenize/api_router.py`, shapes in `protocol.py` beside it):
  `/tokenize` takes `{"model"?, "prompt": str, "add_special_tokens"?, "return_token_strs"?}` or
  `{"model"?, "messages": [...], "add_generation_prompt"?, "continue_final_message"?, "tools"?,
  "chat_template_kwargs"?, ...}` (a chat rendered by the model's template) and answers
  `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes `{"model"?, "tokens":
  [ids]}` and answers `{"prompt": text}`. `model` may be a LoRA adapter (its tokenizer).
- SGLang (`python/sglang/srt/entrypoints/http_server.py`, also at `/v1/tokenize` and
  `/v1/detokenize`; `serving_tokenize.py`, `protocol.py` `TokenizeRequest`): `/tokenize` takes
  `{"model"?, "prompt": str | [str], "add_special_tokens"?}` and answers `{"tokens", "count",
  "max_model_len"}` (lists for a list of prompts); `/detokenize` takes `{"model"?, "tokens": [ids] |
  [[ids]], "skip_special_tokens"?}` and answers `{"text": str | [str]}`.
- llama.cpp's server (`tools/server/server.cpp`): `/tokenize` `{"content"}` → `{"tokens"}`,
  `/detokenize` `{"tokens"}` → `{"content"}`.

The gateway relays the body as sent and the engine's answer as it comes: the shape is the engine's
of the pool chosen (`x-kimi-gateway-pool` names it). It reads and writes one member, `model`: the
model or LoRA adapter the request names (as the proxied APIs resolve it: a name or alias of a served
model, else an adapter a pool serves; absent or null: the first served model, as an engine takes
its first served name), written as the name that pool's engines serve it under
(`GatewayConfig.served_name`). An unknown model is 404 `model_not_found` before any engine sees it.

Routing: tokenizing costs an engine's API server a tokenizer pass and no generation, so context and
load hardly matter: the model's pools in cost order (an adapter's: the pools serving it), the first
with a worker in service, and there its least loaded one. A worker that cannot be reached is left
for the next candidate (the pool's, then the next pool's), up to `max_attempts` workers. No pool
slot is taken.

Auth and limits (auth on): a key with the `user` scope (the auth middleware: 401/403), one request
against the key's `requests_per_minute` once the body is read, before it is parsed (never given
back: an invalid body or an unknown model costs its request, as on the proxied APIs), 404 for
a model the key may not use, and one request against the key's limits on that model
(`model_limits`). Tokens are never charged: the engine generates nothing. Bodies are bounded as the
proxied APIs' are (`max_body_bytes`: 413; `timeouts.body_*`: 408; JSON only with auth off: 415).
Errors are OpenAI's error object, an engine's error answer too (`errors.error_bytes_from_upstream`,
the config's secrets taken out). Each request is recorded like a proxied one (the access log line,
`kimi_gateway_requests_total{api="tokenize"|"detokenize"}`, `x-request-id`).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.proxy import ClientGone, check_head, read_body, request_id_of
from gateway.auth.middleware import principal_of
from gateway.backends.control import describe_transport_error
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dispatch.ledger import Ledger
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    UpstreamError,
    UpstreamTimeout,
    error_bytes_from_upstream,
)
from gateway.http_answers import error_response
from gateway.protocol.body import decode_json_object
from gateway.state import AppState

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"

DEADLINE_S = 30.0
"""Seconds for a whole exchange with the engine: a tokenizer pass (a long chat's template and
tokens), no generation."""


async def tokenize(request: Request) -> Response:
    """`POST /tokenize`: the engine's token ids of a prompt or a chat (module docstring)."""
    return await _relay(request, TOKENIZE_PATH, "tokenize")


async def detokenize(request: Request) -> Response:
    """`POST /detokenize`: the engine's text of token ids (module docstring)."""
    return await _relay(request, DETOKENIZE_PATH, "detokenize")


def router() -> APIRouter:
    """The tokenizer routes, for `create_app`. Not in `/openapi.json`: their bodies and answers are
    the engine's of the pool chosen (vLLM's, SGLang's or llama.cpp's shape), which one schema
    cannot promise; docs/client-apis.md describes them. They read their body themselves (bounded,
    as the proxied endpoints do)."""
    routes = APIRouter()
    routes.add_api_route(TOKENIZE_PATH, tokenize, methods=["POST"], include_in_schema=False)
    routes.add_api_route(DETOKENIZE_PATH, detokenize, methods=["POST"], include_in_schema=False)
    return routes


async def _relay(request: Request, path: str, api: str) -> Response:
    """Count, read, resolve the model, pick a worker, call it and answer; the record is finished
    with the answer."""
    state: AppState = request.state.service.state
    scope = request.scope
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    principal = principal_of(scope)  # None when auth is off
    ledger = Ledger(api, request_id_of(headers), principal.name if principal is not None else None,
                    state.metrics, state.registry)
    record = ledger.record
    route: dict[str, str] = {"x-request-id": record.request_id}
    try:
        config = state.config
        check_head(scope, headers, config.max_body_bytes, json_only=state.auth is None)
        timeouts = config.timeouts
        body = await read_body(request.receive, config.max_body_bytes, timeouts.body_idle, timeouts.body_deadline,
                               timeouts.body_min_rate)
        assert isinstance(body, bytes)  # below `join_max`: joined
        guard = state.auth if principal is not None else None
        if guard is not None:  # as a proxied request: counted once its body is in, before it is parsed
            assert principal is not None
            await guard.count_request(principal)  # one request, no tokens; never given back
        payload = decode_json_object(body)
        model, adapter = _model(state, payload.get("model"))
        ledger.resolved(model)
        if guard is not None:
            assert principal is not None
            guard.check_model(principal, model)
            if principal.model_limits.get(model) is not None:  # one request on that model, no tokens
                await guard.check_quota(principal, 0, requests=0, model=model)
        status, answer = await _call(state, ledger, path, payload, model, adapter, route)
    except ClientGone:
        ledger.client_gone("before_response")
        ledger.finish()
        return Response(status_code=400)  # nobody reads it
    except GatewayError as exc:
        ledger.answered_with_error(exc.status, exc.message)
        ledger.finish()
        answer_error = error_response(exc)
        answer_error.headers.update(route)
        if exc.status in (408, 413):  # the rest of the body may still come: end the connection
            answer_error.headers["connection"] = "close"
        return answer_error
    if 200 <= status < 300:
        ledger.answered(status)
    else:  # the engine's error in whatever shape it uses, as an OpenAI error object
        ledger.answered_with_error(status)
        answer = error_bytes_from_upstream(status, state.upstream.redactor(answer), None, None)
    ledger.finish()
    return Response(answer, status_code=status, media_type="application/json", headers=route)


def _model(state: AppState, value: Any) -> tuple[str, str | None]:
    """The request's model as the proxied APIs resolve it: (the model's canonical name or the
    adapter's name, the adapter or None). Absent or null: the first served model. Raises
    InvalidRequest (not a string), ModelNotFound (neither a served model nor an adapter a pool serves)."""
    if value is None:
        return state.config.served_models()[0].name, None
    if not isinstance(value, str):
        raise InvalidRequest("`model` must be a string.", param="model", code="invalid_type")
    if value in state.registry.adapter_names():  # as the proxied APIs: an adapter is never shadowed by an alias
        return value, value
    for model in state.config.served_models():
        if value.lower() in (name.lower() for name in model.names()):
            return model.name, None
    raise ModelNotFound(f"The model `{value[:200]}` does not exist or you do not have access to it.", param="model")


def _candidates(state: AppState, model: str, adapter: str | None) -> list[tuple[PoolConfig, Worker]]:
    """Workers to try, in order: the model's (or the adapter's) pools in cost order, the first with a
    worker in service first, each pool's workers least loaded first."""
    registry = state.registry
    if adapter is not None:
        pools = [p for p in state.config.pools if registry.serves_adapter(p.name, adapter)]
    else:
        pools = state.config.model_pools(model)
    ordered: list[tuple[PoolConfig, Worker]] = []
    for pool in pools:
        workers = sorted(registry.candidates(pool.name, adapter=adapter), key=lambda w: w.load())
        ordered.extend((pool, worker) for worker in workers)
    return ordered


async def _call(state: AppState, ledger: Ledger, path: str, payload: dict[str, Any], model: str,
                adapter: str | None, route: dict[str, str]) -> tuple[int, bytes]:
    """The engine's status and body for the request, from the first candidate worker that answers
    (`route` gets its pool and worker). Raises NoCapacity (no worker in service), UpstreamError
    (none could be reached, or an answer over `max_body_bytes` or not JSON), UpstreamTimeout."""
    candidates = _candidates(state, model, adapter)
    if not candidates:
        raise NoCapacity(f"No healthy worker serves `{model[:200]}` right now; retry shortly.",
                         headers={"retry-after": "1"})
    failures: list[str] = []
    for pool, worker in candidates[:state.config.max_attempts]:
        ledger.in_pool(pool.name)
        ledger.served_by(worker)
        route.update({"x-kimi-gateway-pool": pool.name, "x-kimi-gateway-worker": worker.id})
        served = adapter if adapter is not None else state.config.served_name(pool, model)
        body = orjson.dumps({**payload, "model": served})
        headers = {"content-type": "application/json", "x-request-id": uuid.uuid4().hex}
        if pool.api_key is not None:
            headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
        url = worker.url + path
        try:
            return await _exchange(state.http, url, body, headers, state.config.max_body_bytes)
        except _Unreachable as exc:
            failures.append(f"{worker.id}: {exc}")
    raise UpstreamError(f"No worker could be reached ({'; '.join(failures)[:500]}).")


class _Unreachable(Exception):
    """The worker could not be connected to: another may be tried (nothing reached the engine)."""


async def _exchange(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str],
                    max_bytes: int) -> tuple[int, bytes]:
    """POST `body` to `url`: the status and the whole answer (within DEADLINE_S and `max_bytes`).
    Raises _Unreachable for a connection that could not be made, UpstreamTimeout past the deadline,
    UpstreamError for a broken or oversize answer, or a 2xx answer that is not JSON."""
    try:
        async with asyncio.timeout(DEADLINE_S):
            request = client.build_request("POST", url, content=body, headers=headers,
                                           timeout=httpx.Timeout(DEADLINE_S))
            response = await client.send(request, stream=True)
            try:
                declared = response.headers.get("content-type", "application/json")
                if 200 <= response.status_code < 300 and \
                        declared.partition(";")[0].strip().lower() != "application/json":
                    raise UpstreamError(f"The worker answered {response.status_code} with content type "
                                        f"{declared[:60]!r}, not JSON.")
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise UpstreamError(f"The worker's answer is larger than this gateway relays ({max_bytes} "
                                            "bytes).")
                    chunks.append(chunk)
            finally:
                await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        raise UpstreamTimeout(f"The worker did not answer within {DEADLINE_S:g} seconds.") from None
    except httpx.ConnectError as exc:
        raise _Unreachable(describe_transport_error(exc, url)) from None
    except httpx.HTTPError as exc:
        raise UpstreamError(f"The worker broke off its answer ({describe_transport_error(exc, url)}).") from None
    return response.status_code, b"".join(chunks)

