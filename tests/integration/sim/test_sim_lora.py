"""The simulator's LoRA adapters as vLLM and SGLang serve them (issue 22 §4): `lora_modules` in
`/v1/models` with `parent` and `root`, requests naming one accepted, unknown names refused in the
engine's words, and vLLM's runtime load/unload endpoints with their answers
(vllm/entrypoints/openai/serving_models.py; vllm/exceptions.py `LoRAAdapterNotFoundError`)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

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
    assert chat(sim, "sql-lora").status_code == 200
    refused = chat(sim, "other-lora")
    assert refused.status_code == (404 if engine == "vllm" else 400)
    assert "The model `other-lora` does not exist." in refused.text


def test_vllm_runtime_load_and_unload(start_sim: StartSim) -> None:
    sim = start_sim("vllm", runtime_lora_updating=True, lora_loadable_paths=["/loras/sql"])
    load, unload = sim.url + "/v1/load_lora_adapter", sim.url + "/v1/unload_lora_adapter"
    first = httpx.post(load, json={"lora_name": "sql-lora", "lora_path": "/loras/sql"}, timeout=5)
    assert (first.status_code, first.text) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")
    assert "sql-lora" in [m["id"] for m in httpx.get(sim.url + "/v1/models", timeout=5).json()["data"]]
    again = httpx.post(load, json={"lora_name": "sql-lora", "lora_path": "/loras/sql"}, timeout=5)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'sql-lora' has already been loaded."
    missing = httpx.post(load, json={"lora_name": "x", "lora_path": "/loras/none"}, timeout=5)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Loading lora x failed: No adapter found for /loras/none"
    half = httpx.post(load, json={"lora_name": "x"}, timeout=5)
    assert half.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    gone = httpx.post(unload, json={"lora_name": "sql-lora"}, timeout=5)
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'sql-lora' removed successfully.")
    assert httpx.post(unload, json={"lora_name": "sql-lora"}, timeout=5).json()["error"]["message"] == \
        "The lora adapter 'sql-lora' cannot be found."
    assert chat(sim, "sql-lora").status_code == 404


def test_runtime_lora_endpoints_need_runtime_updating(start_sim: StartSim) -> None:
    sim = start_sim("vllm")
    answer = httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}, timeout=5)
    assert answer.status_code == 404 and sim.engine.loras == {}
