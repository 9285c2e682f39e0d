"""The proxy endpoint's steps that need no socket: refusing a request from its head alone, and
telling a shutdown cut, a stalled reader and a hang-up apart (`gateway/api/proxy.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.api.proxy import check_head, hung_up
from gateway.auth.middleware import AUTH_ERROR
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.dispatch.ledger import Ledger
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    MethodNotAllowed,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from gateway.lifecycle import SHUTDOWN_GUARD, ShutdownGuard
from gateway.metrics import GatewayMetrics
from gateway.record import RequestOutcome
from gateway.request_head import SEND_STALLED

JSON = {"content-type": "application/json"}


def scope(method: str = "POST", **extra: Any) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/v1/chat/completions", **extra}


def test_a_well_formed_head_passes() -> None:
    check_head(scope(), {**JSON, "content-length": "100"}, 100, json_only=True)
    check_head(scope(), {"content-type": "application/vnd.api+json", "content-encoding": "identity"}, 100, True)
    check_head(scope(), {"content-type": "text/plain"}, 100, json_only=False)  # auth on: keys guard the origin
    check_head(scope(), {}, 100, json_only=True)  # no type and no Origin: curl-like, not a browser


@pytest.mark.parametrize(("request_scope", "headers", "json_only", "error", "status"), [
    (scope("GET"), JSON, True, MethodNotAllowed, 405),
    (scope(), {**JSON, "content-length": "101"}, True, PayloadTooLarge, 413),
    (scope(), {"content-type": "text/plain"}, True, UnsupportedMediaType, 415),
    (scope(), {"origin": "https://evil.example"}, True, UnsupportedMediaType, 415),
    (scope(), {**JSON, "content-encoding": "gzip"}, True, UnsupportedMediaType, 415),
    # the auth middleware's refusal comes first, even for a GET
    (scope("GET", **{AUTH_ERROR: InvalidApiKey("Incorrect API key provided.")}), JSON, False, InvalidApiKey, 401),
])
def test_a_bad_head_is_refused_before_the_body(request_scope: dict[str, Any], headers: dict[str, str],
                                               json_only: bool, error: type[GatewayError], status: int) -> None:
    with pytest.raises(error) as caught:
        check_head(request_scope, headers, 100, json_only)
    assert caught.value.status == status


def test_method_not_allowed_names_the_allowed_method() -> None:
    with pytest.raises(MethodNotAllowed) as caught:
        check_head(scope("PUT"), JSON, 100, True)
    assert caught.value.headers == {"allow": "POST"}


def ledger(metrics: GatewayMetrics | None = None) -> Ledger:
    """A chat request's ledger in pool `small` whose answer started (status 200)."""
    config = parse_config({"pools": [{"name": "small", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"]}]}, environ={})
    book = Ledger("chat", "r", None, metrics or GatewayMetrics(), WorkerRegistry(config))
    book.record.pool, book.record.status = "small", 200
    return book


def test_a_hang_up_is_told_by_its_stage() -> None:
    before, during = ledger(), ledger()
    hung_up(scope(), before, response_started=False)
    hung_up(scope(), during, response_started=True)
    assert (before.record.outcome, before.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT,
                                                                       "before_response")
    assert (during.record.outcome, during.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT, "mid_stream")


def test_a_stalled_reader_is_counted_per_pool() -> None:
    metrics = GatewayMetrics()
    stalled = ledger(metrics)
    hung_up(scope(**{SEND_STALLED: True}), stalled, response_started=True)
    assert (stalled.record.outcome, stalled.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT,
                                                                         "send_stalled")
    assert metrics.registry.get_sample_value("kimi_gateway_client_send_stalls_total", {"pool": "small"}) == 1


def test_the_end_of_the_grace_period_is_a_shutdown_not_a_hang_up() -> None:
    guard = ShutdownGuard(app=None)  # type: ignore[arg-type]  # only its flag is read here
    quiet = ledger()
    hung_up(scope(**{SHUTDOWN_GUARD: guard}), quiet, response_started=False)
    assert quiet.record.outcome is RequestOutcome.CLIENT_DISCONNECT  # the guard has not hung up: the client did
    guard.hang_up()
    cut, streaming = ledger(), ledger()
    hung_up(scope(**{SHUTDOWN_GUARD: guard, SEND_STALLED: True}), cut, response_started=False)
    hung_up(scope(**{SHUTDOWN_GUARD: guard}), streaming, response_started=True)
    assert (cut.record.outcome, cut.record.status, cut.record.disconnect_stage) == (RequestOutcome.SHUTTING_DOWN,
                                                                                    503, None)
    assert (streaming.record.outcome, streaming.record.status) == (RequestOutcome.SHUTTING_DOWN, 200)
