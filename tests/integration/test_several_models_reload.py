"""A reload of a several-models config (`models:`, issue 22) on a real `kimi-gateway serve` process
in front of simulated vLLM workers (their `/v1/models` in vLLM's shape): `models` applies only at
start-up while `pools` are reloaded, so a new file whose pools no longer fit the running models
(a model's pool removed) is refused with the reason and every model keeps being served, and a
file that moves a pool to another model judges its workers by the running models' served names,
the names routing still sends them (gateway/serving/reload.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import yaml

from tests.support import GatewayProcess, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
CHECKED = {"interval": 0.1, "timeout": 1.0, "verify_models": True, "models_refresh": 0.1}
MODELS = [{"name": "kimi-k3", "pools": ["k3"]}, {"name": "qwen3-8b", "pools": ["small"]}]


def ask(gw: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def reload(gw: GatewayProcess, pools: list[dict[str, Any]], models: list[dict[str, Any]]) -> httpx.Response:
    path = gw.log.parent / "gateway.yaml"
    config = yaml.safe_load(path.read_text())
    config["pools"], config["models"] = pools, models
    path.write_text(yaml.safe_dump(config))
    return httpx.post(gw.url + "/admin/reload", timeout=10)


def two_models(start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> tuple[GatewayProcess, str, str]:
    k3 = start_sim("vllm", served_model_names=["kimi-k3"])
    small = start_sim("vllm", max_context_tokens=32768, served_model_names=["qwen3-8b"])
    gw = start_gateway_process([pool("k3", "vllm", [k3.url], 131072), pool("small", "vllm", [small.url], 32768)],
                               models=MODELS, load={"enabled": False}, health=CHECKED)
    return gw, k3.url, small.url


def test_a_reload_removing_a_models_pool_is_refused_and_every_model_is_still_served(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    gw, k3, _ = two_models(start_sim, start_gateway_process)
    answer = reload(gw, [pool("k3", "vllm", [k3], 131072)], [{"name": "kimi-k3", "pools": ["k3"]}])
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_config"
    assert "the new pools do not fit the running models" in error["message"]
    assert "model 'qwen3-8b': pools ['small'] are not configured" in error["message"]
    for model, worker in (("kimi-k3", "k3/0"), ("qwen3-8b", "small/0")):
        served = ask(gw, model)
        assert served.status_code == 200, served.text
        assert served.headers["x-kimi-gateway-worker"] == worker
    assert "Traceback" not in gw.log_text()


def test_a_reload_moving_a_pool_to_another_model_judges_it_by_the_running_models(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    gw, k3, small = two_models(start_sim, start_gateway_process)
    answer = reload(gw, [pool("k3", "vllm", [k3], 131072), pool("small", "vllm", [small], 32768)],
                    [{"name": "kimi-k3", "pools": ["small"]}, {"name": "qwen3-8b", "pools": ["k3"]}])
    assert answer.status_code == 200, answer.text
    assert "models" in answer.json()["restart_required"]
    time.sleep(0.5)  # several probes and /v1/models reads: each worker still lists its running model
    workers = httpx.get(gw.url + "/admin/workers", timeout=5).json()["pools"]
    assert [(w["id"], w["state"]) for p in workers for w in p["workers"]] == [("k3/0", "healthy"),
                                                                              ("small/0", "healthy")]
    for model, worker in (("kimi-k3", "k3/0"), ("qwen3-8b", "small/0")):
        served = ask(gw, model)
        assert served.status_code == 200, served.text
        assert served.headers["x-kimi-gateway-worker"] == worker
    assert "Traceback" not in gw.log_text()
