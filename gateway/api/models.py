"""`GET /v1/models` and `GET /v1/models/{id}`: every served model, its aliases and the LoRA
adapters its pools serve, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/models),
an adapter with its base model as `parent`, as vLLM and SGLang list theirs
(vllm/entrypoints/openai/models/serving.py `show_available_models`; SGLang's `available_models`).
With auth on, only what the caller's key may use (`Principal.may_use`; an alias is listed when its
model is): another id is answered as OpenAI answers a model the key has no access to, 404.

Each entry carries its context length, `max_model_len` as vLLM's and SGLang's model cards do
(`ModelCard.max_model_len` in vllm/entrypoints/serve/engine/protocol.py, SGLang's
python/sglang/srt/entrypoints/openai/protocol.py): the largest `max_context_tokens` among the pools
that serve the id (a model's chain; for an adapter, the pools that declare or list it), the
longest prompt + output a request for it can be routed with (docs/routing.md "Context fit").

A request with an `anthropic-version` header (what the Anthropic SDKs and Claude Code send) gets
Anthropic's shapes instead (https://docs.claude.com/en/api/models-list): `{"data": [ModelInfo],
"has_more", "first_id", "last_id"}`, paged by `limit` (1-1000, default 20), `after_id` and
`before_id`; each `ModelInfo` has `max_input_tokens` and `max_tokens`, both that context length
(prompt and output share it); errors in Anthropic's error shape.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.params import ModelConfig
from gateway.api.schemas import Model, ModelList, error_responses
from gateway.auth.access import model_not_found_message
from gateway.auth.keys import Principal
from gateway.auth.middleware import principal_of
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound
from gateway.http_answers import JSONResponse, error_response
from gateway.protocol.anthropic import error_body
from gateway.state import AppState

ANTHROPIC_VERSION = "anthropic-version"
"""The request header that asks for Anthropic's shapes (every Anthropic SDK request carries it)."""

ANTHROPIC_PAGE = 20
ANTHROPIC_PAGE_MAX = 1000
"""Anthropic's default and largest `limit` of one page of `GET /v1/models`."""


async def list_models(request: Request) -> Response:
    """`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "max_model_len"},
    ...]}`: each model (config order) and its aliases, then every LoRA adapter (sorted by name) with
    `"parent"`: the model whose pools serve it. Anthropic's page of `ModelInfo` instead for a request
    with `anthropic-version` (module docstring)."""
    state: AppState = request.state.service.state
    listed = _listed(state, principal_of(request.scope))
    if ANTHROPIC_VERSION in request.headers:
        try:
            return JSONResponse(_anthropic_page(state, listed, request))
        except GatewayError as exc:
            return _anthropic_error(exc)
    return JSONResponse({"object": "list", "data": [_model_object(state, name, model)
                                                     for name, model in listed.items()]})


async def retrieve_model(request: Request, model_id: str) -> Response:
    """`{"id", "object": "model", "created", "owned_by", "max_model_len"}` (an adapter's with
    `parent`) for a listed id (exactly as listed; ids may hold a slash, `moonshotai/Kimi-K3`), else
    404 `model_not_found` as OpenAI answers it (the OpenAI SDKs' `models.retrieve()`); the same for
    an id the caller's key may not use. Anthropic's `ModelInfo` and error for a request with
    `anthropic-version`."""
    state: AppState = request.state.service.state
    model = _listed(state, principal_of(request.scope)).get(model_id)
    anthropic = ANTHROPIC_VERSION in request.headers
    if model is None:
        missing = ModelNotFound(model_not_found_message(model_id), param="model")
        return _anthropic_error(missing) if anthropic else error_response(missing)
    if anthropic:
        return JSONResponse(_anthropic_model(state, model_id, model))
    return JSONResponse(_model_object(state, model_id, model))


def _listed(state: AppState, principal: Principal | None = None) -> dict[str, tuple[ModelConfig, bool]]:
    """Listed id -> (its model: the model itself for a name or alias, the parent for an adapter;
    whether the id is an adapter), in listing order. An adapter's parent is the first model (config
    order) one of whose pools serves it. With `principal` (auth on), only the ids its key may use:
    a model's names when it may use the model, an adapter when it may use the adapter."""
    config, registry = state.config, state.registry
    listed: dict[str, tuple[ModelConfig, bool]] = {}
    for model in config.served_models():
        listed.update((name, (model, False)) for name in model.names())
    adapters = registry.adapter_names()
    if adapters:
        chains = [(model, [p.name for p in config.model_pools(model.name)]) for model in config.served_models()]
        for adapter in sorted(adapters):
            parent = next((model for model, pools in chains
                           if any(registry.serves_adapter(pool, adapter) for pool in pools)), None)
            if parent is not None:  # an adapter the engines list under an alias is the adapter
                listed[adapter] = (parent, True)
    if principal is None or principal.models is None:
        return listed
    return {name: (model, adapter) for name, (model, adapter) in listed.items()
            if principal.may_use(name if adapter else model.name)}


def context_length(state: AppState, name: str, entry: tuple[ModelConfig, bool]) -> int:
    """The largest context (tokens, prompt + output) a request for listed id `name` can be routed
    to: the largest `max_context_tokens` of its model's pools, or, for an adapter, of the pools
    serving it (`WorkerRegistry.serves_adapter`; its parent's pools when none does any more)."""
    model, adapter = entry
    pools = state.config.model_pools(model.name)
    if adapter:
        pools = [p for p in state.config.pools if state.registry.serves_adapter(p.name, name)] or pools
    return max(p.max_context_tokens for p in pools)


def _model_object(state: AppState, name: str, entry: tuple[ModelConfig, bool]) -> dict[str, object]:
    model, adapter = entry
    listed: dict[str, object] = {"id": name, "object": "model", "created": state.started_unix,
                                 "owned_by": model.owned_by}
    if adapter:
        listed["parent"] = model.name
    listed["max_model_len"] = context_length(state, name, entry)
    return listed


def _anthropic_model(state: AppState, name: str, entry: tuple[ModelConfig, bool]) -> dict[str, object]:
    """Anthropic's `ModelInfo` of listed id `name` (`created_at`: when this gateway started, RFC 3339)."""
    context = context_length(state, name, entry)
    created = datetime.fromtimestamp(state.started_unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": created, "lifecycle": "active",
            "max_input_tokens": context, "max_tokens": context}


def _anthropic_page(state: AppState, listed: dict[str, tuple[ModelConfig, bool]],
                    request: Request) -> dict[str, object]:
    """One page of Anthropic's model list: `limit` ids after `after_id` (or the last `limit` before
    `before_id`), in listing order. Raises InvalidRequest for a `limit` out of range or a cursor
    that is no listed id."""
    query = request.query_params
    raw = query.get("limit", str(ANTHROPIC_PAGE))
    if not raw.isdigit() or not 1 <= int(raw) <= ANTHROPIC_PAGE_MAX:
        raise InvalidRequest(f"limit: must be an integer from 1 to {ANTHROPIC_PAGE_MAX}, got {raw[:40]!r}.",
                             param="limit")
    limit, ids = int(raw), list(listed)
    before, after = query.get("before_id"), query.get("after_id")
    for param, cursor in (("before_id", before), ("after_id", after)):
        if cursor is not None and cursor not in listed:
            raise InvalidRequest(f"{param}: no listed model has the id `{cursor[:200]}`.", param=param)
    if before is not None:
        end = ids.index(before)
        page, more = ids[max(0, end - limit):end], end > limit
    else:
        start = ids.index(after) + 1 if after is not None else 0
        page, more = ids[start:start + limit], start + limit < len(ids)
    return {"data": [_anthropic_model(state, name, listed[name]) for name in page], "has_more": more,
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None}


def _anthropic_error(exc: GatewayError) -> Response:
    """`exc` as Anthropic's error object, with its status and headers."""
    return Response(error_body(exc.status, exc.message), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def router() -> APIRouter:
    """`/v1/models` routes (under `/v1`: the auth middleware guards them), for `create_app`."""
    models = APIRouter(tags=["models"])
    models.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList,
                         summary="List models", responses=error_responses(401, 403))
    # `:path`: ids may hold a slash; OpenAPI shows the parameter as `{model_id}`.
    models.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"], response_model=Model,
                         summary="Retrieve a model", responses=error_responses(401, 403, 404))
    return models
