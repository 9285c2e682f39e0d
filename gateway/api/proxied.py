"""The proxied inference endpoints in one table: the app's fast path and `/openapi.json` both read it.

Each `ProxiedRoute` row names a path, the API kind routing handles it as, and the pydantic models
that document its request and non-streamed answer. `create_app` serves every row on the raw ASGI
fast path (`ProxyEndpoint`, no FastAPI routing or validation per request); `add_proxied_paths`
writes the rows into the OpenAPI document FastAPI generates for the other routes. To serve and
document a new endpoint, add one row to `PROXIED_ROUTES`.

Paths may hold `{name}` parameters (e.g. `/v1/responses/{response_id}`): they are matched only
after an exact-path miss, and the values land in `scope["path_params"]`. Rows sharing a path with
different methods are dispatched by method (405 with `Allow` for any other).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.api.proxy import ProxyEndpoint, Receive, Scope, Send
from gateway.api.schemas import (
    ERROR_DESCRIPTIONS,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicTokenCount,
    ChatCompletion,
    Completion,
    EmbeddingList,
    ErrorResponse,
    RerankResult,
    ResponseObject,
    ScoreList,
)
from gateway.dialects.messages import OVERLOADED_STATUS
from gateway.dialects.names import CHAT, COMPLETIONS, COUNT_TOKENS, EMBEDDINGS, MESSAGES, RERANK, RESPONSES, SCORE, Api
from gateway.errors import MethodNotAllowed
from gateway.protocol.anthropic import CountTokensRequest, MessagesRequest
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.protocol.pooling import EmbeddingsRequest, RerankRequest, ScoreRequest
from gateway.protocol.responses import ResponsesRequest

ASGIApp = Callable[[Scope, Receive, Send], Any]

PROXIED_ERRORS = (400, 401, 403, 404, 405, 408, 413, 415, 429, 500, 502, 503, 504)
"""Statuses a proxied endpoint may answer with an error body (see `schemas.ERROR_DESCRIPTIONS`)."""

ANTHROPIC_ERRORS = (*(status for status in PROXIED_ERRORS if status != 503), OVERLOADED_STATUS)
"""The Anthropic endpoints answer 529 `overloaded_error` where the OpenAI ones answer 503."""


@dataclass(frozen=True, slots=True)
class ProxiedRoute:
    """One proxied endpoint.

    `request` / `response` document the JSON body sent / the non-streamed answer (None: no body);
    `streams`: the answer may also be `text/event-stream` (the request's `stream: true`);
    `endpoint` builds the ASGI app serving it from `api` (whose dialect renders its errors); `error`
    documents its error body and `errors` the statuses it comes with.
    """

    path: str
    api: Api
    summary: str
    request: type[BaseModel] | None
    response: type[BaseModel]
    method: str = "POST"
    streams: bool = True
    endpoint: Callable[[Api], ASGIApp] = ProxyEndpoint
    error: type[BaseModel] = ErrorResponse
    errors: tuple[int, ...] = PROXIED_ERRORS


PROXIED_ROUTES: tuple[ProxiedRoute, ...] = (
    ProxiedRoute("/v1/chat/completions", CHAT, "Create a chat completion", ChatCompletionRequest, ChatCompletion),
    ProxiedRoute("/v1/completions", COMPLETIONS, "Create a completion (legacy)", CompletionRequest, Completion),
    ProxiedRoute("/v1/responses", RESPONSES, "Create a response (OpenAI Responses API)", ResponsesRequest,
                 ResponseObject),
    ProxiedRoute("/v1/messages", MESSAGES, "Create a message (Anthropic Messages API)", MessagesRequest,
                 AnthropicMessage, error=AnthropicErrorResponse, errors=ANTHROPIC_ERRORS),
    ProxiedRoute("/v1/messages/count_tokens", COUNT_TOKENS, "Count a message's input tokens (Anthropic)",
                 CountTokensRequest, AnthropicTokenCount, streams=False, error=AnthropicErrorResponse,
                 errors=ANTHROPIC_ERRORS),
    # The pooling APIs: served by the pools that list them in `apis` (gateway/backends/engine_kinds.py).
    ProxiedRoute("/v1/embeddings", EMBEDDINGS, "Create embeddings", EmbeddingsRequest, EmbeddingList,
                 streams=False),
    ProxiedRoute("/v1/rerank", RERANK, "Rerank documents by relevance to a query (vLLM, Jina/Cohere shape)",
                 RerankRequest, RerankResult, streams=False),
    ProxiedRoute("/v1/score", SCORE, "Score pairs of texts (vLLM)", ScoreRequest, ScoreList, streams=False),
)


class _ByMethod:
    """Several rows on one path: the one for the request's method, else 405 naming the others."""

    def __init__(self, by_method: dict[str, ASGIApp]) -> None:
        self.by_method = by_method
        self.records_auth_errors = all(getattr(app, "records_auth_errors", False) for app in by_method.values())
        allow = ", ".join(by_method)
        self._refusal = MethodNotAllowed("Method not allowed here; use " + allow + ".", headers={"allow": allow})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.by_method.get(scope["method"])
        if app is not None:
            await app(scope, receive, send)
            return
        body = orjson.dumps(self._refusal.body())
        headers = [(b"content-type", b"application/json"),
                   *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self._refusal.headers.items()),
                   (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 405, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class ProxiedApps:
    """The fast path's lookup: `exact` path → app, then `templated` (regex, app) in table order."""

    exact: dict[str, ASGIApp]
    templated: tuple[tuple[re.Pattern[str], ASGIApp], ...]

    def find(self, scope: Scope) -> ASGIApp | None:
        """The app serving `scope["path"]`, with `scope["path_params"]` set for a templated path."""
        app = self.exact.get(scope["path"])
        if app is not None or not self.templated:
            return app
        for pattern, app in self.templated:
            if (match := pattern.fullmatch(scope["path"])) is not None:
                scope["path_params"] = match.groupdict()
                return app
        return None


def proxied_apps(routes: Iterable[ProxiedRoute], wrap: Callable[[ASGIApp], ASGIApp]) -> ProxiedApps:
    """The ASGI apps serving `routes`, each wrapped by `wrap` (the CORS/auth middleware)."""
    by_path: dict[str, dict[str, ASGIApp]] = {}
    for route in routes:
        by_path.setdefault(route.path, {})[route.method] = route.endpoint(route.api)
    exact: dict[str, ASGIApp] = {}
    templated: list[tuple[re.Pattern[str], ASGIApp]] = []
    for path, methods in by_path.items():
        # One row on a path: its endpoint itself (it answers 405 for other methods), no dispatch step.
        app = wrap(next(iter(methods.values())) if len(methods) == 1 else _ByMethod(methods))
        if "{" in path:
            regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path))
            templated.append((re.compile(regex), app))
        else:
            exact[path] = app
    return ProxiedApps(exact, tuple(templated))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def add_proxied_paths(openapi: dict[str, Any], routes: Iterable[ProxiedRoute], model_names: list[str]) -> None:
    """Write `routes` into the OpenAPI 3.1 document `openapi` (in place): one operation per row with
    its request body, its answers (JSON, and `text/event-stream` when it streams) and its errors,
    and the models' schemas under `components.schemas`, whose `model` fields give this gateway's
    `model_names` as examples."""
    routes = tuple(routes)
    models = {m for r in routes for m in (r.request, r.response, r.error) if m is not None}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for route in routes:
        model_field = schemas[route.request.__name__].get("properties", {}).get("model") if route.request else None
        if model_field is not None:
            model_field["examples"] = model_names
    paths = openapi.setdefault("paths", {})
    for route in routes:
        answer: dict[str, Any] = {"application/json": {"schema": _ref(route.response)}}
        if route.streams:
            answer["text/event-stream"] = {"schema": {
                "type": "string", "description": "Server-sent events relayed byte for byte from the engine, "
                "when the request sets `stream: true` (the API's own events: chunks then `data: [DONE]` on the "
                "OpenAI chat and completion APIs, typed `event:` lines on the Responses and Messages APIs)."}}
        operation: dict[str, Any] = {
            "tags": ["inference"], "summary": route.summary,
            # From method and path: unique even for several rows of one API kind (`/v1/responses/{id}/cancel`).
            "operationId": route.method.lower() + re.sub(r"[^A-Za-z0-9]+", "_", route.path).rstrip("_"),
            "description": "Proxied to a worker of the pool chosen for it (raw ASGI fast path: the body is "
                           "forwarded as sent; the request model documents the fields the gateway reads).",
            "responses": {"200": {"description": "The engine's answer.", "content": answer},
                          **{str(status): {"description": ERROR_DESCRIPTIONS[status],
                                           "content": {"application/json": {"schema": _ref(route.error)}}}
                             for status in route.errors}}}
        names = re.findall(r"\{(\w+)\}", route.path)
        if names:
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in names]
        if route.request is not None:
            body = {"application/json": {"schema": _ref(route.request)}}
            operation["requestBody"] = {"required": True, "content": body}
        paths.setdefault(route.path, {})[route.method.lower()] = operation
