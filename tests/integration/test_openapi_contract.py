"""The gateway's OpenAPI contract: `/openapi.json` is valid OpenAPI 3.1, describes every endpoint
(the proxied ones from their table too), and a real gateway on simulated workers keeps it under
Schemathesis' fuzzing (no 5xx, every answer of a documented status, type and shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gateway.api.proxied import PROXIED_ROUTES
from gateway.auth.keys import hash_key
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

USER_KEY = "sk-contract-user"
ADMIN_KEY = "sk-contract-admin"
AUTH = {"enabled": True, "keys": [{"name": "app", "sha256": hash_key(USER_KEY)},
                                  {"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["user", "admin"]}]}

# Examples per operation and generation mode: enough to reach every documented error branch the
# generators find quickly, few enough that the whole fuzz takes seconds.
EXAMPLES = 12
# With auth on, what the run adds is the guard's contract, the same for any body: every case is sent
# with the admin key and Schemathesis' auth checks resend it with no key and a wrong one (401,
# documented, in the error shape). The body space is the auth-off run's; 4 positive and 4 negative
# cases per operation still put every operation through the guard with valid and invalid bodies, at a
# third of the generation cost (drawing the large request bodies is most of the fuzz's CPU).
AUTH_EXAMPLES = 4


def gateway_on_sims(start_sim: StartSim, start_gateway: StartGateway, **settings: Any) -> RunningGateway:
    """A gateway over two pools of simulated vLLM workers (a short- and a long-context pool)."""
    short, long = start_sim("vllm", max_context_tokens=8192), start_sim("vllm")
    return start_gateway([pool("short", "vllm", [short.url], 8192), pool("long", "vllm", [long.url], 131072)],
                         **settings)


def test_openapi_json_is_valid_openapi_3_1_and_describes_every_endpoint(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw = gateway_on_sims(start_sim, start_gateway)
    document = httpx.get(gw.url + "/openapi.json").json()
    validate(document)  # raises OpenAPIValidationError with the offending part
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    for route in PROXIED_ROUTES:
        operation = paths[route.path][route.method.lower()]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{route.request.__name__}"}  # type: ignore[union-attr]
        media = {"application/json", "text/event-stream"} if route.streams else {"application/json"}
        assert set(operation["responses"]["200"]["content"]) == media
        assert set(operation["responses"]) == {"200", *map(str, route.errors)}
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + route.error.__name__)
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/v1/models/{model_id}", "/admin/workers",
                 "/admin/workers/{pool}/{index}", "/admin/workers/{pool}/{index}/drain",
                 "/admin/workers/{pool}/{index}/undrain", "/admin/reload", "/admin/status", "/dashboard",
                 "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"):
        assert path in paths, path
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorObject"]["required"]) == {"message", "type", "param", "code"}
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses"} <= set(paths)
    assert "529" in paths["/v1/messages"]["post"]["responses"]  # Anthropic's overloaded_error
    assert "HTTPValidationError" not in schemas  # FastAPI's 422 is never answered
    assert "securitySchemes" not in document.get("components", {})  # auth off: nothing to send


def test_openapi_json_names_the_bearer_key_where_auth_applies(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    gw = gateway_on_sims(start_sim, start_gateway, auth=AUTH)
    document = httpx.get(gw.url + "/openapi.json").json()  # public, like /health
    validate(document)
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    for path, operations in document["paths"].items():
        for operation in operations.values():
            guarded = path.startswith(("/v1/", "/admin/"))
            assert (operation.get("security") == [{"apiKey": []}]) is guarded, path


def test_no_interactive_docs_page_without_a_cdn(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """FastAPI's Swagger UI and ReDoc pages load their scripts from a CDN: they are off."""
    gw = gateway_on_sims(start_sim, start_gateway)
    for path in ("/docs", "/redoc"):
        answer = httpx.get(gw.url + path)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_head_is_answered_like_get_on_the_fastapi_routes(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Starlette's routes answered HEAD for GET; FastAPI's would not, so the app adds it (load
    balancers may probe with HEAD). The document lists GET only."""
    gw = gateway_on_sims(start_sim, start_gateway)
    for path in ("/health", "/metrics", "/dashboard", "/v1/models"):
        answer = httpx.head(gw.url + path)
        assert answer.status_code == 200 and answer.content == b"", path
    assert all("head" not in ops for ops in httpx.get(gw.url + "/openapi.json").json()["paths"].values())


def fuzz(gw: RunningGateway, bearer: str | None = None, examples: int = EXAMPLES) -> None:
    """Run Schemathesis' default checks (no 5xx, documented status codes, content types and
    response schemas, ...) on every operation of the gateway's own schema, `examples` positive and
    negative cases each; raise the first failure with its reproduction."""
    # Failures show the request as sent: the default sanitizer masks fields named like secrets (`max_tokens`).
    options: dict[str, Any] = {"output": {"sanitization": {"enabled": False}}}
    if bearer is not None:  # for the schema's `apiKey` scheme; the auth checks also send none and a wrong one
        options["auth"] = {"openapi": {"apiKey": {"bearer": bearer}}}
    config = schemathesis.config.SchemathesisConfig.from_dict(options)
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    proxied = {(route.method, route.path) for route in PROXIED_ROUTES}
    for operation in operations:
        # Negative examples need an input that can be invalid: a body (path parameters are any string).
        negative = (GenerationMode.NEGATIVE,) if len(operation.body) > 0 else ()
        for mode in (GenerationMode.POSITIVE, *negative):
            # A schema-valid inference request may still not fit any pool's context (400
            # `context_length_exceeded`, as OpenAI answers): no JSON Schema can count tokens, so there
            # that 400 and no other replaces Schemathesis' "valid data is accepted" check.
            inference = (operation.method.upper(), operation.path) in proxied and mode is GenerationMode.POSITIVE
            fuzz_operation(gw, operation.as_strategy(generation_mode=mode), examples, inference)
        # Cases built around the schema's examples (the served model names for `model`: these reach a worker).
        for strategy in schema.get_strategies_from_examples(operation):
            fuzz_operation(gw, strategy, 3, (operation.method.upper(), operation.path) in proxied)
    # The `model` examples (the served names) let some cases through to the simulated workers, so the
    # answers' documented shapes (JSON and SSE) were checked too, not only the refusals.
    assert served_2xx(gw, "chat") > 0 and served_2xx(gw, "completions") > 0


def served_2xx(gw: RunningGateway, api: str) -> float:
    """Requests of `api` the gateway answered 2xx (its `kimi_gateway_requests_total`)."""
    lines = httpx.get(gw.url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("kimi_gateway_requests_total{")
               and f'api="{api}"' in line and 'status_class="2xx"' in line)


def fuzz_operation(gw: RunningGateway, cases: SearchStrategy[schemathesis.Case], examples: int,
                   inference: bool) -> None:
    """`examples` cases drawn from `cases`, each sent and checked; `inference`: positive cases of a
    proxied endpoint, whose only allowed 400 is `context_length_exceeded`."""
    excluded = [positive_data_acceptance] if inference else []
    additional = [only_context_length_refused] if inference else []

    @given(case=cases)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=gw.url, timeout=10, excluded_checks=excluded, additional_checks=additional)

    call()


def only_context_length_refused(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A schema-valid inference request is refused with 400 only for its length (the OpenAI APIs'
    `context_length_exceeded`; on the Anthropic ones any `invalid_request_error`, see below)."""
    if response.status_code == 400:
        body = response.json()
        if body.get("type") == "error":  # Anthropic's envelope: no `code`
            # Not narrowed to the length: the Messages rows refuse some schema-valid conversations
            # (one assistant turn with empty content: its chat twin has no message), reported, not fixed.
            assert body["error"]["type"] == "invalid_request_error", response.text
        else:
            # Or for an integer past 64 bits in one of the open members (`gateway/protocol/body.py`: the
            # JSON reader holds integers in 64 bits): no schema of an open object can bound those.
            assert body["error"]["code"] in ("context_length_exceeded", "integer_out_of_range"), response.text


@pytest.mark.parametrize("auth", [False, True], ids=["auth-off", "auth-on"])
def test_schemathesis_finds_no_contract_violation(start_sim: StartSim, start_gateway: StartGateway,
                                                  auth: bool) -> None:
    gw = gateway_on_sims(start_sim, start_gateway, **({"auth": AUTH} if auth else {}))
    fuzz(gw, ADMIN_KEY, AUTH_EXAMPLES) if auth else fuzz(gw)
