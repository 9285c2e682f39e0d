"""HTTP-level auth: the `/v1/*` middleware, CORS, and `require_scope` for admin routes.

Both middlewares are pure ASGI (they touch only `http.response.start`), so streamed bodies pass
through unbuffered and the proxy still sees the client's `http.disconnect`.

Order (outermost first): CORS, then auth. CORS answers a browser's preflight `OPTIONS` itself
(preflights carry no `Authorization`) and adds its headers to every answer, 401s and 429s
included, so a browser client can read them.

Admin routes: a FastAPI route depends on `scope_check("admin")` (a plain Starlette endpoint is
wrapped with `require_scope("admin")` instead):

    router.add_api_route("/admin/reload", reload, methods=["POST"], dependencies=[Depends(scope_check("admin"))])

It authenticates the request itself (admin routes need not live under `/v1`) and answers 401 for
a missing or wrong key, 403 for a key without the scope. With `auth.enabled: false` every route,
admin ones included, is open: auth off means the gateway trusts its network.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.keys import Principal, Scope
from gateway.auth.standing import RATE_LIMIT_HEADERS
from gateway.config import GatewayConfig
from gateway.errors import NO_RETRY, GatewayError
from gateway.http_answers import error_response

if TYPE_CHECKING:
    from gateway.auth.guard import AuthGuard

ASGIScope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, Receive, Send], Awaitable[None]]
Endpoint = Callable[[Request], Awaitable[Response]]

PRINCIPAL = "kimi_gateway.principal"
"""The ASGI scope key the middleware leaves the authenticated `Principal` under."""

AUTH_ERROR = "kimi_gateway.auth_error"
"""The ASGI scope key under which a refusal (401/403) is handed to an app that answers and records
it itself (one with `records_auth_errors = True`: the proxy endpoints, so a refused request gets its
access-log line, request id and `kimi_gateway_requests_total` count like any other)."""

EXPOSED_HEADERS = ("x-request-id", "retry-after", NO_RETRY, "x-kimi-gateway-pool", "x-kimi-gateway-worker",
                   "x-kimi-gateway-route-reason", "x-kimi-gateway-attempts",
                   "x-kimi-gateway-estimated-prompt-tokens", "x-kimi-gateway-skipped-pools", *RATE_LIMIT_HEADERS)
"""Response headers a browser script may read (besides the CORS-safelisted ones): the SDKs' retry
advice and the key's rate-limit standing among them."""


def guard_of(scope: ASGIScope) -> AuthGuard | None:
    """The running gateway's AuthGuard (from the lifespan state), None when auth is off."""
    service = (scope.get("state") or {}).get("service")
    return None if service is None else service.state.auth


def principal_of(scope: ASGIScope) -> Principal | None:
    """The principal the middleware authenticated for this request, if any."""
    return scope.get(PRINCIPAL)


KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})
"""Paths outside `/v1` that need a key too: the engines' tokenizer routes (gateway/api/tokenize.py)."""


def is_protected(path: str) -> bool:
    """Paths that need a key with the `user` scope: everything under `/v1`, and `KEYED_PATHS`."""
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS


class AuthMiddleware:
    """Every `/v1/*` request (and `KEYED_PATHS`) needs a key with the `user` scope (401/403 otherwise),
    so a route added under `/v1` later is protected without doing anything. `/health`, `/ready` and `/metrics` stay
    open. The principal is passed on in `scope[PRINCIPAL]` (quotas, the access log)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._app_records_refusals = getattr(app, "records_auth_errors", False)

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        guard = guard_of(scope) if scope["type"] == "http" and is_protected(scope["path"]) else None
        if guard is None:
            await self.app(scope, receive, send)
            return
        try:
            principal = guard.authenticate_headers(scope["headers"])
            guard.authorize(principal, "user")
        except GatewayError as exc:
            if self._app_records_refusals:
                scope[AUTH_ERROR] = exc
                await self.app(scope, receive, send)
            else:
                await error_response(exc)(scope, receive, send)
            return
        # In place, not a copy: outer middleware (the shutdown guard) reads what the proxy leaves here.
        scope[PRINCIPAL] = principal
        await self.app(scope, receive, send)


def require_scope(scope: Scope) -> Callable[[Endpoint], Endpoint]:
    """Decorator for a Starlette endpoint (`async def f(request) -> Response`) that needs `scope`.

    401 without a valid key, 403 without the scope, the endpoint's answer otherwise. Open when auth
    is disabled (see the module docstring).
    """

    check = scope_check(scope)

    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            try:
                check(request)
            except GatewayError as exc:
                return error_response(exc)
            return await endpoint(request)

        return guarded

    return decorate


def scope_check(scope: Scope) -> Callable[[Request], None]:
    """A check that the request's key has `scope`: raises the GatewayError to answer (401 without a
    valid key, 403 without the scope); passes when auth is disabled. Used as a FastAPI dependency
    (`dependencies=[Depends(scope_check("admin"))]`, the app answers the error) and by `require_scope`."""

    def check(request: Request) -> None:
        guard = guard_of(request.scope)
        if guard is not None:
            principal = principal_of(request.scope) or guard.authenticate_headers(request.scope["headers"])
            guard.authorize(principal, scope)

    return check


def http_middleware(config: GatewayConfig) -> list[Middleware]:
    """The middleware stack for `config`, outermost first: CORS when `cors.enabled`, auth when
    `auth.enabled` (neither costs anything when off)."""
    stack: list[Middleware] = []
    if config.cors.enabled:
        # allow_headers "*" mirrors the preflight's requested headers: Authorization, and the many
        # x-stainless-* headers the OpenAI JS SDK sends. Bearer keys, not cookies: no credentials.
        stack.append(Middleware(CORSMiddleware, allow_origins=list(config.cors.allow_origins),
                                allow_methods=["GET", "POST"], allow_headers=["*"],
                                expose_headers=list(EXPOSED_HEADERS), max_age=config.cors.max_age))
    if config.auth.enabled:
        stack.append(Middleware(AuthMiddleware))
    return stack
