"""`create_app(config)`: the Starlette app; its lifespan builds one AppState and stops its tasks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from gateway.api import admin, models, ops
from gateway.api.proxy import ProxyEndpoint
from gateway.api.responses import JSONResponse, error_response
from gateway.auth.middleware import http_middleware
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, MethodNotAllowed, NotFound
from gateway.service import ProxyService
from gateway.state import AppState


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        return error_response(NotFound(f"Unknown path {request.url.path}."))
    if status == 405:
        return error_response(MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}."))
    return error_response(GatewayError(str(getattr(exc, "detail", "error"))))


def create_app(config: GatewayConfig, state: AppState | None = None, metrics_dir: str | None = None) -> Starlette:
    """The gateway ASGI app. `state` may be given by tests; otherwise it is built at start-up
    (`metrics_dir`: see `AppState.build`)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, ProxyService]]:
        app_state = state or AppState.build(config, metrics_dir)
        await app_state.start()
        app.state.gateway = app_state  # how the server's signal handler reaches it: `begin_draining(app)`
        try:
            yield {"service": ProxyService(app_state)}
        finally:
            app.state.gateway = None
            await app_state.stop()

    routes = [
        Route("/v1/chat/completions", ProxyEndpoint("chat"), methods=["POST"]),
        Route("/v1/completions", ProxyEndpoint("completions"), methods=["POST"]),
        Route("/v1/models", models.list_models, methods=["GET"]),
        Route("/health", ops.health, methods=["GET"]),
        Route("/ready", ops.ready, methods=["GET"]),
        Route("/metrics", ops.metrics, methods=["GET"]),
        *admin.routes(),  # /admin/* (admin scope when auth is on) and the /dashboard status page
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=http_middleware(config))  # CORS, then /v1/* auth (gateway/auth/middleware.py)
    app.router.redirect_slashes = False  # `/v1/chat/completions/` is a 404, not a 307 with no body
    app.state.gateway = None
    return app


def begin_draining(app: Starlette) -> None:
    """Mark the running app's AppState as draining (`/ready` → 503); a no-op outside its lifespan.

    Requests keep being served: see `AppState.begin_draining`.
    """
    app_state: AppState | None = app.state.gateway
    if app_state is not None:
        app_state.begin_draining()
