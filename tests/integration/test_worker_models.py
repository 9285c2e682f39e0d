"""Issue 11 §4: the gateway checks each worker's `/v1/models` against its pool. A worker that lacks
the served model name or reports another max context is `misconfigured`: no traffic, the reason on
/admin/workers, the status page's data and a metric. Real sims on loopback ports, a real gateway."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml

from gateway.backends.h1 import H1Pool
from gateway.backends.health import HealthChecker
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from tests.support import REPO_ROOT, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
SERVED = "moonshotai/Kimi-K3"
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
CHECKED = {"interval": 0.1, "timeout": 2.0, "verify_models": True}


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def admin_workers(gw: RunningGateway, name: str = "p") -> list[dict[str, Any]]:
    pools = httpx.get(gw.url + "/admin/workers", timeout=5).json()["pools"]
    return next(p["workers"] for p in pools if p["name"] == name)


def state_of(gw: RunningGateway, index: int) -> str:
    return str(admin_workers(gw)[index]["state"])


def send_many(gw: RunningGateway, n: int) -> list[httpx.Response]:
    return [httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10) for _ in range(n)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_worker_serving_another_model_name_is_misconfigured_and_gets_no_traffic(
        start_sim: StartSim, start_gateway: StartGateway, engine: str) -> None:
    good = start_sim(engine, served_model_names=[SERVED])
    wrong = start_sim(engine, served_model_names=["kimi-k3-preview"])  # started with another --served-model-name
    gw = start_gateway([pool("p", engine, [good.url, wrong.url], 131072, served_model_name=SERVED,
                             policy="round_robin")], health=CHECKED, load={"enabled": False})
    wait_until(lambda: state_of(gw, 1) == "misconfigured", 10, "the wrong worker reported misconfigured")
    bad = admin_workers(gw)[1]
    assert "'kimi-k3-preview'" in bad["misconfigured"] and repr(SERVED) in bad["misconfigured"]
    assert bad["healthy"] is True  # it answers /health: the check, not the probe, took it out
    assert admin_workers(gw)[0]["state"] == "healthy" and admin_workers(gw)[0]["misconfigured"] is None
    answers = send_many(gw, 8)
    assert [a.status_code for a in answers] == [200] * 8
    assert {a.headers["x-kimi-gateway-worker"] for a in answers} == {"p/0"}
    assert wrong.engine.records == []  # not one request reached it, not even a failed attempt
    assert gw.metric('kimi_gateway_worker_misconfigured{pool="p",worker="p/1"}') == 1
    assert gw.metric('kimi_gateway_worker_misconfigured{pool="p",worker="p/0"}') == 0
    status = httpx.get(gw.url + "/admin/status", timeout=5).text  # what the status page shows
    assert "misconfigured" in status and "kimi-k3-preview" in status


@pytest.mark.parametrize(("engine", "engine_context", "pool_context"),
                         [("vllm", 524288, 131072), ("sglang", 131072, 524288), ("ascend", 131073, 131072)])
def test_a_worker_with_another_max_context_is_misconfigured(start_sim: StartSim, start_gateway: StartGateway,
                                                            engine: str, engine_context: int,
                                                            pool_context: int) -> None:
    good = start_sim(engine, max_context_tokens=pool_context)
    wrong = start_sim(engine, max_context_tokens=engine_context)  # started with another --max-context
    gw = start_gateway([pool("p", engine, [wrong.url, good.url], pool_context, policy="round_robin")],
                       health=CHECKED, load={"enabled": False})
    wait_until(lambda: state_of(gw, 0) == "misconfigured", 10, "the worker with another context reported")
    reason = admin_workers(gw)[0]["misconfigured"]
    assert reason == (f"reports max_model_len {engine_context} tokens but the pool's max_context_tokens is "
                      f"{pool_context}")
    assert state_of(gw, 1) == "healthy"
    assert {a.headers["x-kimi-gateway-worker"] for a in send_many(gw, 6)} == {"p/1"}
    assert wrong.engine.records == []


def test_a_pool_whose_only_worker_is_misconfigured_is_not_ready_and_no_404_names_a_model(
        start_sim: StartSim, start_gateway: StartGateway, unused_port: int) -> None:
    # The sim as an operator starts it: `kimi-gateway sim` with its own --served-model-name / --max-context.
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--engine", "vllm", "--port",
                             str(unused_port), "--max-context", "65536", "--served-model-name", "kimi-k2"],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{unused_port}"
        wait_until(lambda: _answers(url + "/health"), 20, "the sim subprocess listening")
        gw = start_gateway([pool("p", "vllm", [url], 131072, served_model_name=SERVED, spillover=False)],
                           health=CHECKED, load={"enabled": False})
        wait_until(lambda: state_of(gw, 0) == "misconfigured", 10, "the worker reported misconfigured")
        ready = httpx.get(gw.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["unready_pools"] == ["p"]
        answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 503, answer.text  # before: 404 "The model `moonshotai/Kimi-K3` does not exist"
        assert "does not exist" not in answer.text
        assert "p/0 misconfigured (serves 'kimi-k2', not 'moonshotai/Kimi-K3'" in answer.json()["error"]["message"]
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def restartable() -> Iterator[list[ThreadedServer]]:
    servers: list[ThreadedServer] = []
    yield servers
    for server in servers:
        server.stop()


def test_a_worker_restarted_with_the_right_flags_gets_traffic_again(start_gateway: StartGateway,
                                                                    restartable: list[ThreadedServer]) -> None:
    first = ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=32768))).start()
    restartable.append(first)
    gw = start_gateway([pool("p", "vllm", [first.url], 131072)], health=CHECKED, load={"enabled": False})
    wait_until(lambda: state_of(gw, 0) == "misconfigured", 10, "the worker reported misconfigured")
    first.stop()
    second = ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=131072)),
                            port=first.port).start()
    restartable.append(second)
    wait_until(lambda: state_of(gw, 0) == "healthy", 10, "the restarted worker back in service")
    assert admin_workers(gw)[0]["misconfigured"] is None
    assert gw.metric('kimi_gateway_worker_misconfigured{pool="p",worker="p/0"}') == 0
    assert httpx.get(gw.url + "/ready", timeout=5).status_code == 200
    assert send_many(gw, 1)[0].status_code == 200


def test_models_is_read_at_start_and_on_refresh_not_on_every_probe(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       health={**CHECKED, "models_refresh": 60.0}, load={"enabled": False})
    wait_until(lambda: sim.engine.health_checks >= 12, 10, "a dozen probes")
    assert sim.engine.models_reads == 1
    assert state_of(gw, 0) == "healthy"
    refreshing = start_sim("vllm")
    start_gateway([pool("p", "vllm", [refreshing.url], 131072)],
                  health={**CHECKED, "models_refresh": 0.3}, load={"enabled": False})
    wait_until(lambda: refreshing.engine.models_reads >= 3, 10, "three reads, one per refresh")
    assert refreshing.engine.health_checks >= refreshing.engine.models_reads


def test_a_key_refused_on_v1_models_is_a_misconfiguration_though_health_passes(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # vLLM's --api-key guards /v1/* only: /health passes with any key, every request would get 401.
    guarded = start_sim("vllm", api_key="engine-key")
    gw = start_gateway([pool("p", "vllm", [guarded.url], 131072, api_key="stale-key")],
                       health=CHECKED, load={"enabled": False})
    wait_until(lambda: state_of(gw, 0) == "misconfigured", 10, "the worker reported misconfigured")
    reason = admin_workers(gw)[0]["misconfigured"]
    assert "HTTP 401" in reason and "api_key" in reason and "stale-key" not in reason


async def _proxy_without_models(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app: `/health` 200, anything else 404 in HTML (a proxy that does not pass /v1/models)."""
    if scope["type"] != "http":
        return
    ok = scope["path"] == "/health"
    await send({"type": "http.response.start", "status": 200 if ok else 404,
                "headers": [(b"content-type", b"text/html")]})
    await send({"type": "http.response.body", "body": b"" if ok else b"<h1>Not Found</h1>"})


def test_a_models_list_that_cannot_be_read_leaves_the_worker_in_service(start_gateway: StartGateway,
                                                                       restartable: list[ThreadedServer]) -> None:
    server = ThreadedServer(_proxy_without_models, lifespan="off").start()
    restartable.append(server)
    gw = start_gateway([pool("p", "vllm", [server.url], 131072)], health=CHECKED, load={"enabled": False})
    wait_until(lambda: admin_workers(gw)[0]["failed_probes"] == 0 and state_of(gw, 0) == "healthy", 10, "probes")
    time.sleep(0.5)  # several probes, each reading /v1/models again: still no verdict against the worker
    assert state_of(gw, 0) == "healthy" and admin_workers(gw)[0]["misconfigured"] is None


def test_a_reload_judges_workers_by_the_new_pools(start_sim: StartSim,
                                                 start_gateway_process: Callable[..., Any]) -> None:
    # The operator's fix: a pool typed with 131,072 in front of a 32,768 engine is misconfigured;
    # a reload saying 32,768 must bring it back (and a reload that breaks a matching pool, or adds
    # a pool whose engine disagrees, must take those workers out), without a restart.
    anchor = start_sim("vllm", max_context_tokens=8192)
    short = start_sim("vllm", max_context_tokens=32768)
    later = start_sim("sglang", max_context_tokens=65536)
    pools = [pool("a", "vllm", [anchor.url], 8192), pool("p", "vllm", [short.url], 131072)]
    gw = start_gateway_process(pools, health=CHECKED, load={"enabled": False})

    def worker(name: str) -> dict[str, Any]:
        pools = httpx.get(gw.url + "/admin/workers", timeout=5).json()["pools"]
        return dict(next(p["workers"][0] for p in pools if p["name"] == name))

    def state(name: str) -> str:
        return str(worker(name)["state"])

    wait_until(lambda: state("p") == "misconfigured", 10, "the 32K engine behind a 128K pool reported")
    config_path = gw.log.parent / "gateway.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["pools"] = [pool("a", "vllm", [anchor.url], 16384), pool("p", "vllm", [short.url], 32768),
                       pool("q", "sglang", [later.url], 131072)]
    config_path.write_text(yaml.safe_dump(config))
    answer = httpx.post(gw.url + "/admin/reload", timeout=10)
    assert answer.status_code == 200, answer.text
    wait_until(lambda: state("p") == "healthy", 10, "the fixed pool's worker back in service")
    wait_until(lambda: state("a") == "misconfigured", 10, "the 8K engine behind the now 16K pool reported")
    wait_until(lambda: state("q") == "misconfigured", 10, "the added pool's disagreeing worker reported")
    assert worker("q")["misconfigured"] == (
        "reports max_model_len 65536 tokens but the pool's max_context_tokens is 131072")
    assert "Traceback" not in gw.log_text()


@pytest.mark.anyio
async def test_a_retiring_worker_of_a_removed_pool_is_not_judged(start_sim: StartSim) -> None:
    # A reload removed pool p while a stream still ran on its worker: the worker's probes go on
    # until the stream ends, and its models check has no pool to compare with (nothing to judge).
    sim = start_sim("vllm", max_context_tokens=32768)
    config = parse_config({"pools": [pool("p", "vllm", [sim.url], 131072)], "health": CHECKED}, environ={})
    registry = WorkerRegistry(config)
    registry.configure(config.pools, initial=True)
    (worker,) = registry.pools["p"]
    client = H1Pool(5.0)
    try:
        health = HealthChecker(registry, client, config.health, GatewayMetrics(), config.pools,
                               config.pool_served_names())
        await health.check_models(worker)
        assert worker.misconfigured is not None
        health.set_pools([], {})
        await health.check_models(worker)  # no KeyError
        assert worker.misconfigured is not None  # the last verdict stays; the worker takes no new requests anyway
    finally:
        client.close()
