"""`GET /v1/models` and `GET /v1/models/{id}`: the served model and its aliases, in OpenAI's shapes
(https://platform.openai.com/docs/api-reference/models)."""

from __future__ import annotations

from starlette.requests import Request

from gateway.api.responses import JSONResponse, error_response
from gateway.errors import ModelNotFound
from gateway.state import AppState


async def list_models(request: Request) -> JSONResponse:
    """`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}`."""
    state: AppState = request.state.service.state
    model = state.config.model
    return JSONResponse({"object": "list", "data": [_model_object(state, name) for name in model.names()]})


async def retrieve_model(request: Request) -> JSONResponse:
    """`{"id", "object": "model", "created", "owned_by"}` for a listed id (exactly as listed; ids
    may hold a slash, `moonshotai/Kimi-K3`), else 404 `model_not_found` as OpenAI answers it
    (the OpenAI SDKs' `models.retrieve()`)."""
    state: AppState = request.state.service.state
    wanted = request.path_params["model_id"]
    if wanted not in state.config.model.names():
        return error_response(ModelNotFound(
            f"The model `{wanted[:200]}` does not exist or you do not have access to it.", param="model"))
    return JSONResponse(_model_object(state, wanted))


def _model_object(state: AppState, name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": state.started_unix, "owned_by": state.config.model.owned_by}
