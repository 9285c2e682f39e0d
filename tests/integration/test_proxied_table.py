"""The proxied-route table (gateway/api/proxied.py) beyond the two exact POST paths it holds today:
a row with a `{name}` path and several methods on one path, as the Responses API's
`GET/DELETE /v1/responses/{id}` will need. Served on the fast path and written into /openapi.json."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from openapi_spec_validator import validate

from gateway.api.proxied import PROXIED_ROUTES, ProxiedRoute
from gateway.api.schemas import Model
from gateway.app import create_app
from gateway.auth.keys import hash_key
from gateway.config import parse_config
from gateway.serving.server import ThreadedServer

KEY = "sk-table-user"


class Echo:
    """A stand-in endpoint for a row (its own ASGI app, as a row's `endpoint` builds one): answers
    what the fast path handed it."""

    def __init__(self, api: Any) -> None:
        self.api = api

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = orjson.dumps({"api": self.api, "method": scope["method"], "params": scope.get("path_params", {})})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


TABLE = (*PROXIED_ROUTES,
         ProxiedRoute("/v1/things/{thing_id}", "chat", "Get a thing", None, Model, method="GET", streams=False,
                      endpoint=Echo),
         ProxiedRoute("/v1/things/{thing_id}", "completions", "Delete a thing", None, Model, method="DELETE",
                      streams=False, endpoint=Echo))


@pytest.fixture(params=[False, True], ids=["auth-off", "auth-on"])
def gateway(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    auth = {"enabled": True, "keys": [{"name": "app", "sha256": hash_key(KEY)}]} if request.param else {}
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"],
                                      "max_context_tokens": 4096}], **({"auth": auth} if auth else {})}, environ={})
    server = ThreadedServer(create_app(config, proxied=TABLE)).start()
    try:
        yield server.url, request.param
    finally:
        server.stop()


def test_a_templated_row_is_served_by_method_with_its_path_parameters(gateway: tuple[str, bool]) -> None:
    url, auth = gateway
    headers = {"authorization": f"Bearer {KEY}"} if auth else {}
    got = httpx.get(url + "/v1/things/resp_123", headers=headers)
    assert got.json() == {"api": "chat", "method": "GET", "params": {"thing_id": "resp_123"}}
    deleted = httpx.delete(url + "/v1/things/resp_9", headers=headers)
    assert deleted.json() == {"api": "completions", "method": "DELETE", "params": {"thing_id": "resp_9"}}
    refused = httpx.put(url + "/v1/things/resp_9", headers=headers)
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, DELETE"
    assert refused.json()["error"]["code"] == "method_not_allowed"
    deeper = httpx.get(url + "/v1/things/a/b", headers=headers)  # `{thing_id}` is one path segment
    assert deeper.status_code == 404 and deeper.json()["error"]["code"] == "not_found"
    if auth:  # the row sits behind the same /v1/* auth middleware
        assert httpx.get(url + "/v1/things/resp_123").status_code == 401


def test_a_templated_row_is_documented(gateway: tuple[str, bool]) -> None:
    url, _ = gateway
    document = httpx.get(url + "/openapi.json").json()
    validate(document)
    operations = document["paths"]["/v1/things/{thing_id}"]
    assert set(operations) == {"get", "delete"}
    get = operations["get"]
    assert get["parameters"] == [{"name": "thing_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    assert "requestBody" not in get and set(get["responses"]["200"]["content"]) == {"application/json"}
    ids = [operation["operationId"] for path in document["paths"].values() for operation in path.values()]
    assert len(ids) == len(set(ids))  # OpenAPI wants them unique; rows of one API kind share `api`
