"""gateway/dialects on their own: one dialect per proxied route, looked up by name and by path, the
usage-patch rule in one place, and each API's errors in its own shape."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pydantic import ValidationError

from gateway.api.proxied import PROXIED_ROUTES
from gateway.backends.engine_kinds import ENGINES
from gateway.dialects.base import usage_patch
from gateway.dialects.names import APIS, CHAT, COUNT_TOKENS, MESSAGES, RESPONSES
from gateway.dialects.registry import DIALECTS, dialect_for, dialect_for_path
from gateway.dispatch.attempt import UPSTREAM_PATHS
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.routing.features import RoutingRequest


def test_every_proxied_route_has_its_dialect_and_the_engine_gets_the_clients_path() -> None:
    assert tuple(DIALECTS) == APIS
    for route in PROXIED_ROUTES:
        assert dialect_for(route.api).api == route.api
        assert UPSTREAM_PATHS[route.api] == route.path == dialect_for(route.api).path
    with pytest.raises(KeyError):
        dialect_for("images")


@pytest.mark.parametrize(("path", "api"), [
    ("/v1/messages", MESSAGES), ("/v1/messages/batches", MESSAGES), ("/v1/responses/resp_1", RESPONSES),
    ("/v1/chat/completions", CHAT), ("/v1/embeddings", CHAT), ("/nowhere", CHAT)])
def test_a_paths_errors_take_the_shape_of_the_api_it_is_under(path: str, api: str) -> None:
    assert dialect_for_path(path).api == api


REQUEST = RoutingRequest(api=CHAT, model="kimi-k3", prompt_tokens=10, output_tokens=None, stream=True,
                         modalities=frozenset({"text"}), estimate_method="bytes")


def test_the_usage_patch_is_for_streams_whose_client_did_not_ask_for_usage() -> None:
    vllm = ENGINES["vllm"]
    assert usage_patch(REQUEST, vllm)
    assert not usage_patch(replace(REQUEST, include_usage=True), vllm)
    assert not usage_patch(replace(REQUEST, stream=False), vllm)
    assert not usage_patch(REQUEST, replace(vllm, supports_include_usage=False))


def test_only_anthropics_endpoints_rename_the_status_and_the_request_id() -> None:
    for api, dialect in DIALECTS.items():
        anthropic = api in (MESSAGES, COUNT_TOKENS)
        assert dialect.answer_status(503) == (529 if anthropic else 503)
        assert dialect.request_id_header == (b"request-id" if anthropic else None)
        body = json.loads(dialect.error_bytes(ContextLengthExceeded("too long", param=dialect.prompt_param), "r1"))
        if anthropic:
            assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"},
                            "request_id": "r1"}
        else:
            assert body["error"]["code"] == "context_length_exceeded"


def test_count_tokens_generates_nothing_and_its_stream_has_no_end_events() -> None:
    counting = dialect_for(COUNT_TOKENS)
    assert not counting.generates and counting.output_limit_field is None and counting.stream_end_events == ()
    assert dialect_for(MESSAGES).generates and dialect_for(MESSAGES).stream_end_events == (b"message_stop",)


def test_an_invalid_body_fails_validation_in_its_dialect() -> None:
    for dialect in DIALECTS.values():
        with pytest.raises((ValidationError, InvalidRequest)):
            dialect.validate({"model": 5})
