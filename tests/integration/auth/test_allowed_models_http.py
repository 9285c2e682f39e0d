"""Per-key allowed models and per-model limits through a real gateway (issue 22 §1) in front of a
simulated vLLM worker serving two LoRA adapters (`--lora-modules`, as vLLM lists them in its
`/v1/models`): a model the key may not use is OpenAI's 404 `model_not_found` through the real
`openai` SDK and Anthropic's `not_found_error` through the `anthropic` SDK on /v1/messages, before
any engine sees it, logged and counted as a refusal; `/v1/models` lists only what the key may use;
a key's limits on one model apply with its own, in process and on the real Redis; the request
metrics carry the resolved model's name."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from gateway.auth.keys import hash_key, key_id
from tests.integration.auth.conftest import ALICE_KEY, OPS_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
BOB_KEY = "sk-bob-" + uuid.uuid4().hex + uuid.uuid4().hex
HI = [{"role": "user", "content": "Hi"}]
ADAPTERS = ["chat-lora", "sql-lora"]
ALICE = {"models": ["moonshotai/Kimi-K3", "sql-lora"], "requests_per_minute": 20,
         "model_limits": {"sql-lora": {"requests_per_minute": 2}}}


def not_found(name: str) -> str:
    return f"The model `{name}` does not exist or you do not have access to it."


@pytest.fixture
def sim(start_sim: StartSim) -> RunningSim:
    return start_sim("vllm", lora_modules=[f"{name}=/loras/{name}" for name in ADAPTERS])


def gateway(start_gateway: StartGateway, sim: RunningSim, **settings: Any) -> RunningGateway:
    auth = auth_section(ALICE, **settings.pop("auth", {}))
    auth["keys"].append({"name": "bob", "sha256": hash_key(BOB_KEY), "models": ["chat-lora"]})
    settings.setdefault("affinity", {"enabled": False})  # keep the shared Redis free of affinity keys
    return start_gateway([pool("p", "vllm", [sim.url], 131072, lora_adapters=ADAPTERS)], auth=auth,
                         load={"enabled": False}, **settings)


def oai(gw: RunningGateway, key: str = ALICE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


def test_a_model_the_key_may_not_use_is_openais_404_and_anthropics_not_found(
        sim: RunningSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    gw = gateway(start_gateway, sim)
    client = oai(gw)
    for call in (lambda: client.chat.completions.create(model="chat-lora", messages=HI, max_tokens=2),
                 lambda: list(client.chat.completions.create(model="chat-lora", messages=HI, max_tokens=2,
                                                             stream=True)),
                 lambda: client.completions.create(model="chat-lora", prompt="Hi", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert (refused.value.status_code, refused.value.code, refused.value.type, refused.value.param) == (
            404, "model_not_found", "invalid_request_error", "model")
        assert refused.value.body["message"] == not_found("chat-lora")  # type: ignore[index]
    # a model that exists nowhere gets the very same answer: a key learns nothing beyond its models
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=2)
    assert unknown.value.body["message"] == not_found("no-such-model")  # type: ignore[index]

    claude = anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as messages:
        claude.messages.create(model="chat-lora", max_tokens=2, messages=HI)
    assert messages.value.status_code == 404
    assert messages.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                              "message": not_found("chat-lora")},
                                   "request_id": messages.value.response.headers["request-id"]}
    assert sim.engine.records == []  # refused before any upstream work

    # what the key may use is served: an alias of its model, its adapter, through both SDKs
    assert client.chat.completions.create(model="Kimi-K3", messages=HI, max_tokens=2).choices[0].message.content
    assert claude.messages.create(model="sql-lora", max_tokens=2, messages=HI).content
    assert [r.body["model"] for r in sim.engine.records] == ["kimi-k3", "sql-lora"]
    # and bob, whose only model is chat-lora, gets it, but not the base model
    assert oai(gw, BOB_KEY).chat.completions.create(model="chat-lora", messages=HI, max_tokens=2).choices
    with pytest.raises(openai.NotFoundError):
        oai(gw, BOB_KEY).chat.completions.create(model="kimi-k3", messages=HI, max_tokens=2)

    lines = access_lines(caplog, gw, 9)
    refusals = [line for line in lines if line["status"] == 404]
    assert len(refusals) == 6
    assert all(line["outcome"] == "error" and line["pool"] == "none" and line["worker"] is None
               for line in refusals)
    assert {(line["key"], line["model"], line["error"]) for line in refusals} == {
        ("alice", "chat-lora", not_found("chat-lora")), ("alice", "none", not_found("no-such-model")),
        ("bob", "kimi-k3", not_found("kimi-k3"))}
    # counted as refusals: by auth (the unknown model is the parser's 404, not auth's) and per model
    assert gw.metric('kimi_gateway_auth_failures_total{reason="model"}') == 5
    assert gw.metric('kimi_gateway_requests_total{model="chat-lora",pool="none",status_class="4xx"}') == 4
    assert gw.metric('kimi_gateway_requests_total{model="none",pool="none",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{model="sql-lora",pool="p",status_class="2xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{model="no-such-model"') == 0


def test_models_lists_only_what_the_key_may_use(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    listed = {key: [m.id for m in oai(gw, key).models.list()] for key in (ALICE_KEY, OPS_KEY, BOB_KEY)}
    assert listed == {ALICE_KEY: ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3", "sql-lora"],
                      OPS_KEY: ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3", "chat-lora", "sql-lora"],
                      BOB_KEY: ["chat-lora"]}
    assert oai(gw).models.retrieve("sql-lora").model_dump()["parent"] == "kimi-k3"
    assert oai(gw).models.retrieve("moonshotai/Kimi-K3").id == "moonshotai/Kimi-K3"
    with pytest.raises(openai.NotFoundError) as hidden:
        oai(gw).models.retrieve("chat-lora")
    assert (hidden.value.code, hidden.value.body["message"]) == (  # type: ignore[index]
        "model_not_found", not_found("chat-lora"))
    assert oai(gw, OPS_KEY).models.retrieve("chat-lora").id == "chat-lora"


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_keys_limit_on_one_model_applies_with_its_own(sim: RunningSim, start_gateway: StartGateway,
                                                         key_prefix: str, store: str) -> None:
    settings: dict[str, Any] = {"redis_url": REDIS_URL, "auth": {"key_prefix": key_prefix}} if store == "redis" else {}
    gw = gateway(start_gateway, sim, **settings)
    start_a_window_now(gw)
    client = oai(gw)
    for _ in range(2):
        assert client.chat.completions.create(model="sql-lora", messages=HI, max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="sql-lora", messages=HI, max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.body["message"].startswith(  # type: ignore[index]
        "Rate limit reached for sql-lora for API key alice on requests per min (RPM): Limit 2, Used 2, Requested 1.")
    # both in this window, which just began: the 3rd fits once half of them slid out, 90 s from now
    assert 80 <= int(refused.value.response.headers["retry-after"]) <= 90
    assert client.chat.completions.create(model="kimi-k3", messages=HI, max_tokens=2).choices  # another model
    assert len(sim.engine.records) == 3
    labels = f'key="{key_id(hash_key(ALICE_KEY))}",limit="requests"'
    assert gw.metric(f'kimi_gateway_model_rate_limited_total{{{labels},model="sql-lora"}}') == 1
    assert gw.metric(f"kimi_gateway_rate_limited_total{{{labels}}}") == 1
    if store == "redis":
        client_ = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            assert sorted(client_.scan_iter(f"{key_prefix}:*")) == [f"{key_prefix}:alice",
                                                                     f"{key_prefix}:alice/model/sql-lora"]
            assert client_.hget(f"{key_prefix}:alice/model/sql-lora", "r") == "2"
            assert client_.hget(f"{key_prefix}:alice", "r") == "4"  # every request, the refused one too
        finally:
            client_.close()


def test_the_request_metrics_carry_the_resolved_model(sim: RunningSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_gateway, sim)
    client = oai(gw, OPS_KEY)
    list(client.chat.completions.create(model="moonshotai/Kimi-K3", messages=HI, max_tokens=3, stream=True))
    list(client.chat.completions.create(model="chat-lora", messages=HI, max_tokens=3, stream=True))
    gw.wait_for_metric('kimi_gateway_requests_total{model="chat-lora"', lambda v: v == 1)
    gw.wait_for_metric('kimi_gateway_requests_total{model="kimi-k3"', lambda v: v == 1)
    text = httpx.get(gw.url + "/metrics").text
    for model in ("kimi-k3", "chat-lora"):  # the alias counts under its model
        assert f'kimi_gateway_ttft_seconds_count{{model="{model}",pool="p"}} 1.0' in text
        assert f'kimi_gateway_request_duration_seconds_count{{model="{model}",pool="p"}} 1.0' in text
        assert gw.metric(f'kimi_gateway_tokens_total{{kind="completion",model="{model}",pool="p"}}') == 3
    assert "moonshotai/Kimi-K3" not in text


def test_several_models_each_key_its_own(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """With `models:` (issue 22 §1): a key's models by canonical name or alias across models, a
    limit on one model only, `/v1/models` per key, the metrics by each model's canonical name."""
    big = start_sim("vllm", served_model_names=["kimi-k3", "kimi-k3-thinking"])
    small = start_sim("vllm", max_context_tokens=32768, served_model_names=["Qwen/Qwen3-8B"])
    alice = {"models": ["kimi-k3", "small"], "model_limits": {"small": {"requests_per_minute": 1}}}
    gw = start_gateway([pool("big", "vllm", [big.url], 131072), pool("small", "vllm", [small.url], 32768)],
                       models=[{"name": "kimi-k3", "aliases": ["moonshotai/Kimi-K3"], "pools": ["big"]},
                               {"name": "kimi-k3-thinking", "pools": ["big"]},
                               {"name": "qwen3-8b", "aliases": ["small"], "pools": ["small"],
                                "served_model_name": "Qwen/Qwen3-8B"}],
                       auth=auth_section(alice), load={"enabled": False})
    client = oai(gw)
    assert [m.id for m in client.models.list()] == ["kimi-k3", "moonshotai/Kimi-K3", "qwen3-8b", "small"]
    assert len([m.id for m in oai(gw, OPS_KEY).models.list()]) == 5
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="kimi-k3-thinking", messages=HI, max_tokens=2)
    assert refused.value.body["message"] == not_found("kimi-k3-thinking")  # type: ignore[index]
    assert client.chat.completions.create(model="qwen3-8b", messages=HI, max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as limited:  # `small` is qwen3-8b: its limit of 1 is spent
        client.chat.completions.create(model="small", messages=HI, max_tokens=2)
    assert "for qwen3-8b for API key alice on requests per min (RPM): Limit 1, Used 1" in \
        limited.value.body["message"]  # type: ignore[index]
    assert client.chat.completions.create(model="moonshotai/Kimi-K3", messages=HI, max_tokens=2).choices
    assert [r.body["model"] for r in small.engine.records] == ["Qwen/Qwen3-8B"]
    assert [r.body["model"] for r in big.engine.records] == ["kimi-k3"]
    gw.wait_for_metric('kimi_gateway_requests_total{model="kimi-k3",pool="big",status_class="2xx"}',
                       lambda v: v == 1)
    assert gw.metric('kimi_gateway_requests_total{model="qwen3-8b",pool="small",status_class="2xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{model="qwen3-8b",pool="none",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{model="kimi-k3-thinking",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{model="small"') == 0  # an alias is never a label
