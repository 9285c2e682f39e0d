"""API keys through a real gateway and a simulated engine: 401s in OpenAI's shape, open ops endpoints,
the client's key never forwarded to an engine and never logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.integration.auth.conftest import ALICE_KEY, ENGINE_KEY, OPS_KEY, auth_section
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def sim(start_sim: StartSim) -> RunningSim:
    return start_sim("vllm")


def gateway(start_gateway: StartGateway, sim: RunningSim, auth: bool = True,
            engine_key: str | None = ENGINE_KEY) -> RunningGateway:
    return start_gateway([pool("p", "vllm", [sim.url], 131072, api_key=engine_key)],
                         auth=auth_section() if auth else {"enabled": False}, load={"enabled": False})


def client(gw: RunningGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


def test_missing_or_wrong_key_is_openais_401(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    body = {"model": "kimi-k3", "messages": HELLO, "max_tokens": 3}
    missing = httpx.post(gw.v1 + "/chat/completions", json=body)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"error": {
        "message": "You didn't provide an API key. You need to provide your API key in an Authorization header "
                   "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    basic = httpx.post(gw.v1 + "/chat/completions", json=body, auth=("alice", ALICE_KEY))
    assert basic.status_code == 401

    with pytest.raises(openai.AuthenticationError) as wrong:
        client(gw, ALICE_KEY + "x").chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3)
    assert (wrong.value.status_code, wrong.value.code, wrong.value.type) == (
        401, "invalid_api_key", "invalid_request_error")
    with pytest.raises(openai.AuthenticationError):
        client(gw, ALICE_KEY + "x").completions.create(model="kimi-k3", prompt="Hi", max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        client(gw, ALICE_KEY + "x").models.list()
    assert httpx.get(gw.v1 + "/models").status_code == 401
    assert httpx.get(gw.v1 + "/no-such-route").status_code == 401  # everything under /v1 is guarded

    assert sim.engine.records == []  # nothing reached the engine
    assert gw.metric('kimi_gateway_auth_failures_total{reason="missing"}') == 4
    assert gw.metric('kimi_gateway_auth_failures_total{reason="invalid"}') == 3


def test_two_authorization_headers_are_refused_in_any_order(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    for first, second in ((ALICE_KEY, OPS_KEY), (OPS_KEY, ALICE_KEY), ("junk", ALICE_KEY)):
        headers = [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")]
        for method, url in (("GET", gw.v1 + "/models"), ("GET", gw.url + "/admin/workers")):
            answer = httpx.request(method, url, headers=headers)
            assert answer.status_code == 401, (first[:6], url)
            assert answer.json()["error"]["message"] == "Send one Authorization header; this request has 2."
    assert httpx.get(gw.url + "/admin/workers", headers={"authorization": f"Bearer {OPS_KEY}"}).status_code == 200


def test_a_good_key_is_served(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    for key in (ALICE_KEY, OPS_KEY):
        sdk = client(gw, key)
        assert sdk.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3).choices[0].message.content
        chunks = list(sdk.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split() != []
        assert sdk.completions.create(model="kimi-k3", prompt="Hi", max_tokens=3).choices[0].text
        assert next(m.id for m in sdk.models.list()) == "kimi-k3"


def test_ops_endpoints_stay_open(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    deadline = time.monotonic() + 5
    while httpx.get(gw.url + "/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(gw.url + path, headers=headers).status_code == 200, path
    # Readiness for load balancers, but the worker details (URLs, errors) only for admin keys.
    assert httpx.get(gw.url + "/ready").json() == {"ready": True, "draining": False, "unready_pools": []}
    assert sim.url not in httpx.get(gw.url + "/ready").text


@pytest.mark.parametrize(("auth", "engine_key"), [(True, ENGINE_KEY), (False, ENGINE_KEY), (False, None)],
                         ids=["auth-on", "auth-off", "auth-off-no-engine-key"])
def test_the_clients_key_never_reaches_an_engine(sim: RunningSim, start_gateway: StartGateway, auth: bool,
                                                 engine_key: str | None) -> None:
    gw = gateway(start_gateway, sim, auth=auth, engine_key=engine_key)
    sdk = client(gw, ALICE_KEY)
    sdk.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3)
    list(sdk.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3, stream=True))
    sdk.completions.create(model="kimi-k3", prompt="Hi", max_tokens=3)
    records = sim.engine.records
    assert len(records) == 3
    for record in records:
        assert all(ALICE_KEY not in value for value in record.headers.values()), record.headers
        if engine_key is None:
            assert "authorization" not in record.headers
        else:
            assert record.headers["authorization"] == f"Bearer {engine_key}"


def test_logs_never_contain_keys(sim: RunningSim, start_gateway: StartGateway,
                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = gateway(start_gateway, sim)
    client(gw, ALICE_KEY).chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        client(gw, ALICE_KEY[:-1]).chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=3)
    with pytest.raises(openai.BadRequestError):  # a 400 after authentication
        client(gw, ALICE_KEY).chat.completions.create(model="kimi-k3", messages=[], max_tokens=3)
    deadline = time.monotonic() + 5
    while sum('"event":"request"' in r.getMessage() for r in caplog.records) < 3:
        assert time.monotonic() < deadline, "the access log lines were not written"
        time.sleep(0.02)
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert '"key":"alice"' in logged
    assert ALICE_KEY[:-1] not in logged and ENGINE_KEY not in logged


def test_a_refused_request_is_logged_counted_and_keeps_its_request_id(
        sim: RunningSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    gw = gateway(start_gateway, sim)
    body = {"model": "kimi-k3", "messages": HELLO, "max_tokens": 3}
    refused = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": "hi"},
                         headers={"x-request-id": "req-401", "authorization": "Bearer nope"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "req-401"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert httpx.post(gw.v1 + "/chat/completions", json=body).status_code == 401
    assert gw.metric('kimi_gateway_requests_total{api="completions",pool="none",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{api="chat",pool="none",status_class="4xx"}') == 1
    lines = [r.getMessage() for r in caplog.records
             if '"event":"request"' in r.getMessage() and r.threadName == gw.server.thread_name]
    assert len(lines) == 2 and '"request_id":"req-401"' in lines[0] and '"status":401' in lines[0]
    assert all('"key":null' in line and "nope" not in line for line in lines)
    assert sim.engine.records == []
