"""`GET /v1/models` and `GET /v1/models/{id}`: the served model, its aliases and the LoRA adapters
its pools serve, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/models), an
adapter with its base model as `parent`, as vLLM and SGLang list theirs
(vllm/entrypoints/openai/serving_models.py `show_available_models`; SGLang's `available_models`)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from gateway.api.schemas import Model, ModelList, error_responses
from gateway.errors import ModelNotFound
from gateway.http_answers import JSONResponse, error_response
from gateway.state import AppState


async def list_models(request: Request) -> JSONResponse:
    """`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}, ...]}`: the
    model and its aliases, then every LoRA adapter (sorted by name) with `"parent"`: the model."""
    state: AppState = request.state.service.state
    return JSONResponse({"object": "list", "data": [_model_object(state, name) for name in _listed(state)]})


async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    """`{"id", "object": "model", "created", "owned_by"}` (an adapter's with `parent`) for a listed
    id (exactly as listed; ids may hold a slash, `moonshotai/Kimi-K3`), else 404 `model_not_found`
    as OpenAI answers it (the OpenAI SDKs' `models.retrieve()`)."""
    state: AppState = request.state.service.state
    wanted = model_id
    if wanted not in state.config.model.names() and wanted not in state.registry.adapter_names():
        return error_response(ModelNotFound(
            f"The model `{wanted[:200]}` does not exist or you do not have access to it.", param="model"))
    return JSONResponse(_model_object(state, wanted))


def _listed(state: AppState) -> list[str]:
    names = state.config.model.names()
    return [*names, *sorted(state.registry.adapter_names() - set(names))]


def _model_object(state: AppState, name: str) -> dict[str, object]:
    model = state.config.model
    listed: dict[str, object] = {"id": name, "object": "model", "created": state.started_unix,
                                 "owned_by": model.owned_by}
    if name in state.registry.adapter_names():  # an adapter the engines list under an alias is the adapter
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
