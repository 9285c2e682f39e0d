"""The simulator's LoRA adapters as vLLM and SGLang serve them (issue 22 §4): `lora_modules` in
`/v1/models` with `parent` and `root`, requests naming one accepted, unknown names refused in the
engine's words, vLLM's runtime load/unload endpoints with their answers
(vllm/entrypoints/openai/serving_models.py; vllm/exceptions.py `LoRAAdapterNotFoundError`) and
SGLang's (python/sglang/srt/entrypoints/http_server.py `load_lora_adapter`, its `LoRAUpdateOutput`
answers and the wordings of python/sglang/srt/managers/tokenizer_manager.py,
python/sglang/srt/lora/lora_manager.py and python/sglang/srt/lora/lora_registry.py)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from gateway.sim.config import SimConfig
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def chat(sim: RunningSim, model: str) -> httpx.Response:
    return httpx.post(sim.url + "/v1/chat/completions", json={"model": model, **CHAT}, timeout=5)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_lora_modules_are_listed_with_their_parent_and_served(start_sim: StartSim, engine: str) -> None:
    sim = start_sim(engine, lora_modules=["sql-lora=/loras/sql"])
    data = httpx.get(sim.url + "/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in data] == ["kimi-k3", "sql-lora"]
    assert {k: data[1][k] for k in ("root", "parent", "max_model_len")} == {
        "root": "/loras/sql", "parent": "kimi-k3", "max_model_len": None}
    assert data[0]["parent"] is None  # both engines' ModelCard: null for the base model
    fields = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len"]
    assert [list(m) for m in data] == [fields + (["permission"] if engine == "vllm" else [])] * 2
    if engine == "vllm":
        assert data[1]["permission"][0]["object"] == "model_permission"
    assert chat(sim, "sql-lora").status_code == 200
    refused = chat(sim, "other-lora")
    assert refused.status_code == (404 if engine == "vllm" else 400)
    assert "The model `other-lora` does not exist." in refused.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_answer_names_the_model_as_the_engine_does(start_sim: StartSim, engine: str, stream: bool) -> None:
    # vLLM: an adapter's own name, else its first served name whatever alias was sent
    # (serving_models.py `model_name`); SGLang: the request's `model` as sent (serving_chat.py).
    sim = start_sim(engine, served_model_names=["moonshotai/Kimi-K3", "kimi-k3"], lora_modules=["sql-lora=/loras/sql"])
    alias_answer = "kimi-k3" if engine == "sglang" else "moonshotai/Kimi-K3"
    base = "moonshotai/Kimi-K3"
    for sent, named in (("sql-lora", "sql-lora"), ("kimi-k3", alias_answer), (base, base)):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
            got = httpx.post(sim.url + path, json={"model": sent, "stream": stream, **body}, timeout=5)
            assert got.status_code == 200, got.text
            models = ({orjson.loads(line[6:])["model"] for line in got.text.splitlines()
                       if line.startswith("data: {")} if stream else {got.json()["model"]})
            assert models == {named}, (sent, path)


def test_vllm_runtime_load_and_unload(start_sim: StartSim) -> None:
    sim = start_sim("vllm", runtime_lora_updating=True, lora_loadable_paths=["/loras/sql"])
    load, unload = sim.url + "/v1/load_lora_adapter", sim.url + "/v1/unload_lora_adapter"
    first = httpx.post(load, json={"lora_name": "sql-lora", "lora_path": "/loras/sql"}, timeout=5)
    assert (first.status_code, first.text) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")
    assert "sql-lora" in [m["id"] for m in httpx.get(sim.url + "/v1/models", timeout=5).json()["data"]]
    again = httpx.post(load, json={"lora_name": "sql-lora", "lora_path": "/loras/sql"}, timeout=5)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == ("The lora adapter 'sql-lora' has already been loaded. If you want "
                                                "to load the adapter in place, set 'load_inplace' to True.")
    inplace = httpx.post(load, json={"lora_name": "sql-lora", "lora_path": "/loras/sql", "load_inplace": True})
    assert inplace.status_code == 200
    base = httpx.post(load, json={"lora_name": "kimi-k3", "lora_path": "/loras/sql"}, timeout=5)
    assert (base.status_code, base.json()["error"]["type"]) == (400, "InvalidUserInput")
    missing = httpx.post(load, json={"lora_name": "x", "lora_path": "/loras/none"}, timeout=5)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Loading lora x failed: No adapter found for /loras/none"
    empty = httpx.post(load, json={"lora_name": "x", "lora_path": ""}, timeout=5)
    assert empty.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    half = httpx.post(load, json={"lora_name": "x"}, timeout=5).json()["error"]  # LoadLoRAAdapterRequest refuses it
    assert (half["type"], half["param"]) == ("Bad Request", "body.lora_path") and "Field required" in half["message"]
    nameless = httpx.post(unload, json={"lora_name": ""}, timeout=5).json()["error"]
    assert nameless["message"] == "'lora_name' needs to be provided to unload a LoRA adapter."
    gone = httpx.post(unload, json={"lora_name": "sql-lora"}, timeout=5)
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'sql-lora' removed successfully.")
    assert httpx.post(unload, json={"lora_name": "sql-lora"}, timeout=5).json()["error"]["message"] == \
        "The lora adapter 'sql-lora' cannot be found."
    assert chat(sim, "sql-lora").status_code == 404


def test_runtime_lora_endpoints_need_runtime_updating(start_sim: StartSim) -> None:
    sim = start_sim("vllm")
    answer = httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}, timeout=5)
    assert answer.status_code == 404 and sim.engine.loras == {}


def sglang_post(sim: RunningSim, path: str, **body: str) -> tuple[int, dict[str, object]]:
    answer = httpx.post(sim.url + path, json=body, timeout=5)
    return answer.status_code, answer.json()


def test_sglang_runtime_load_and_unload(start_sim: StartSim) -> None:
    sim = start_sim("sglang", runtime_lora_updating=True, lora_modules=["base-lora=/loras/base"],
                    lora_loadable_paths=["/loras/sql", "/loras/chat"], max_loaded_loras=2)
    status, first = sglang_post(sim, "/load_lora_adapter", lora_name="sql-lora", lora_path="/loras/sql")
    assert (status, first) == (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                     "loaded_adapters": {"base-lora": "/loras/base", "sql-lora": "/loras/sql"}})
    listed = httpx.get(sim.url + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in listed] == [
        ("kimi-k3", "kimi-k3", None), ("base-lora", "/loras/base", "kimi-k3"), ("sql-lora", "/loras/sql", "kimi-k3")]
    assert chat(sim, "sql-lora").status_code == 200
    status, full = sglang_post(sim, "/load_lora_adapter", lora_name="chat-lora", lora_path="/loras/chat")
    assert (status, full["success"], full["loaded_adapters"]) == (400, False, None)
    assert full["error_message"] == ("Cannot load LoRA adapter chat-lora at path /loras/chat. Maximum number of "
                                     "loaded LoRA adapters is 2. Please unload some LoRA adapters before loading "
                                     "new ones.")
    status, gone = sglang_post(sim, "/unload_lora_adapter", lora_name="base-lora")
    assert (status, gone["success"], gone["loaded_adapters"]) == (200, True, {"sql-lora": "/loras/sql"})
    status, again = sglang_post(sim, "/load_lora_adapter", lora_name="sql-lora", lora_path="/loras/sql")
    assert (status, again["error_message"]) == (400, "Failed to load LoRA adapter sql-lora because it is already "
                                                     "loaded")
    status, missing = sglang_post(sim, "/load_lora_adapter", lora_name="x", lora_path="/loras/none")
    assert (status, missing["error_message"]) == (400, "Repo id must be in the form 'repo_name' or "
                                                       "'namespace/repo_name': '/loras/none'. Use `repo_type` "
                                                       "argument if needed.")
    status, unknown = sglang_post(sim, "/unload_lora_adapter", lora_name="base-lora")
    assert (status, unknown["error_message"]) == (400, "LoRA with name base-lora does not exist. Loaded LoRAs: "
                                                       "dict_keys(['sql-lora'])")
    assert sglang_post(sim, "/load_lora_adapter", lora_name="chat-lora", lora_path="/loras/chat")[0] == 200
    assert list(sim.engine.loras) == ["sql-lora", "chat-lora"]
    assert chat(sim, "base-lora").status_code == 400


def test_sglang_refuses_runtime_loads_without_lora_enabled(start_sim: StartSim) -> None:
    sim = start_sim("sglang")
    for path, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
                       ("/unload_lora_adapter", {"lora_name": "a"})):
        status, refused = sglang_post(sim, path, **body)
        assert (status, refused["success"]) == (400, False)
        assert refused["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    assert sim.engine.loras == {}
    assert httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"},
                      timeout=5).status_code == 404  # vLLM's path is not SGLang's


def test_max_loaded_loras_is_sglangs_alone() -> None:
    with pytest.raises(ValueError, match="max_loaded_loras is SGLang's"):
        SimConfig(engine="vllm", max_context_tokens=1024, max_loaded_loras=1)
