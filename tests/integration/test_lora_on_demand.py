"""Issue 22 §2, LoRA adapters on demand beyond vLLM's load: SGLang pools (`/load_lora_adapter`),
eviction of the least recently used adapter the gateway loaded (`lora_evict: lru`, vLLM's
`/v1/unload_lora_adapter` and SGLang's `/unload_lora_adapter`), never one with a request in
flight, never a declared or an operator's one, and the engine's refusal relayed. Real sims on
loopback ports speaking each engine's endpoints and wordings (gateway/sim/app.py), a real gateway,
the OpenAI SDK; the unloads and loads read back from the sims, the gateway's metrics and its log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHECKED = {"interval": 0.1, "timeout": 2.0, "verify_models": True, "models_refresh": 0.1}
HI = [{"role": "user", "content": "hi"}]


def on_demand(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "path": f"/loras/{n}"} for n in names]


def oai(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


def ask(gw: RunningGateway, model: str) -> str:
    """One chat request for `model`; the worker that answered."""
    raw = oai(gw).chat.completions.with_raw_response.create(model=model, messages=HI, max_tokens=2)
    assert raw.parse().choices[0].message.content
    return raw.headers["x-kimi-gateway-worker"]


def models_sent(sim: RunningSim) -> list[str]:
    return [r.body["model"] for r in sim.engine.records if isinstance(r.body, dict)]


def wait_models_read(sims: list[RunningSim]) -> None:
    deadline = time.monotonic() + 10
    while not all(s.engine.models_reads for s in sims):
        assert time.monotonic() < deadline, "the gateway never read the workers' /v1/models"
        time.sleep(0.02)


def wait_listed(gw: RunningGateway, name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in [m["id"] for m in httpx.get(gw.v1 + "/models", timeout=5).json()["data"]]:
        assert time.monotonic() < deadline, f"{name} not listed"
        time.sleep(0.05)


def test_an_sglang_pool_loads_an_adapter_on_demand(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """SGLang's `/load_lora_adapter` on the least-loaded worker; then served there under its name,
    and its `/v1/models` (SGLang's shape: `parent` the base model, `root` the path) confirms it."""
    sims = [start_sim("sglang", runtime_lora_updating=True) for _ in range(2)]
    gw = start_gateway([pool("p", "sglang", [s.url for s in sims], 131072, policy="round_robin",
                             lora_on_demand=on_demand("sql-lora"))], health=CHECKED, load={"enabled": False})
    wait_models_read(sims)
    workers = {ask(gw, "sql-lora") for _ in range(3)}
    assert len(workers) == 1
    loaded = [s for s in sims if "sql-lora" in s.engine.loras]
    assert len(loaded) == 1 and loaded[0].engine.loras == {"sql-lora": "/loras/sql-lora"}
    assert models_sent(loaded[0]) == ["sql-lora"] * 3
    other = sims[1 - sims.index(loaded[0])]
    assert other.engine.records == [] and other.engine.loras == {}
    # The next /v1/models reads list it with SGLang's fields: the worker keeps it, as the gateway's own.
    reads = loaded[0].engine.models_reads
    deadline = time.monotonic() + 5
    while loaded[0].engine.models_reads < reads + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert {ask(gw, "sql-lora") for _ in range(2)} == workers
    assert gw.metric('kimi_gateway_lora_loads_total{outcome="ok",pool="p"}') == 1


def test_the_least_recently_used_adapter_is_unloaded_to_make_room(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM, `max_loras: 2`, `lora_evict: lru`: a, b, a again, then c unloads b (used least
    recently), never the operator's adapter nor the declared one; then b unloads a."""
    caplog.set_level(logging.INFO, logger="gateway.lora")
    sim = start_sim("vllm", runtime_lora_updating=True, lora_modules=["declared-lora=/loras/declared"])
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=2, lora_evict="lru",
                             lora_adapters=["declared-lora"], lora_on_demand=on_demand("a", "b", "c"))],
                       health=CHECKED)
    wait_models_read([sim])
    operators = httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "ops-lora",
                                                                     "lora_path": "/loras/ops"}, timeout=5)
    assert operators.status_code == 200
    wait_listed(gw, "ops-lora")  # known to the gateway from the worker's list, not loaded by it
    for model in ("a", "b", "a"):
        ask(gw, model)
    assert set(sim.engine.loras) == {"declared-lora", "ops-lora", "a", "b"}
    ask(gw, "c")
    assert set(sim.engine.loras) == {"declared-lora", "ops-lora", "a", "c"}
    ask(gw, "b")
    assert set(sim.engine.loras) == {"declared-lora", "ops-lora", "c", "b"}
    for model in ("declared-lora", "ops-lora"):
        assert ask(gw, model) == "p/0"
    assert models_sent(sim) == ["a", "b", "a", "c", "b", "declared-lora", "ops-lora"]
    assert gw.metric('kimi_gateway_lora_unloads_total{outcome="ok",pool="p"}') == 2
    assert gw.metric('kimi_gateway_lora_loads_total{outcome="ok",pool="p"}') == 4
    unloads = [r.getMessage() for r in caplog.records if "unloaded LoRA adapter" in r.getMessage()]
    assert [line.split("unloaded LoRA adapter ")[1].split(" ")[0] for line in unloads] == ["b", "a"]
    assert unloads[0].endswith("to load c)")


def test_without_lru_a_full_worker_keeps_its_adapters(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", runtime_lora_updating=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_on_demand=on_demand("a", "b"))])
    ask(gw, "a")
    with pytest.raises(openai.InternalServerError) as full:
        ask(gw, "b")
    assert full.value.status_code == 503 and "max_loras" in full.value.message
    assert list(sim.engine.loras) == ["a"]
    assert gw.metric("kimi_gateway_lora_unloads_total") == 0


def test_an_adapter_with_a_request_in_flight_is_never_unloaded(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    """While a stream for `a` runs on the only worker, `b` finds nothing it may unload (503); once
    the stream ended, `a` goes and `b` is loaded."""
    sim = start_sim("vllm", runtime_lora_updating=True, tpot_s=0.2)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_evict="lru",
                             lora_on_demand=on_demand("a", "b"))])
    body = {"model": "a", "messages": HI, "max_tokens": 40, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", gw.v1 + "/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # held: a closed iterator would hang up the stream
        assert any(line.startswith("data: ") for line in lines)
        with pytest.raises(openai.InternalServerError) as busy:
            ask(gw, "b")
        assert busy.value.status_code == 503 and "none to unload" in busy.value.message
        assert list(sim.engine.loras) == ["a"]
        assert sum(1 for line in lines if line.startswith("data: ")) > 10  # the stream went on to its end
    gw.wait_until_idle()
    ask(gw, "b")
    assert list(sim.engine.loras) == ["b"]


def test_an_sglang_worker_at_its_max_loaded_loras_gives_up_the_gateways_adapter_only(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """No `max_loras`: SGLang's own `--max-loaded-loras` refusal makes room by unloading the
    gateway's least recently used adapter, never its `--lora-paths` one (declared); then the load
    is tried once more. With `lora_evict: never` that refusal is the client's answer."""
    sim = start_sim("sglang", lora_modules=["declared-lora=/loras/declared"], max_loaded_loras=2)
    gw = start_gateway([pool("p", "sglang", [sim.url], 131072, lora_evict="lru", lora_adapters=["declared-lora"],
                             lora_on_demand=on_demand("a", "b"))], health=CHECKED)
    wait_models_read([sim])
    ask(gw, "a")
    ask(gw, "b")
    assert sim.engine.loras == {"declared-lora": "/loras/declared", "b": "/loras/b"}
    assert gw.metric('kimi_gateway_lora_loads_total{outcome="full",pool="p"}') == 1
    assert gw.metric('kimi_gateway_lora_unloads_total{outcome="ok",pool="p"}') == 1
    assert ask(gw, "declared-lora") == "p/0"

    refusing = start_sim("sglang", lora_modules=["declared-lora=/loras/declared"], max_loaded_loras=1)
    never = start_gateway([pool("q", "sglang", [refusing.url], 131072, lora_adapters=["declared-lora"],
                                lora_on_demand=on_demand("a"))])
    with pytest.raises(openai.BadRequestError) as refused:
        ask(never, "a")
    assert refused.value.code == "lora_load_failed"
    assert refused.value.message.endswith("Cannot load LoRA adapter a at path /loras/a. Maximum number of loaded "
                                          "LoRA adapters is 1. Please unload some LoRA adapters before loading "
                                          "new ones.")
    assert refusing.engine.loras == {"declared-lora": "/loras/declared"} and refusing.engine.records == []


def test_sglangs_refusal_to_load_is_relayed(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A path without an adapter, and LoRA off (no `--enable-lora`): SGLang's 400 and its words."""
    missing = start_sim("sglang", runtime_lora_updating=True, lora_loadable_paths=["/loras/other"])
    off = start_sim("sglang")
    gw = start_gateway([pool("p", "sglang", [missing.url], 131072, lora_on_demand=on_demand("a")),
                        pool("q", "sglang", [off.url], 131072, lora_on_demand=on_demand("b"))])
    with pytest.raises(openai.BadRequestError) as caught:
        ask(gw, "a")
    assert caught.value.code == "lora_load_failed"
    assert caught.value.message.endswith("Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                                         "'/loras/a'. Use `repo_type` argument if needed.")
    with pytest.raises(openai.BadRequestError) as disabled:
        ask(gw, "b")
    assert disabled.value.message.endswith("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    assert missing.engine.records == [] and off.engine.records == [] and missing.engine.loras == {}
    assert gw.metric('kimi_gateway_lora_loads_total{outcome="refused"') == 2


def test_an_adapter_another_replica_loaded_counts_as_loaded(start_sim: StartSim,
                                                            start_gateway: StartGateway) -> None:
    """Two gateways, one SGLang worker, no bound on the pool (so no list is read before a load):
    the second one's load is refused as a duplicate (the first loaded it; the second has not read
    /v1/models since), which it takes as loaded. One of the pool's on-demand adapters, it is the
    second's to unload as much as the first's (issue 37 §3: slots are the fleet's, not a process's)."""
    sim = start_sim("sglang", runtime_lora_updating=True)
    first, second = (start_gateway([pool("p", "sglang", [sim.url], 131072, lora_on_demand=on_demand("a"))])
                     for _ in range(2))
    ask(first, "a")
    assert ask(second, "a") == "p/0"
    assert models_sent(sim) == ["a", "a"] and list(sim.engine.loras) == ["a"]
    assert second.metric('kimi_gateway_lora_loads_total{outcome="already_loaded",pool="p"}') == 1
    state = second.server.app.state.gateway
    assert state is not None and set(state.registry.find("p", 0).on_demand) == {"a"}


def test_a_load_reads_the_workers_list_first(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """With `lora_evict: lru` the loader reads the worker's /v1/models before it plans: an adapter
    another gateway loaded there since is served as it is (no load sent), and a slot an operator
    emptied behind the gateway's back is free (no unload sent)."""
    sim = start_sim("vllm", runtime_lora_updating=True)
    first, second = (start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_evict="lru",
                                         lora_on_demand=on_demand("a", "b"))]) for _ in range(2))
    ask(first, "a")
    assert ask(second, "a") == "p/0" and list(sim.engine.loras) == ["a"]
    assert second.metric("kimi_gateway_lora_loads_total") == 0
    assert httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=5).status_code == 200
    ask(first, "b")
    assert list(sim.engine.loras) == ["b"] and models_sent(sim) == ["a", "a", "b"]
    assert first.metric("kimi_gateway_lora_unloads_total") == 0


def test_an_adapter_the_engine_no_longer_has_is_unloaded_as_gone(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    """An operator unloaded the gateway's adapter behind its back and the gateway could not read the
    list again before its load (its read of /v1/models is off here, as a failed read leaves it): the
    gateway's unload gets vLLM's 404 "cannot be found", which frees the slot all the same."""
    sim = start_sim("vllm", runtime_lora_updating=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_evict="lru",
                             lora_on_demand=on_demand("a", "b"))])
    state = gw.server.app.state.gateway
    assert state is not None
    state.lora.read_adapters = None
    ask(gw, "a")
    assert httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=5).status_code == 200
    ask(gw, "b")
    assert list(sim.engine.loras) == ["b"] and models_sent(sim) == ["a", "b"]
    assert gw.metric('kimi_gateway_lora_unloads_total{outcome="gone",pool="p"}') == 1


def test_an_unload_the_engine_refuses_fails_the_request_and_keeps_the_adapter(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The engine's unload route is gone (runtime updating off after a restart: FastAPI's 404, not
    vLLM's words): the worker's state is unknown, so nothing is loaded; the request gets a 502 and
    the adapter stays the gateway's."""
    sim = start_sim("vllm", runtime_lora_updating=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=1, lora_evict="lru",
                             lora_on_demand=on_demand("a", "b"))])
    ask(gw, "a")
    assert httpx.post(sim.url + "/sim/faults", json={"no_lora_routes": True}, timeout=5).status_code == 200
    with pytest.raises(openai.APIStatusError) as failed:
        ask(gw, "b")
    assert failed.value.status_code == 502 and "Unloading LoRA adapter `a`" in failed.value.message
    assert list(sim.engine.loras) == ["a"]
    assert gw.metric('kimi_gateway_lora_unloads_total{outcome="refused",pool="p"}') == 1
    assert ask(gw, "a") == "p/0"
    state = gw.server.app.state.gateway
    assert state is not None and set(state.registry.find("p", 0).on_demand) == {"a"}
