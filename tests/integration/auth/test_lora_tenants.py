"""Issue 37 §2, §4 and §7 (adapter names): what one tenant can do to another's LoRA adapter.

§2: an on-demand adapter is loaded only for a request that will be served: one refused by the key's
token limit or by its limit on that adapter, a follow-up whose stored response is not found, or a
token count (which generates nothing) loads nothing, so it cannot unload another tenant's adapter
for free; and a request that did load one is charged for it even when its engine then refuses it.
§4: SGLang's `lora_path` (chat, completions; embeddings take it too) picks an adapter past the
key's allow-list and its per-adapter limits: a client's value that picks another adapter than
`model` is refused in the API's shape, and no engine body carries the client's value (an SGLang
pool's carries the gateway's own), nor llama.cpp's per-request `lora`.
§7: a worker listing an adapter name another pool declares never takes that adapter's requests.

Real gateways with auth on the real (shared) Redis, real simulated engines on loopback ports
(vLLM's runtime LoRA loading, SGLang's `--lora-paths` listing), the OpenAI and Anthropic SDKs."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.auth.keys import hash_key
from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
MALLORY_KEY = "sk-mallory-" + uuid.uuid4().hex + uuid.uuid4().hex
HI = [{"role": "user", "content": "Hi"}]  # estimated at 41 prompt tokens
TPM = 2000
CHECKED = {"interval": 0.1, "timeout": 2.0, "verify_models": True, "models_refresh": 0.1}


def on_demand(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "path": f"/loras/{n}"} for n in names]


@pytest.fixture
def start_lora_gateway(start_gateway: StartGateway, key_prefix: str) -> Iterator[StartGateway]:
    """`start_gateway` whose gateways are stopped at the test's end, before the `key_prefix` fixture
    deletes its Redis keys: a gateway writes its last LoRA adapter use there as it stops
    (gateway/backends/lora_slots.py, under `affinity.key_prefix`: the test's prefix too)."""
    started: list[RunningGateway] = []

    def start(pools: list[dict[str, Any]], **settings: Any) -> RunningGateway:
        gw = start_gateway(pools, **settings)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.server.stop()


def keys(key_prefix: str, mallory: dict[str, Any]) -> dict[str, Any]:
    """alice may use `victim-lora`; mallory the base model and her own adapters, with `mallory`'s limits."""
    auth = auth_section({"models": ["victim-lora"]}, key_prefix=key_prefix)
    auth["keys"].append({"name": "mallory", "sha256": hash_key(MALLORY_KEY), "requests_per_minute": 1000,
                         "models": ["kimi-k3", "evil-a", "evil-b"], **mallory})
    return auth


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01"}


def one_slot_gateway(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str,
                     **mallory: Any) -> tuple[RunningGateway, RunningSim]:
    """One vLLM worker with one on-demand adapter slot (`max_loras: 1`, `lora_evict: lru`), alice's
    `victim-lora` loaded in it by her first request."""
    sim = start_sim("vllm", runtime_lora_updating=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_evict="lru", default_output_tokens=100,
                             lora_on_demand=on_demand("victim-lora", "evil-a", "evil-b"))],
                       auth=keys(key_prefix, {"tokens_per_minute": TPM, **mallory}), redis_url=REDIS_URL,
                       affinity={"enabled": False, "key_prefix": key_prefix}, load={"enabled": False})
    start_a_window_now(gw)
    answer = httpx.post(gw.v1 + "/chat/completions", headers=headers(ALICE_KEY), timeout=10,
                        json={"model": "victim-lora", "messages": HI, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert list(sim.engine.loras) == ["victim-lora"]
    return gw, sim


def refused_for_limits(gw: RunningGateway) -> httpx.Response:
    """Over mallory's token limit (2,000 a minute): 100,000 output tokens asked for."""
    return httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                      json={"model": "evil-a", "messages": HI, "max_tokens": 100_000})


def refused_for_the_adapters_limit(gw: RunningGateway) -> httpx.Response:
    """Within the key's limit, over its limit on `evil-b` (50 tokens a minute)."""
    return httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                      json={"model": "evil-b", "messages": HI, "max_tokens": 100})


def refused_follow_up(gw: RunningGateway) -> httpx.Response:
    """A Responses follow-up of a response nobody stored."""
    return httpx.post(gw.v1 + "/responses", headers=headers(MALLORY_KEY), timeout=10,
                      json={"model": "evil-a", "input": "Hi", "max_output_tokens": 16,
                            "previous_response_id": f"resp_{uuid.uuid4().hex}"})


def token_count(gw: RunningGateway) -> httpx.Response:
    """Anthropic's token counter: generates nothing."""
    return httpx.post(gw.url + "/v1/messages/count_tokens", headers=headers(MALLORY_KEY), timeout=10,
                      json={"model": "evil-a", "messages": HI})


@pytest.mark.parametrize(("request_of", "status"), [
    (refused_for_limits, 429), (refused_for_the_adapters_limit, 429), (refused_follow_up, 404), (token_count, 200),
], ids=["token-limit", "adapter-limit", "failed-follow-up", "token-count"])
def test_a_request_that_is_refused_or_generates_nothing_loads_no_adapter(
        start_sim: StartSim, start_lora_gateway: StartGateway, key_prefix: str,
        request_of: Callable[[RunningGateway], httpx.Response], status: int) -> None:
    gw, sim = one_slot_gateway(start_sim, start_lora_gateway, key_prefix,
                               model_limits={"evil-b": {"tokens_per_minute": 50}})
    served = len(sim.engine.records)
    for _ in range(3):
        answer = request_of(gw)
        assert answer.status_code == status, answer.text
    assert list(sim.engine.loras) == ["victim-lora"]  # nothing unloaded, nothing loaded
    assert gw.metric("kimi_gateway_lora_loads_total") == 1 and gw.metric("kimi_gateway_lora_unloads_total") == 0
    if request_of is token_count:  # counted as the base model (the adapter's tokenizer), on the worker
        assert answer.json()["input_tokens"] > 0
        assert [r.body["model"] for r in sim.engine.records[served:]] == ["kimi-k3"] * 3
    else:
        assert len(sim.engine.records) == served  # nothing reached the engine either
    still = httpx.post(gw.v1 + "/chat/completions", headers=headers(ALICE_KEY), timeout=10,
                       json={"model": "victim-lora", "messages": HI, "max_tokens": 2})
    assert still.status_code == 200 and gw.metric("kimi_gateway_lora_loads_total") == 1


def used_now(gw: RunningGateway, key: str, probe_tokens: int) -> int:
    """The key's token use this minute, from the 429 of a probe too large to fit (a refusal costs nothing)."""
    response = httpx.post(gw.v1 + "/chat/completions", headers=headers(key), timeout=10,
                          json={"model": "kimi-k3", "messages": HI, "max_tokens": probe_tokens - 41})
    assert response.status_code == 429, f"a probe of {probe_tokens} tokens fit: the key had used nothing"
    match = re.search(r"Used (\d+), Requested (\d+)", response.json()["error"]["message"])
    assert match is not None, response.text
    return int(match[1])


def test_a_request_that_loaded_an_adapter_is_charged_for_it(start_sim: StartSim, start_lora_gateway: StartGateway,
                                                            key_prefix: str) -> None:
    """mallory's request loads `evil-a` (unloading alice's adapter to make room), then its engine
    refuses it (a 400): the load was work done for her, so she is charged its prompt estimate,
    where an engine's refusal alone costs nothing."""
    gw, sim = one_slot_gateway(start_sim, start_lora_gateway, key_prefix)
    assert httpx.post(sim.url + "/sim/faults", json={"fail_status": 400, "fail_count": 1}, timeout=5).status_code == 200
    refused = httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                         json={"model": "evil-a", "messages": HI, "max_tokens": 2})
    assert refused.status_code == 400, refused.text
    assert list(sim.engine.loras) == ["evil-a"]
    deadline = time.monotonic() + 5
    while (used := used_now(gw, MALLORY_KEY, TPM)) != 41:  # 2,000 fits only a key that used nothing
        assert time.monotonic() < deadline, f"mallory's use stayed at {used}"
        time.sleep(0.05)


# --- §4: engine fields that pick an adapter -------------------------------------------------------


def sglang_gateway(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str,
                   **mallory: Any) -> tuple[RunningGateway, RunningSim]:
    """One SGLang worker started with alice's and mallory's adapters (`--lora-paths`)."""
    sim = start_sim("sglang", lora_modules=["victim-lora=/loras/victim", "evil-a=/loras/evil-a"])
    gw = start_gateway([pool("p", "sglang", [sim.url], 131072, lora_adapters=["victim-lora", "evil-a"])],
                       auth=keys(key_prefix, mallory), redis_url=REDIS_URL,
                       affinity={"enabled": False, "key_prefix": key_prefix}, load={"enabled": False})
    return gw, sim


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_lora_path_cannot_pick_an_adapter_past_the_allow_list(start_sim: StartSim, start_lora_gateway: StartGateway,
                                                              key_prefix: str, path: str) -> None:
    """mallory may not use `victim-lora`: naming it in `lora_path` beside her own base model is a
    400 in OpenAI's shape (`param: lora_path`) and reaches no engine; so is a list holding it."""
    gw, sim = sglang_gateway(start_sim, start_lora_gateway, key_prefix)
    body: dict[str, Any] = {"model": "kimi-k3", "max_tokens": 2,
                            **({"messages": HI} if path == "/chat/completions" else {"prompt": "Hi"})}
    for lora_path in ("victim-lora", ["victim-lora"], [None, "victim-lora"]):
        refused = httpx.post(gw.v1 + path, headers=headers(MALLORY_KEY), timeout=10,
                             json={**body, "lora_path": lora_path})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "lora_path",
                                                                 "unsupported_parameter")
        assert "victim-lora" not in error["message"]  # nothing told about another tenant's adapter
    with pytest.raises(openai.BadRequestError) as sdk:
        client = openai.OpenAI(base_url=gw.v1, api_key=MALLORY_KEY, max_retries=0)
        client.chat.completions.create(model="kimi-k3", messages=HI, max_tokens=2,  # type: ignore[call-overload]
                                       extra_body={"lora_path": "victim-lora"})
    assert sdk.value.param == "lora_path"
    assert sim.engine.records == []


def test_lora_path_cannot_dodge_a_per_adapter_limit(start_sim: StartSim, start_lora_gateway: StartGateway,
                                                    key_prefix: str) -> None:
    """mallory's `evil-a` allows one request a minute: a second one sent as the base model with
    `lora_path: evil-a` is refused too (never served with the adapter on the base model's count)."""
    gw, sim = sglang_gateway(start_sim, start_lora_gateway, key_prefix,
                             model_limits={"evil-a": {"requests_per_minute": 1}})
    start_a_window_now(gw)
    first = httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                       json={"model": "evil-a", "messages": HI, "max_tokens": 2, "lora_path": "evil-a"})
    assert first.status_code == 200, first.text
    again = httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                       json={"model": "kimi-k3", "messages": HI, "max_tokens": 2, "lora_path": "evil-a"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_path"
    assert httpx.post(gw.v1 + "/chat/completions", headers=headers(MALLORY_KEY), timeout=10,
                      json={"model": "evil-a", "messages": HI, "max_tokens": 2}).status_code == 429
    assert [(r.body["model"], r.body.get("lora_path")) for r in sim.engine.records] == [("evil-a", "evil-a")]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_bodies_carry_the_gateways_adapter_choice_only(start_sim: StartSim, start_lora_gateway: StartGateway,
                                                              key_prefix: str, engine: str) -> None:
    """Whatever the client sent in `lora_path` (agreeing with `model`, or null) and llama.cpp's
    `lora`: an SGLang pool's engine body names the adapter in `lora_path` (SGLang reads no adapter
    from a bare name in `model`), a vLLM pool's has neither field; the base model's has none."""
    sim = start_sim(engine, lora_modules=["evil-a=/loras/evil-a"])
    gw = start_lora_gateway([pool("p", engine, [sim.url], 131072, lora_adapters=["evil-a"])],
                       auth=keys(key_prefix, {}), redis_url=REDIS_URL,
                       affinity={"enabled": False, "key_prefix": key_prefix}, load={"enabled": False})
    llamacpp_lora = [{"id": 0, "scale": 1.0}]
    for model, lora_path in (("evil-a", "evil-a"), ("evil-a", None), ("kimi-k3", None), ("kimi-k3", [None])):
        for path, body in (("/chat/completions", {"messages": HI}), ("/completions", {"prompt": "Hi"})):
            answer = httpx.post(gw.v1 + path, headers=headers(MALLORY_KEY), timeout=10,
                                json={"model": model, "max_tokens": 2, "lora_path": lora_path, "lora": llamacpp_lora,
                                      **body})
            assert answer.status_code == 200, answer.text
    sent = [(r.body["model"], r.body.get("lora_path"), "lora" in r.body) for r in sim.engine.records]
    adapter_field = "evil-a" if engine == "sglang" else None
    assert sent == [("evil-a", adapter_field, False)] * 4 + [("kimi-k3", None, False)] * 4


# --- §7: adapter names are owned by configuration -------------------------------------------------


def test_a_worker_listing_another_pools_adapter_never_takes_its_requests(start_sim: StartSim,
                                                                         start_gateway: StartGateway) -> None:
    """Pool `cheap` (first in config order) has a worker whose engine also lists `victim-lora`;
    pool `owner` declares it. Its requests all go to `owner`; an adapter no pool declares still
    goes to whichever worker lists it."""
    rogue = start_sim("vllm", lora_modules=["victim-lora=/elsewhere/victim", "stray-lora=/loras/stray"])
    owner = start_sim("vllm", lora_modules=["victim-lora=/loras/victim"])
    gw = start_gateway([pool("cheap", "vllm", [rogue.url], 131072),
                        pool("owner", "vllm", [owner.url], 131072, lora_adapters=["victim-lora"])],
                       health=CHECKED, load={"enabled": False})
    deadline = time.monotonic() + 10
    while not (rogue.engine.models_reads and owner.engine.models_reads):
        assert time.monotonic() < deadline, "the gateway never read the workers' /v1/models"
        time.sleep(0.02)
    with contextlib.suppress(AssertionError):  # until the rogue's stray adapter is known (routing asserts next)
        while "stray-lora" not in [m["id"] for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="victim-lora", messages=HI, max_tokens=2)
        assert raw.headers["x-kimi-gateway-worker"] == "owner/0"
    raw = client.chat.completions.with_raw_response.create(model="stray-lora", messages=HI, max_tokens=2)
    assert raw.headers["x-kimi-gateway-worker"] == "cheap/0"
    assert [r.body["model"] for r in rogue.engine.records] == ["stray-lora"]
    assert [r.body["model"] for r in owner.engine.records] == ["victim-lora"] * 3
