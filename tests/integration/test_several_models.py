"""Issue 22 §1: several models behind one endpoint. Each model has its own aliases and pool chain
(`models:`), a pool may serve several models, `/v1/models` lists them all, every request reaches
a worker of its own model's chain under the name its engines serve it by, prefix affinity is kept
apart per model on a shared pool (real Redis), and a worker that does not serve every model of
its pool is found misconfigured. Real sims on loopback ports (several `served_model_names`, in the
engines' `/v1/models` shape), a real gateway, the OpenAI and Anthropic SDKs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from gateway.config import parse_config
from tests.integration.test_lora_adapters import CHECKED, ask_all_ways, models_sent, oai
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
K3, THINKING, SMALL = "kimi-k3", "kimi-k3-thinking", "qwen3-8b"
SMALL_SERVED = "Qwen/Qwen3-8B"


def models_section() -> list[dict[str, Any]]:
    """K3 on two pools (cheap 128K first), its thinking variant on the first only, a small model on
    its own pool under another served name."""
    return [{"name": K3, "aliases": ["moonshotai/Kimi-K3"], "pools": ["b300", "b200"]},
            {"name": THINKING, "aliases": [], "pools": ["b300"]},
            {"name": SMALL, "aliases": ["small"], "owned_by": "qwen", "pools": ["small"],
             "served_model_name": SMALL_SERVED}]


def three_models(start_sim: StartSim, start_gateway: StartGateway,
                 **settings: Any) -> tuple[RunningGateway, dict[str, RunningSim]]:
    sims = {"b300": start_sim("vllm", served_model_names=[K3, THINKING]),
            "b200": start_sim("sglang", max_context_tokens=524288, served_model_names=[K3]),
            "small": start_sim("vllm", max_context_tokens=32768, served_model_names=[SMALL_SERVED])}
    gw = start_gateway([pool("b300", "vllm", [sims["b300"].url], 131072),
                        pool("b200", "sglang", [sims["b200"].url], 524288),
                        pool("small", "vllm", [sims["small"].url], 32768)],
                       models=models_section(), load={"enabled": False}, **settings)
    return gw, sims


def test_each_model_reaches_its_own_pool_under_its_served_name(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    gw, sims = three_models(start_sim, start_gateway)
    assert set(ask_all_ways(gw, SMALL)) == {"small/0"}
    assert set(ask_all_ways(gw, "small")) == {"small/0"}  # an alias is its model
    assert models_sent(sims["small"]) == [SMALL_SERVED] * 10
    assert set(ask_all_ways(gw, THINKING)) == {"b300/0"}
    assert set(ask_all_ways(gw, "moonshotai/Kimi-K3")) == {"b300/0"}  # the cheapest pool of its chain
    assert models_sent(sims["b300"]) == [THINKING] * 5 + [K3] * 5
    assert sims["b200"].engine.records == []


def test_a_long_request_spills_over_only_within_its_models_chain(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    """200K tokens fit K3's SGLang pool, not the thinking model's only pool nor the small model's:
    those two get context_length_exceeded although another model's pool would have fitted."""
    gw, sims = three_models(start_sim, start_gateway)
    long_prompt = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 40_000}]
    raw = oai(gw).chat.completions.with_raw_response.create(model=K3, messages=long_prompt, max_tokens=4)
    assert raw.headers["x-kimi-gateway-worker"] == "b200/0"
    for model in (THINKING, SMALL):
        with pytest.raises(openai.BadRequestError) as refused:
            oai(gw).chat.completions.create(model=model, messages=long_prompt, max_tokens=4)
        assert refused.value.code == "context_length_exceeded"
    assert sims["b300"].engine.records == [] and sims["small"].engine.records == []
    assert models_sent(sims["b200"]) == [K3]


def test_models_lists_every_model_alias_and_adapter(start_sim: StartSim, start_gateway: StartGateway) -> None:
    small = start_sim("vllm", max_context_tokens=32768, served_model_names=[SMALL_SERVED],
                      lora_modules=["small-sql=/loras/sql"])
    b300, b200 = start_sim("vllm", served_model_names=[K3, THINKING]), start_sim("sglang", served_model_names=[K3])
    gw = start_gateway([pool("b300", "vllm", [b300.url], 131072), pool("b200", "sglang", [b200.url], 131072),
                        pool("small", "vllm", [small.url], 32768)],
                       models=models_section(), health=CHECKED, load={"enabled": False})
    deadline = time.monotonic() + 10
    while "small-sql" not in (ids := [m.id for m in oai(gw).models.list().data]):
        assert time.monotonic() < deadline, f"the adapter was never listed: {ids}"
        time.sleep(0.05)
    assert ids == [K3, "moonshotai/Kimi-K3", THINKING, SMALL, "small", "small-sql"]
    listed = {m["id"]: m for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]}
    assert listed["small"]["owned_by"] == "qwen" and listed[K3]["owned_by"] == "moonshotai"
    assert listed["small-sql"]["parent"] == SMALL and "parent" not in listed[THINKING]
    assert oai(gw).models.retrieve(THINKING).id == THINKING
    with pytest.raises(openai.NotFoundError):
        oai(gw).models.retrieve("kimi-k2")
    raw = oai(gw).chat.completions.with_raw_response.create(
        model="small-sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-kimi-gateway-worker"] == "small/0" and models_sent(small) == ["small-sql"]
    with pytest.raises(openai.NotFoundError) as unknown:
        oai(gw).chat.completions.create(model="kimi-k2", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found"


def test_prefix_affinity_is_kept_apart_per_model_on_a_shared_pool(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    """The same prompt for K3 and its thinking variant on one pool shares no cached prefix (each
    model's KV cache is its own): each finds only its own, through real Redis."""
    sims = [start_sim("vllm", served_model_names=[K3, THINKING]) for _ in range(2)]
    prefix = f"test-models-{uuid.uuid4().hex[:10]}"
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity",
                             policy_params={"min_match_tokens": 64})],
                       models=[{"name": K3, "pools": ["p"]}, {"name": THINKING, "pools": ["p"]}],
                       redis_url=shared_redis_url(), affinity={"key_prefix": prefix}, load={"enabled": False})
    messages = [{"role": "user", "content": "Summarise the design of the billing service. " * 60}]

    def route(model: str) -> tuple[str, str]:
        raw = oai(gw).chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
        gw.flush_affinity()
        return raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-route-reason"]

    k3_worker, reason = route(K3)
    assert reason == "no_match"
    assert route(K3) == (k3_worker, "affinity")
    thinking_worker, reason = route(THINKING)
    assert reason == "no_match"  # K3's cached prefix is no match for another model
    assert route(THINKING) == (thinking_worker, "affinity")
    assert route(K3) == (k3_worker, "affinity")


def test_a_worker_missing_one_of_its_pools_models_is_misconfigured(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    both, only_k3 = start_sim("vllm", served_model_names=[K3, THINKING]), start_sim("vllm", served_model_names=[K3])
    gw = start_gateway([pool("p", "vllm", [only_k3.url, both.url], 131072, policy="round_robin")],
                       models=[{"name": K3, "pools": ["p"]}, {"name": THINKING, "pools": ["p"]}],
                       health=CHECKED, load={"enabled": False})
    deadline = time.monotonic() + 10
    while (workers := httpx.get(gw.url + "/admin/workers", timeout=5).json()["pools"][0]["workers"])[0].get(
            "misconfigured") is None:
        assert time.monotonic() < deadline, f"never found misconfigured: {workers}"
        time.sleep(0.05)
    assert "not 'kimi-k3-thinking'" in workers[0]["misconfigured"]
    for model in (K3, THINKING):
        raw = oai(gw).chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-kimi-gateway-worker"] == "p/1"
    assert only_k3.engine.records == []


def test_an_embedding_model_on_its_own_pool_gets_the_pooling_apis_only(start_sim: StartSim,
                                                                      start_gateway: StartGateway) -> None:
    """An embedding model's pool lists the pooling APIs in `apis`: `/v1/embeddings` for it reaches
    that pool under its served name; for K3 (whose pools serve no pooling API) it gets 404
    `api_not_served`, and a chat request for the embedding model gets the same."""
    k3 = start_sim("vllm")
    embedder = start_sim("vllm", pooling=True, max_context_tokens=32768,
                         served_model_names=["Qwen/Qwen3-Embedding-8B"])
    gw = start_gateway([pool("k3", "vllm", [k3.url], 131072),
                        pool("embed", "vllm", [embedder.url], 32768, apis=["embeddings"])],
                       models=[{"name": K3, "pools": ["k3"]},
                               {"name": "qwen3-embedding-8b", "pools": ["embed"],
                                "served_model_name": "Qwen/Qwen3-Embedding-8B"}],
                       load={"enabled": False})
    raw = oai(gw).embeddings.with_raw_response.create(model="qwen3-embedding-8b", input=["one", "two"])
    assert len(raw.parse().data) == 2 and raw.headers["x-kimi-gateway-worker"] == "embed/0"
    assert models_sent(embedder) == ["Qwen/Qwen3-Embedding-8B"]
    with pytest.raises(openai.NotFoundError) as not_served:
        oai(gw).embeddings.create(model=K3, input="one")
    assert not_served.value.code == "api_not_served"
    with pytest.raises(openai.NotFoundError) as no_chat:
        oai(gw).chat.completions.create(model="qwen3-embedding-8b", messages=[{"role": "user", "content": "hi"}])
    assert no_chat.value.code == "api_not_served"
    assert k3.engine.records == [] and len(embedder.engine.records) == 1


@pytest.mark.parametrize(("models", "error"), [
    ([{"name": K3, "pools": ["p"]}, {"name": "Kimi-K3", "pools": ["p"]}], "used twice"),
    ([{"name": K3, "pools": ["p"]}, {"name": THINKING, "aliases": ["KIMI-K3"], "pools": ["p"]}], "used twice"),
    ([{"name": K3, "pools": ["p"]}, {"name": THINKING}], "each names its `pools`"),
    ([{"name": K3, "pools": ["p", "nope"]}], "not configured"),
    ([{"name": K3, "pools": ["p", "p"]}], "distinct"),
])
def test_a_models_section_that_cannot_route_is_a_config_error(models: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_config({"pools": [pool("p", "vllm", ["http://127.0.0.1:1"], 131072)], "models": models})


def test_model_and_models_together_and_an_unserved_pool_are_config_errors() -> None:
    pools = [pool("p", "vllm", ["http://127.0.0.1:1"], 131072), pool("q", "vllm", ["http://127.0.0.1:2"], 131072)]
    with pytest.raises(ValueError, match="not both"):
        parse_config({"pools": pools, "model": {"name": "a"}, "models": [{"name": "b"}]})
    with pytest.raises(ValueError, match="pool q serves no model"):
        parse_config({"pools": pools, "models": [{"name": "a", "pools": ["p"]}]})
    shared = [pool("p", "vllm", ["http://127.0.0.1:1"], 131072, served_model_name="x")]
    with pytest.raises(ValueError, match="set `served_model_name` on those models"):
        parse_config({"pools": shared, "models": [{"name": "a", "pools": ["p"]}, {"name": "b", "pools": ["p"]}]})


def test_a_one_model_config_is_unchanged() -> None:
    """No `models:`: the one `model` (default or configured), served by every pool in config order."""
    pools = [pool("p", "vllm", ["http://127.0.0.1:1"], 131072, served_model_name="moonshotai/Kimi-K3"),
             pool("q", "sglang", ["http://127.0.0.1:2"], 524288)]
    config = parse_config({"pools": pools})
    assert [m.name for m in config.served_models()] == [K3] and config.models is None
    assert [p.name for p in config.model_pools(K3)] == ["p", "q"]
    assert config.pool_served_names() == {"p": ("moonshotai/Kimi-K3",), "q": (K3,)}
    one = parse_config({"pools": pools, "models": [{"name": "m", "aliases": []}]})
    assert [p.name for p in one.model_pools("m")] == ["p", "q"]


def test_an_adapter_an_engine_lists_under_another_models_name_never_takes_its_requests(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A K3 worker listing LoRA adapters named like the small model (its alias `small`, its
    canonical name) and like one of K3's own aliases: the small model's names keep going to its own
    pool under its served name, and /v1/models lists them as that model's, not as K3's adapters;
    only the adapter named like an alias of K3 itself wins over that alias (the field case)."""
    k3 = start_sim("vllm", served_model_names=[K3],
                   lora_modules=[f"{n}=/loras/{n}" for n in ("small", SMALL, "k3-sql")])
    small = start_sim("vllm", max_context_tokens=32768, served_model_names=[SMALL_SERVED])
    models = [{"name": K3, "aliases": ["k3-sql"], "pools": ["k3"]},
              {"name": SMALL, "aliases": ["small"], "pools": ["small"], "served_model_name": SMALL_SERVED}]
    gw = start_gateway([pool("k3", "vllm", [k3.url], 131072), pool("small", "vllm", [small.url], 32768)],
                       models=models, health=CHECKED, load={"enabled": False})
    deadline = time.monotonic() + 10
    while "parent" not in (listed := {m["id"]: m for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]}
                           )["k3-sql"]:
        assert time.monotonic() < deadline, f"k3's adapter was never listed: {listed}"
        time.sleep(0.05)
    assert list(listed) == [K3, "k3-sql", SMALL, "small"]
    assert "parent" not in listed["small"] and "parent" not in listed[SMALL]
    hi = [{"role": "user", "content": "hi"}]
    for name in ("small", SMALL):
        raw = oai(gw).chat.completions.with_raw_response.create(model=name, messages=hi, max_tokens=2)
        assert raw.headers["x-kimi-gateway-worker"] == "small/0"
    raw = oai(gw).chat.completions.with_raw_response.create(model="k3-sql", messages=hi, max_tokens=2)
    assert raw.headers["x-kimi-gateway-worker"] == "k3/0"
    assert models_sent(small) == [SMALL_SERVED, SMALL_SERVED] and models_sent(k3) == ["k3-sql"]
