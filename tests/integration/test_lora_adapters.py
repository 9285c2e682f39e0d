"""Issue 22 §2, the LoRA field case: an adapter the engines list in `/v1/models` (or a pool declares)
is served under its own name by the workers that have it; an unknown name gets 404
`model_not_found`; an alias never silently drops an adapter; prefix affinity is kept apart per
adapter (real Redis). Real sims on loopback ports (serving adapters with `lora_modules`, in the
engines' `/v1/models` shape), a real gateway, the OpenAI and Anthropic SDKs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
ADAPTER = "sql-lora"
CHECKED = {"interval": 0.1, "timeout": 2.0, "verify_models": True}


def wait_listed(gw: RunningGateway, name: str, timeout: float = 10.0) -> None:
    """Until the gateway's /v1/models lists `name` (the first /v1/models check of its workers)."""
    deadline = time.monotonic() + timeout
    while name not in [m["id"] for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]]:
        assert time.monotonic() < deadline, f"{name} not listed within {timeout} s"
        time.sleep(0.05)


def checked(gw: RunningGateway, sims: list[RunningSim], name: str = ADAPTER) -> None:
    """Until every sim's `/v1/models` was read and the gateway had a moment to take in what it
    lists (bounded: routing is asserted next, so a gateway that ignores the list fails there)."""
    deadline = time.monotonic() + 10
    while not all(s.engine.models_reads for s in sims):
        assert time.monotonic() < deadline, "the gateway never read the workers' /v1/models"
        time.sleep(0.02)
    with contextlib.suppress(AssertionError):
        wait_listed(gw, name, timeout=2.0)


def models_sent(sim: RunningSim) -> list[str]:
    return [r.body["model"] for r in sim.engine.records if isinstance(r.body, dict)]


def oai(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


def claude(gw: RunningGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def ask_all_ways(gw: RunningGateway, model: str) -> list[str]:
    """One request each: OpenAI chat (plain, streamed), OpenAI completions, Anthropic messages
    (plain, streamed); the workers that answered (`x-kimi-gateway-worker`)."""
    client, messages = oai(gw), [{"role": "user", "content": "SELECT the answer"}]
    workers = []
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
    assert raw.parse().choices[0].message.content
    workers.append(raw.headers["x-kimi-gateway-worker"])
    with client.chat.completions.with_streaming_response.create(model=model, messages=messages, max_tokens=2,
                                                                stream=True) as stream:
        assert any(line.startswith("data: ") for line in stream.iter_lines())
        workers.append(stream.headers["x-kimi-gateway-worker"])
    raw_completion = client.completions.with_raw_response.create(model=model, prompt="SELECT", max_tokens=2)
    assert raw_completion.parse().choices[0].text
    workers.append(raw_completion.headers["x-kimi-gateway-worker"])
    raw_message = claude(gw).messages.with_raw_response.create(model=model, max_tokens=2, messages=messages)
    assert raw_message.parse().content
    workers.append(raw_message.headers["x-kimi-gateway-worker"])
    with claude(gw).messages.with_streaming_response.create(model=model, max_tokens=2, messages=messages,
                                                            stream=True) as events:
        assert any(line.startswith("event: message_stop") for line in events.iter_lines())
        workers.append(events.headers["x-kimi-gateway-worker"])
    return workers


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_listed_adapter_goes_to_the_worker_that_has_it_under_its_own_name(
        start_sim: StartSim, start_gateway: StartGateway, engine: str) -> None:
    with_adapter = start_sim(engine, lora_modules=[f"{ADAPTER}=/loras/sql"])
    without = start_sim(engine)
    gw = start_gateway([pool("p", engine, [without.url, with_adapter.url], 131072, policy="round_robin")],
                       health=CHECKED, load={"enabled": False})
    checked(gw, [with_adapter, without])
    assert set(ask_all_ways(gw, ADAPTER)) == {"p/1"}
    assert models_sent(with_adapter) == [ADAPTER] * 5  # its own name, never the base model's
    assert without.engine.records == []
    # The base model still goes to both workers, under its own name.
    assert set(ask_all_ways(gw, "kimi-k3")) == {"p/0", "p/1"}
    assert set(models_sent(without)) == {"kimi-k3"}


def test_models_lists_adapters_with_their_parent(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql", "chat-lora=/loras/chat"])
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, lora_adapters=["declared-lora"])], health=CHECKED)
    wait_listed(gw, "chat-lora")
    listed = {m["id"]: m for m in oai(gw).models.list().model_dump()["data"]}
    assert list(listed)[:3] == ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3"]
    for name in (ADAPTER, "chat-lora", "declared-lora"):
        assert listed[name]["parent"] == "kimi-k3" and listed[name]["object"] == "model"
    assert "parent" not in httpx.get(gw.v1 + "/models/kimi-k3", timeout=5).json()
    retrieved = oai(gw).models.retrieve(ADAPTER)
    assert (retrieved.id, retrieved.model_dump()["parent"]) == (ADAPTER, "kimi-k3")
    with pytest.raises(openai.NotFoundError):
        oai(gw).models.retrieve("no-such-lora")


def test_an_unknown_adapter_gets_404_model_not_found(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"])
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], health=CHECKED)
    checked(gw, [sim])
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as caught:
            oai(gw).chat.completions.create(model="other-lora", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, stream=stream)
        assert caught.value.code == "model_not_found" and "other-lora" in caught.value.message
        with pytest.raises(anthropic.NotFoundError):
            claude(gw).messages.create(model="other-lora", max_tokens=2, stream=stream,
                                       messages=[{"role": "user", "content": "hi"}])
    assert sim.engine.records == []  # nothing leaked upstream


def test_an_alias_never_drops_the_adapter_the_engines_list_under_that_name(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The field case: configured as an alias, the adapter's requests reached the engine under the
    base model's name. The engines' list wins: the adapter gets its own name and its own workers."""
    with_adapter = start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"])
    without = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [without.url, with_adapter.url], 131072, policy="round_robin")],
                       model={"name": "kimi-k3", "aliases": ["Kimi-K3", ADAPTER]}, health=CHECKED,
                       load={"enabled": False})
    checked(gw, [with_adapter, without])
    for _ in range(4):
        raw = oai(gw).chat.completions.with_raw_response.create(
            model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-kimi-gateway-worker"] == "p/1"
    assert models_sent(with_adapter) == [ADAPTER] * 4 and without.engine.records == []
    assert [m["parent"] for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]
            if m["id"] == ADAPTER] == ["kimi-k3"]


def test_a_declared_adapter_that_is_also_an_alias_is_a_config_error() -> None:
    with pytest.raises((ConfigError, ValueError), match="also the model's name or an alias"):
        parse_config({"model": {"aliases": [ADAPTER]},
                      "pools": [pool("p", "vllm", ["http://127.0.0.1:1"], 131072, lora_adapters=[ADAPTER])]},
                     environ={})


def test_a_declared_adapter_goes_to_its_pool_not_the_cheaper_one(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    """Declared in config (no /v1/models check): the cheap pool lacks it, so its requests go to
    the next pool that fits; the base model keeps the cheap pool."""
    cheap, lora = start_sim("vllm"), start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"])
    gw = start_gateway([pool("cheap", "vllm", [cheap.url], 131072),
                        pool("lora", "vllm", [lora.url], 131072, lora_adapters=[ADAPTER])])
    assert set(ask_all_ways(gw, ADAPTER)) == {"lora/0"}
    assert set(ask_all_ways(gw, "kimi-k3")) == {"cheap/0"}
    assert models_sent(lora) == [ADAPTER] * 5 and set(models_sent(cheap)) == {"kimi-k3"}


def test_a_discovered_adapter_spills_to_the_pool_whose_worker_lists_it(start_sim: StartSim,
                                                                       start_gateway: StartGateway) -> None:
    cheap, lora = start_sim("sglang"), start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"])
    gw = start_gateway([pool("cheap", "sglang", [cheap.url], 131072), pool("big", "vllm", [lora.url], 131072)],
                       health=CHECKED)
    checked(gw, [cheap, lora])
    raw = oai(gw).chat.completions.with_raw_response.create(
        model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-kimi-gateway-worker"] == "big/0" and models_sent(lora) == [ADAPTER]
    assert cheap.engine.records == []


def affinity_route(gw: RunningGateway, model: str, messages: list[dict[str, Any]]) -> tuple[str, str]:
    raw = oai(gw).chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
    gw.flush_affinity()
    return raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-route-reason"]


def test_prefix_affinity_is_kept_apart_per_adapter(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The same prompt for the base model and for an adapter shares no cached prefix (an adapter's
    KV cache is not the base model's): each finds only its own, through real Redis."""
    sims = [start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"]) for _ in range(2)]
    prefix = f"test-lora-{uuid.uuid4().hex[:10]}"
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity",
                             policy_params={"min_match_tokens": 64})],
                       redis_url=shared_redis_url(), affinity={"key_prefix": prefix},
                       health=CHECKED, load={"enabled": False})
    checked(gw, sims)
    messages = [{"role": "user", "content": "Tell me about the schema of table orders. " * 60}]
    base_worker, base_reason = affinity_route(gw, "kimi-k3", messages)
    assert base_reason == "no_match"
    assert affinity_route(gw, "kimi-k3", messages) == (base_worker, "affinity")
    adapter_worker, adapter_reason = affinity_route(gw, ADAPTER, messages)
    assert adapter_reason == "no_match"  # the base model's cache is no match for the adapter
    assert affinity_route(gw, ADAPTER, messages) == (adapter_worker, "affinity")
    assert affinity_route(gw, "kimi-k3", messages) == (base_worker, "affinity")
    assert sorted(set(models_sent(sims[0]) + models_sent(sims[1]))) == sorted({"kimi-k3", ADAPTER})


def test_an_adapter_request_parsed_in_a_parse_process_keeps_its_name(start_sim: StartSim,
                                                                     start_gateway: StartGateway) -> None:
    """A body parsed off the event loop (`parse_offload_bytes: 0`) is judged against the adapters
    known in the serving process, and its engine body carries the adapter's name."""
    with_adapter, without = start_sim("vllm", lora_modules=[f"{ADAPTER}=/loras/sql"]), start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [without.url, with_adapter.url], 131072, policy="round_robin")],
                       health=CHECKED, parse_offload_bytes=0, parse_offload_items=0, load={"enabled": False})
    checked(gw, [with_adapter, without])
    for stream in (False, True):
        raw = oai(gw).chat.completions.with_raw_response.create(
            model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream)
        assert raw.headers["x-kimi-gateway-worker"] == "p/1"
    assert models_sent(with_adapter) == [ADAPTER] * 2 and without.engine.records == []
    with pytest.raises(openai.NotFoundError):
        oai(gw).chat.completions.create(model="other-lora", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)


ON_DEMAND = {"name": ADAPTER, "path": "/loras/sql", "load_on_demand": True}


def test_an_on_demand_adapter_is_loaded_on_one_worker_and_served_there(start_sim: StartSim,
                                                                       start_gateway: StartGateway) -> None:
    """Issue 22 §2: an adapter no worker has is loaded through vLLM's runtime endpoint on one
    worker (the least loaded), which then serves it under its name; the other loads nothing."""
    sims = [start_sim("vllm", runtime_lora_updating=True) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin",
                             lora_adapters=[ON_DEMAND])], health=CHECKED, load={"enabled": False})
    checked(gw, sims, "kimi-k3")
    assert ADAPTER in [m.id for m in oai(gw).models.list().data]  # listed before any load
    workers = set(ask_all_ways(gw, ADAPTER))
    assert len(workers) == 1
    loaded = [s for s in sims if ADAPTER in s.engine.loras]
    assert len(loaded) == 1 and loaded[0].engine.loras[ADAPTER] == "/loras/sql"
    assert models_sent(loaded[0]) == [ADAPTER] * 5
    other = sims[1 - sims.index(loaded[0])]
    assert other.engine.records == [] and other.engine.loras == {}
    assert set(ask_all_ways(gw, "kimi-k3")) == {"p/0", "p/1"}  # the base model on both, as before


def test_an_adapter_the_engine_cannot_load_gets_the_engines_error(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", runtime_lora_updating=True, lora_loadable_paths=["/loras/other"])
    off = start_sim("vllm")  # runtime updating off: vLLM has no such route
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, lora_adapters=[ON_DEMAND]),
                        pool("q", "vllm", [off.url], 131072,
                             lora_on_demand=[{"name": "chat-lora", "path": "/loras/chat"}])])
    with pytest.raises(openai.NotFoundError) as caught:
        oai(gw).chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.code == "lora_load_failed"
    assert caught.value.message.endswith(f" - Loading lora {ADAPTER} failed: No adapter found for /loras/sql")
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude(gw).messages.create(model=ADAPTER, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                   stream=True)
    assert "No adapter found for /loras/sql" in str(refused.value)
    with pytest.raises(openai.NotFoundError) as no_route:
        oai(gw).chat.completions.create(model="chat-lora", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)
    assert no_route.value.code == "lora_load_failed"
    assert sim.engine.records == [] and off.engine.records == [] and sim.engine.loras == {}


def test_requests_arriving_together_load_an_adapter_once(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A second load of a loaded name is refused by vLLM (400): every request succeeding proves one load."""
    sim = start_sim("vllm", runtime_lora_updating=True, ttft_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, lora_adapters=[ON_DEMAND])])
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        answers = list(threads.map(lambda _: httpx.post(gw.v1 + "/chat/completions", timeout=10, json={
            "model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}), range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert models_sent(sim) == [ADAPTER] * 4 and list(sim.engine.loras) == [ADAPTER]


def test_max_loras_bounds_the_adapters_loaded_on_a_worker(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", runtime_lora_updating=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1,
                             lora_on_demand=[{"name": ADAPTER, "path": "/loras/sql"},
                                             {"name": "chat-lora", "path": "/loras/chat"}])])
    oai(gw).chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.InternalServerError) as full:
        oai(gw).chat.completions.create(model="chat-lora", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)
    assert full.value.status_code == 503 and "max_loras" in full.value.message
    assert list(sim.engine.loras) == [ADAPTER] and models_sent(sim) == [ADAPTER]


def test_on_demand_loading_needs_an_engine_with_a_load_endpoint() -> None:
    """llama.cpp has no runtime load endpoint; vLLM, vllm-ascend and SGLang do."""
    with pytest.raises((ConfigError, ValueError), match="lora_on_demand needs an aggregated vllm, ascend or sglang"):
        parse_config({"pools": [pool("p", "llamacpp", ["http://127.0.0.1:1"], 131072, lora_adapters=[ON_DEMAND])]},
                     environ={})
    for engine in ("vllm", "ascend", "sglang"):
        parsed = parse_config({"pools": [pool("p", engine, ["http://127.0.0.1:1"], 131072, lora_adapters=[ON_DEMAND])]},
                              environ={})
        assert parsed.pools[0].lora_evict == "never"  # the safe default (docs/routing.md)
