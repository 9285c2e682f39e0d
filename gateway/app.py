"""`create_app(config)`: the Starlette app; its lifespan builds one AppState and stops its tasks."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api import admin, models, ops, stored_responses
from gateway.api.anthropic_errors import AnthropicEndpoint
from gateway.api.proxy import ProxyEndpoint
from gateway.api.responses import JSONResponse, error_response
from gateway.auth.middleware import http_middleware
from gateway.config import GatewayConfig
from gateway.dispatch import ProxyService
from gateway.errors import GatewayError, MethodNotAllowed, NotFound
from gateway.state import AppState


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        return error_response(NotFound(f"Unknown path {request.url.path}."))
    if status == 405:
        return error_response(MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.",
                                               headers=dict(getattr(exc, "headers", None) or {})))
    return error_response(GatewayError(str(getattr(exc, "detail", "error"))))


def create_app(config: GatewayConfig, state: AppState | None = None, metrics_dir: str | None = None,
               config_path: str | None = None) -> Starlette:
    """The gateway ASGI app. `state` may be given by tests; otherwise it is built at start-up
    (`metrics_dir`, `config_path`: see `AppState.build`). With a config file, SIGHUP reloads it
    (gateway/reload.py) when the app runs in the main thread."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, ProxyService]]:
        app_state = state or AppState.build(config, metrics_dir, config_path)
        await app_state.start()
        app.state.gateway = app_state  # how the server's signal handler reaches it: `begin_draining(app)`
        hangup = _reload_on_sighup(app_state)
        try:
            yield {"service": ProxyService(app_state)}
        finally:
            if hangup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            app.state.gateway = None
            await app_state.stop()

    routes = [
        Route("/v1/models", models.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", models.retrieve_model, methods=["GET"]),
        Route("/v1/responses/{response_id}", stored_responses.retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", stored_responses.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", stored_responses.cancel_response, methods=["POST"]),
        Route("/health", ops.health, methods=["GET"]),
        Route("/ready", ops.ready, methods=["GET"]),
        Route("/metrics", ops.metrics, methods=["GET"]),
        *admin.routes(),  # /admin/* (admin scope when auth is on) and the /dashboard status page
    ]
    middleware = http_middleware(config)  # CORS, then /v1/* auth (gateway/auth/middleware.py)
    proxied = {"/v1/chat/completions": ProxyEndpoint("chat"), "/v1/completions": ProxyEndpoint("completions"),
               "/v1/messages": AnthropicEndpoint("messages"),
               "/v1/messages/count_tokens": AnthropicEndpoint("count_tokens"),
               "/v1/responses": ProxyEndpoint("responses")}
    app = GatewayApp({path: _wrapped(endpoint, middleware) for path, endpoint in proxied.items()},
                     routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                     middleware=middleware)
    app.router.redirect_slashes = False  # `/v1/chat/completions/` is a 404, not a 307 with no body
    app.state.gateway = None
    return app


class GatewayApp(Starlette):
    """Starlette, but the proxied endpoints are reached without its router and its per-message
    middleware: every relayed chunk of a stream passes through each `send` wrapper, and the
    profile of a loaded gateway showed Starlette's wrappers and route matching at ~10 % of its CPU.
    They keep the same CORS/auth middleware; ProxyEndpoint answers every error itself (405 too)."""

    def __init__(self, proxied: dict[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxied = proxied

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (endpoint := self._proxied.get(scope["path"])) is not None:
            scope["app"] = self
            await endpoint(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _wrapped(endpoint: ASGIApp, middleware: list[Middleware]) -> ASGIApp:
    """`endpoint` inside `middleware` (outermost first), as Starlette would build it."""
    app = endpoint
    for cls, args, kwargs in reversed(middleware):
        app = cls(app, *args, **kwargs)
    return app


def _reload_on_sighup(state: AppState) -> bool:
    """Install SIGHUP → reload on the running loop; False where it cannot be (not the main thread,
    no config file, no SIGHUP on the platform)."""
    if state.config_path is None or not hasattr(signal, "SIGHUP"):
        return False
    from gateway.reload import reload_logged

    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()  # keeps each reload task referenced until it ends

    def on_hangup() -> None:
        task = loop.create_task(reload_logged(state), name="config reload")
        running.add(task)
        task.add_done_callback(running.discard)

    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
        return True
    return False


def begin_draining(app: Starlette) -> None:
    """Mark the running app's AppState as draining (`/ready` → 503); a no-op outside its lifespan.

    Requests keep being served: see `AppState.begin_draining`.
    """
    app_state: AppState | None = app.state.gateway
    if app_state is not None:
        app_state.begin_draining()
