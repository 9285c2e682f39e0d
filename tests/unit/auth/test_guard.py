"""AuthGuard's answers (OpenAI error objects) and `require_scope` on a small Starlette app."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.auth.guard import AuthGuard
from gateway.auth.keys import KeyRing, Principal, hash_key
from gateway.auth.limits import MemoryRateLimiter, Verdict
from gateway.auth.middleware import require_scope
from gateway.auth.params import ApiKeyConfig, AuthConfig
from gateway.errors import InvalidApiKey, PermissionDenied, RateLimited, RateLimitUnavailable
from gateway.observability.metrics import GatewayMetrics

USER_KEY = "sk-user-" + "u" * 32
ADMIN_KEY = "sk-admin-" + "a" * 32
KEYS = [ApiKeyConfig(name="alice", sha256=hash_key(USER_KEY), requests_per_minute=1),
        ApiKeyConfig(name="ops", sha256=hash_key(ADMIN_KEY), scopes=["user", "admin"])]


class DownLimiter:
    """A limiter whose store never answers (Redis down)."""

    async def acquire(self, principal: Principal, tokens: int, requests: int = 1) -> Verdict | None:
        return None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def guard(limiter: Any = None, **auth: Any) -> AuthGuard:
    config = AuthConfig(enabled=True, keys=KEYS, **auth)
    return AuthGuard(config, KeyRing(KEYS), limiter or MemoryRateLimiter(), GatewayMetrics())


def test_authenticate() -> None:
    g = guard()
    assert g.authenticate(f"Bearer {USER_KEY}").name == "alice"
    with pytest.raises(InvalidApiKey) as missing:
        g.authenticate(None)
    with pytest.raises(InvalidApiKey) as wrong:
        g.authenticate(f"Bearer {USER_KEY}x")
    assert missing.value.body()["error"]["code"] == wrong.value.body()["error"]["code"] == "invalid_api_key"
    assert (wrong.value.status, wrong.value.body()["error"]["type"]) == (401, "invalid_request_error")
    assert USER_KEY not in wrong.value.message
    assert g.metrics.registry.get_sample_value("kimi_gateway_auth_failures_total", {"reason": "missing"}) == 1
    assert g.metrics.registry.get_sample_value("kimi_gateway_auth_failures_total", {"reason": "invalid"}) == 1


def test_authorize() -> None:
    g = guard()
    g.authorize(g.authenticate(f"Bearer {ADMIN_KEY}"), "admin")
    with pytest.raises(PermissionDenied) as denied:
        g.authorize(g.authenticate(f"Bearer {USER_KEY}"), "admin")
    assert (denied.value.status, denied.value.body()["error"]["code"]) == (403, "insufficient_permissions")


@pytest.mark.anyio
async def test_rate_limited_is_openais_429() -> None:
    g = guard()
    alice = g.authenticate(f"Bearer {USER_KEY}")
    await g.check_quota(alice, 10)
    with pytest.raises(RateLimited) as info:
        await g.check_quota(alice, 10)
    error = info.value.body()["error"]
    assert (info.value.status, error["type"], error["code"], error["param"]) == (
        429, "requests", "rate_limit_exceeded", None)
    assert error["message"].startswith("Rate limit reached for API key alice on requests per min (RPM): "
                                       "Limit 1, Used 1, Requested 1. Please try again in ")
    assert 1 <= int(info.value.headers["retry-after"]) <= 120
    assert g.metrics.registry.get_sample_value("kimi_gateway_rate_limited_total",
                                               {"key": hash_key(USER_KEY)[:12], "limit": "requests"}) == 1  # key id
    ops = g.authenticate(f"Bearer {ADMIN_KEY}")
    for _ in range(5):
        await g.check_quota(ops, 10**9)  # no limits, no limiter call


def test_request_too_large_is_not_retried() -> None:
    from gateway.auth.guard import rate_limited

    exc = rate_limited(Principal("alice", frozenset({"user"}), None, 1000),
                       Verdict(False, "tokens", 1000, 0, 5000, math.inf))
    assert exc.body()["error"]["type"] == "tokens"
    assert exc.message.startswith("Request too large for API key alice on tokens per min (TPM): Limit 1000, "
                                  "Requested 5000.")
    assert exc.headers == {"x-should-retry": "false"}


@pytest.mark.anyio
async def test_fail_open_and_fail_closed() -> None:
    alice = Principal("alice", frozenset({"user"}), 1, None)
    opened = guard(DownLimiter(), fail_mode="open")
    await opened.check_quota(alice, 1)
    assert opened.metrics.registry.get_sample_value("kimi_gateway_rate_limit_unavailable_total",
                                              {"action": "allowed"}) == 1
    closed = guard(DownLimiter(), fail_mode="closed", redis_retry_after=2.5)
    with pytest.raises(RateLimitUnavailable) as info:
        await closed.check_quota(alice, 1)
    assert (info.value.status, info.value.headers["retry-after"]) == (503, "3")
    assert closed.metrics.registry.get_sample_value("kimi_gateway_rate_limit_unavailable_total",
                                              {"action": "refused"}) == 1


def app_with(auth: AuthGuard | None) -> Starlette:
    """A Starlette app shaped like the gateway (lifespan state `service.state.auth`) with one admin route."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        yield {"service": SimpleNamespace(state=SimpleNamespace(auth=auth))}

    @require_scope("admin")
    async def drain(request: Request) -> Response:
        return PlainTextResponse("drained")

    return Starlette(routes=[Route("/admin/drain", drain, methods=["POST"])], lifespan=lifespan)


def test_require_scope() -> None:
    with TestClient(app_with(guard())) as client:
        missing = client.post("/admin/drain")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        user = client.post("/admin/drain", headers={"authorization": f"Bearer {USER_KEY}"})
        assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
        admin = client.post("/admin/drain", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert (admin.status_code, admin.text) == (200, "drained")
    with TestClient(app_with(None)) as client:  # auth disabled: open
        assert client.post("/admin/drain").status_code == 200
