"""`GET /v1/models` and `GET /v1/models/{id}`: every served model, its aliases and the LoRA
adapters its pools serve, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/models),
an adapter with its base model as `parent`, as vLLM and SGLang list theirs
(vllm/entrypoints/openai/serving_models.py `show_available_models`; SGLang's `available_models`).
With auth on, only what the caller's key may use (`Principal.may_use`; an alias is listed when its
model is): another id is answered as OpenAI answers a model the key has no access to, 404."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from gateway.api.params import ModelConfig
from gateway.api.schemas import Model, ModelList, error_responses
from gateway.auth.access import model_not_found_message
from gateway.auth.keys import Principal
from gateway.auth.middleware import principal_of
from gateway.errors import ModelNotFound
from gateway.http_answers import JSONResponse, error_response
from gateway.state import AppState


async def list_models(request: Request) -> JSONResponse:
    """`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}, ...]}`: each
    model (config order) and its aliases, then every LoRA adapter (sorted by name) with `"parent"`:
    the model whose pools serve it."""
    state: AppState = request.state.service.state
    listed = _listed(state, principal_of(request.scope))
    return JSONResponse({"object": "list", "data": [_model_object(state, name, model)
                                                     for name, model in listed.items()]})


async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    """`{"id", "object": "model", "created", "owned_by"}` (an adapter's with `parent`) for a listed
    id (exactly as listed; ids may hold a slash, `moonshotai/Kimi-K3`), else 404 `model_not_found`
    as OpenAI answers it (the OpenAI SDKs' `models.retrieve()`); the same for an id the caller's
    key may not use."""
    state: AppState = request.state.service.state
    model = _listed(state, principal_of(request.scope)).get(model_id)
    if model is None:
        return error_response(ModelNotFound(model_not_found_message(model_id), param="model"))
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


def _model_object(state: AppState, name: str, entry: tuple[ModelConfig, bool]) -> dict[str, object]:
    model, adapter = entry
    listed: dict[str, object] = {"id": name, "object": "model", "created": state.started_unix,
                                 "owned_by": model.owned_by}
    if adapter:
        listed["parent"] = model.name
    return listed


def router() -> APIRouter:
    """`/v1/models` routes (under `/v1`: the auth middleware guards them), for `create_app`."""
    models = APIRouter(tags=["models"])
    models.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList,
                         summary="List models", responses=error_responses(401, 403))
    # `:path`: ids may hold a slash; OpenAPI shows the parameter as `{model_id}`.
    models.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"], response_model=Model,
                         summary="Retrieve a model", responses=error_responses(401, 403, 404))
    return models
