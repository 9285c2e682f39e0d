"""`create_app(config)`: the FastAPI app; its lifespan builds one AppState and stops its tasks."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api import admin, models, ops, stored_responses, tokenize
from gateway.api.proxied import PROXIED_ROUTES, ProxiedApps, ProxiedRoute, add_proxied_paths, proxied_apps
from gateway.auth.middleware import http_middleware, is_protected
from gateway.config import GatewayConfig
from gateway.dialects.registry import dialect_for_path
from gateway.dispatch.service import ProxyService
from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, NotFound
from gateway.http_answers import JSONResponse, error_response
from gateway.state import AppState


async def _http_error(request: Request, exc: Exception) -> Response:
    """The router's 404 / 405 in the error shape of the API the path is under (`dialect_for_path`):
    OpenAI's, Anthropic's under `/v1/messages` (an Anthropic SDK calling an endpoint the gateway
    does not serve, such as the batch API)."""
    status = getattr(exc, "status_code", 500)
    error: GatewayError
    if status == 404:
        error = NotFound(f"Unknown path {request.url.path}.")
    elif status == 405:
        error = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.",
                                 headers=dict(getattr(exc, "headers", None) or {}))
    else:
        error = GatewayError(str(getattr(exc, "detail", "error")))
    dialect = dialect_for_path(request.url.path)
    body = dialect.error_bytes(error, None)
    return Response(body, status_code=dialect.answer_status(error.status), headers=error.headers,
                    media_type="application/json")


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    """A GatewayError raised by a route or a dependency (the admin scope check): its OpenAI error."""
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def _invalid_parameters(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's parameter validation, answered as an OpenAI 400 instead of its 422 `{"detail"}`
    (the routes take only string path parameters today, so nothing should reach it)."""
    return error_response(InvalidRequest(f"Invalid request parameters: {exc}"))


def create_app(config: GatewayConfig, state: AppState | None = None, metrics_dir: str | None = None,
               config_path: str | None = None, proxied: tuple[ProxiedRoute, ...] = PROXIED_ROUTES) -> GatewayApp:
    """The gateway ASGI app. `state` may be given by tests; otherwise it is built at start-up
    (`metrics_dir`, `config_path`: see `AppState.build`). With a config file, SIGHUP reloads it
    (gateway/serving/reload.py) when the app runs in the main thread. `proxied`: the inference endpoints
    served on the fast path (gateway/api/proxied.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, ProxyService]]:
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

    middleware = http_middleware(config)  # CORS, then /v1/* auth (gateway/auth/middleware.py)
    app = GatewayApp(
        proxied_apps(proxied, lambda endpoint: _wrapped(endpoint, middleware)), proxied,
        auth=config.auth.enabled, model_names=[n for m in config.served_models() for n in m.names()],
        title="kimi-gateway", version=_version(),
        summary="OpenAI-compatible gateway and multi-pool router for Kimi K3",
        lifespan=lifespan, middleware=middleware,
        exception_handlers={HTTPException: _http_error, GatewayError: _gateway_error,
                            RequestValidationError: _invalid_parameters},
        redirect_slashes=False,  # `/v1/chat/completions/` is a 404, not a 307 with no body
        docs_url=None, redoc_url=None)  # no docs page: Swagger UI / ReDoc load their assets from a CDN
    # /admin/* (admin scope when auth is on) and the /dashboard status page come from admin.routers().
    for router in (ops.router(), models.router(), stored_responses.router(), tokenize.router(), *admin.routers()):
        for route in list(router.routes):  # HEAD answered like GET, as Starlette's routes do (FastAPI's do not)
            if isinstance(route, APIRoute) and "GET" in route.methods:
                router.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                                     response_class=route.response_class)
        app.include_router(router)
    app.state.gateway = None
    return app


def _version() -> str:
    """The installed package's version, for the OpenAPI document's `info.version`."""
    try:
        return version("kimi-gateway")
    except PackageNotFoundError:
        return "0"


class GatewayApp(FastAPI):
    """FastAPI, but the proxied endpoints are reached without its router and its per-message
    middleware: every relayed chunk of a stream passes through each `send` wrapper, and the
    profile of a loaded gateway showed Starlette's wrappers and route matching at ~10 % of its CPU.
    They keep the same CORS/auth middleware; ProxyEndpoint answers every error itself (405 too).
    `/openapi.json` describes them from their table (`add_proxied_paths`) beside FastAPI's routes."""

    def __init__(self, proxied: ProxiedApps, table: tuple[ProxiedRoute, ...], auth: bool, model_names: list[str],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxied = proxied.exact
        self._templated = proxied if proxied.templated else None  # paths with `{id}`: tried after a miss
        self._table = table
        self._auth = auth
        self._model_names = model_names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
                (endpoint := self._proxied.get(scope["path"])) is not None
                or (self._templated is not None and (endpoint := self._templated.find(scope)) is not None)):
            scope["app"] = self
            await endpoint(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """The OpenAPI 3.1 document: FastAPI's routes, the proxied table's (the served model names as
        examples of `model`), bearer auth when it is on."""
        if self.openapi_schema is None:
            document = super().openapi()
            add_proxied_paths(document, self._table, self._model_names)
            _finish_openapi(document, self._auth)
        return self.openapi_schema  # type: ignore[return-value]


def _finish_openapi(document: dict[str, Any], auth: bool) -> None:
    """Drop what FastAPI adds that the gateway never answers (its 422 validation error:
    `_invalid_parameters` answers 400), and, with auth on, mark `/v1/*`, the tokenizer routes and
    `/admin/*` operations as needing a Bearer key."""
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if auth:
        document["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer", "description": "A gateway API key (`auth.keys`); "
            "`/admin/*` needs one with the `admin` scope."}}
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            if auth and (is_protected(path) or path.startswith("/admin/")):
                operation["security"] = [{"apiKey": []}]


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
    from gateway.serving.reload import reload_logged

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


def begin_draining(app: FastAPI) -> None:
    """Mark the running app's AppState as draining (`/ready` → 503); a no-op outside its lifespan.

    Requests keep being served: see `AppState.begin_draining`.
    """
    app_state: AppState | None = app.state.gateway
    if app_state is not None:
        app_state.begin_draining()
