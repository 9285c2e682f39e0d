"""`POST /tokenize` and `POST /detokenize` through the gateway (gateway/api/tokenize.py): relayed to
a worker of the model's cheapest healthy pool under the name its engines serve, the engine's answer
as it comes (vLLM's or SGLang's shape), errors in OpenAI's shape; with auth on a key is needed and
each call is one request against its request limit, no tokens. Simulated engines on loopback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.auth.keys import hash_key
from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

PROMPT = {"model": "kimi-k3", "prompt": "The river runs to the sea."}
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "What is a KV cache?"}]}
KEY = "sk-tokenize"


def direct(sim: RunningSim, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(sim.url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_are_relayed_to_the_cheapest_healthy_pool(
        start_sim: StartSim, start_gateway: StartGateway, unused_port: int,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    short, long = start_sim("vllm", max_context_tokens=8192), start_sim("vllm", max_context_tokens=131072)
    gw = start_gateway([pool("short", "vllm", [short.url], 8192), pool("long", "vllm", [long.url], 131072)])
    for path, body in (("/tokenize", PROMPT), ("/tokenize", CHAT), ("/detokenize", {"tokens": [5, 6, 7]})):
        answer = httpx.post(gw.url + path, json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kimi-gateway-pool"] == "short" and answer.headers["x-kimi-gateway-worker"] == "short/0"
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == direct(short, path, body).json()  # the engine's answer, as it gives it
    counted = httpx.post(gw.url + "/tokenize", json=PROMPT).json()
    assert counted["max_model_len"] == 8192 and counted["count"] == len(counted["tokens"]) > 0
    # `model` absent: the first served model, as an engine takes its first served name.
    assert httpx.post(gw.url + "/tokenize", json={"prompt": PROMPT["prompt"]}).json() == counted
    # Bad requests get OpenAI's error object: before any engine (unknown model, broken JSON), or the
    # engine's own refusal (a negative token id, vLLM's validation error) in that shape.
    unknown = httpx.post(gw.url + "/tokenize", json={**PROMPT, "model": "gpt-x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    broken = httpx.post(gw.url + "/detokenize", content=b"{nope", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    refused = httpx.post(gw.url + "/detokenize", json={"tokens": [1, -2]})
    assert refused.status_code == 400 and set(refused.json()["error"]) == {"message", "type", "param", "code"}
    lines = access_lines(caplog, gw, 8)
    assert [line["api"] for line in lines].count("tokenize") == 5 and lines[-1]["api"] == "detokenize"
    assert all(line["usage"] is None for line in lines)  # nothing generated, nothing charged
    assert [line["model"] for line in lines[:6]] == ["kimi-k3"] * 5 + ["none"]
    assert gw.metric('kimi_gateway_requests_total{api="tokenize"') == 5

    # The cheapest pool's only worker cannot be reached: the next pool answers.
    gw2 = start_gateway([pool("short", "vllm", [f"http://127.0.0.1:{unused_port}"], 8192),
                         pool("long", "vllm", [long.url], 131072)])
    moved = httpx.post(gw2.url + "/tokenize", json=PROMPT, timeout=30)
    assert moved.status_code == 200 and moved.headers["x-kimi-gateway-pool"] == "long"
    assert moved.json()["max_model_len"] == 131072


def test_an_sglang_pool_answers_in_sglangs_shape_under_its_served_name(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("sglang", served_model_names=["moonshotai/Kimi-K3"])
    gw = start_gateway([pool("p", "sglang", [sim.url], 131072, served_model_name="moonshotai/Kimi-K3")])
    answer = httpx.post(gw.url + "/tokenize", json={**PROMPT, "prompt": ["a b", "c d e f"]})
    assert answer.status_code == 200, answer.text
    assert set(answer.json()) == {"tokens", "count", "max_model_len"} and len(answer.json()["count"]) == 2
    text = httpx.post(gw.url + "/detokenize", json={"model": "kimi-k3", "tokens": [5, 6]})
    assert text.status_code == 200 and set(text.json()) == {"text"}


def test_with_auth_a_key_is_needed_and_each_call_is_one_request_without_tokens(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", served_model_names=["kimi-k3", "not-kimi"])
    limits = {"requests_per_minute": 3, "tokens_per_minute": 100}  # one tokenized prompt is ~2,500 tokens
    keys = [{"name": "tenant", "sha256": hash_key(KEY), **limits},
            {"name": "other", "sha256": hash_key("sk-other"), "models": ["not-kimi"]},
            {"name": "per-model", "sha256": hash_key("sk-per-model"),
             "model_limits": {"kimi-k3": {"requests_per_minute": 1}}}]
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth={"enabled": True, "keys": keys},
                       models=[{"name": "kimi-k3", "pools": ["p"]}, {"name": "not-kimi", "pools": ["p"]}])
    big = {**PROMPT, "prompt": "word " * 2500}
    missing = httpx.post(gw.url + "/tokenize", json=big)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    bearer = {"authorization": f"Bearer {KEY}"}
    for _ in range(3):  # far over the token limit each: tokens are not charged
        answer = httpx.post(gw.url + "/tokenize", json=big, headers=bearer)
        assert answer.status_code == 200, answer.text
        assert answer.json()["count"] > limits["tokens_per_minute"]
    over = httpx.post(gw.url + "/detokenize", json={"tokens": [1]}, headers=bearer)
    assert over.status_code == 429 and over.json()["error"]["type"] == "requests"
    assert "retry-after" in over.headers
    # A model the key may not use looks like an unknown one.
    hidden = httpx.post(gw.url + "/tokenize", json=PROMPT, headers={"authorization": "Bearer sk-other"})
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    # The key's request limit on the model counts them too (and one on another model does not).
    per_model = {"authorization": "Bearer sk-per-model"}
    assert httpx.post(gw.url + "/tokenize", json=PROMPT, headers=per_model).status_code == 200
    assert httpx.post(gw.url + "/tokenize", json={**PROMPT, "model": "not-kimi"}, headers=per_model).status_code == 200
    limited = httpx.post(gw.url + "/tokenize", json=PROMPT, headers=per_model)
    assert limited.status_code == 429 and "kimi-k3" in limited.json()["error"]["message"]
