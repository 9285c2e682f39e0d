"""`GET /v1/models`: the served model and its aliases, in OpenAI's list shape."""

from __future__ import annotations

from starlette.requests import Request

from gateway.api.responses import JSONResponse
from gateway.state import AppState


async def list_models(request: Request) -> JSONResponse:
    """`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}`."""
    state: AppState = request.state.service.state
    model = state.config.model
    data = [{"id": name, "object": "model", "created": state.started_unix, "owned_by": model.owned_by}
            for name in model.names()]
    return JSONResponse({"object": "list", "data": data})
