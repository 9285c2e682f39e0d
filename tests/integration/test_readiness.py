"""`/ready` means "this replica can route" (issue 24 §1): one pool's only worker going away (an NVL72
rack restarting for minutes) leaves the replica ready and the other pools' traffic served; the
requests only that pool fits get 503 with `Retry-After`; all pools down, or a drain, make it unready.
Real gateway, real sims on loopback; a worker "dies" by its server stopping (connections refused)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.app import begin_draining
from gateway.config import parse_config
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
FAST_HEALTH = {"interval": 0.1, "timeout": 0.5}
SHORT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# ~6,000 estimated prompt tokens: more than the small pool's 4,096 context, only the large pool fits it.
LONG = {"model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 4}


def ready(gw: RunningGateway) -> tuple[int, dict[str, Any]]:
    answer = httpx.get(gw.url + "/ready", timeout=5)
    return answer.status_code, answer.json()


def wait_unready_pools(gw: RunningGateway, expected: list[str], timeout: float = 10) -> tuple[int, dict[str, Any]]:
    """Poll /ready until its `unready_pools` is `expected`; (status, body) then."""
    deadline = time.monotonic() + timeout
    while (answer := ready(gw))[1]["unready_pools"] != expected:
        assert time.monotonic() < deadline, f"unready_pools stayed {answer[1]['unready_pools']}, not {expected}"
        time.sleep(0.05)
    return answer


def two_pools(start_sim: StartSim, start_gateway: StartGateway,
              **settings: Any) -> tuple[RunningSim, RunningSim, RunningGateway]:
    small, large = start_sim("vllm", max_context_tokens=4096), start_sim("vllm", max_context_tokens=131072)
    gw = start_gateway([pool("small", "vllm", [small.url], 4096), pool("large", "vllm", [large.url], 131072)],
                       health=FAST_HEALTH, load={"enabled": False}, **settings)
    wait_unready_pools(gw, [])
    return small, large, gw


def test_a_pool_down_leaves_the_replica_ready_and_the_other_pools_serving(start_sim: StartSim,
                                                                           start_gateway: StartGateway) -> None:
    small, large, gw = two_pools(start_sim, start_gateway)
    assert ready(gw)[0] == 200
    large.server.stop()  # the large pool's only worker is gone (a rack restarting)
    status, body = wait_unready_pools(gw, ["large"])
    assert status == 200 and body["ready"] is True and body["draining"] is False
    served = httpx.post(gw.v1 + "/chat/completions", json=SHORT, timeout=10)
    assert served.status_code == 200, served.text
    assert served.headers["x-kimi-gateway-pool"] == "small"
    refused = httpx.post(gw.v1 + "/chat/completions", json=LONG, timeout=10)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "no_healthy_upstream"
    assert int(refused.headers["retry-after"]) >= 1
    assert "large" in refused.json()["error"]["message"]
    small.server.stop()  # now no pool serves: the replica cannot route anything
    status, body = wait_unready_pools(gw, ["small", "large"])
    assert status == 503 and body["ready"] is False


def test_the_small_pool_down_spills_its_requests_to_the_large_one(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    small, _, gw = two_pools(start_sim, start_gateway)
    small.server.stop()
    assert wait_unready_pools(gw, ["small"])[0] == 200
    served = httpx.post(gw.v1 + "/chat/completions", json=SHORT, timeout=10)
    assert served.status_code == 200, served.text
    assert served.headers["x-kimi-gateway-pool"] == "large"


def test_a_misconfigured_worker_leaves_the_replica_ready_for_the_other_pools(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    small = start_sim("vllm", max_context_tokens=4096)
    wrong = start_sim("vllm", max_context_tokens=131072, served_model_names=["kimi-k3-preview"])
    gw = start_gateway([pool("small", "vllm", [small.url], 4096), pool("large", "vllm", [wrong.url], 131072)],
                       health={**FAST_HEALTH, "verify_models": True}, load={"enabled": False})
    deadline = time.monotonic() + 10
    while ready(gw)[1]["pools"]["large"][0]["misconfigured"] is None:  # its /v1/models names another model
        assert time.monotonic() < deadline, "the worker serving another model was not marked misconfigured"
        time.sleep(0.05)
    status, body = wait_unready_pools(gw, ["large"])
    assert status == 200 and body["pools"]["large"][0]["healthy"] is True  # healthy, yet no traffic
    assert httpx.post(gw.v1 + "/chat/completions", json=SHORT, timeout=10).status_code == 200
    refused = httpx.post(gw.v1 + "/chat/completions", json=LONG, timeout=10)
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert wrong.engine.records == []


@pytest.mark.parametrize(("required", "ready_with_large_down"), [("all", False), (["large"], False),
                                                                  (["small"], True)])
def test_readiness_pools_names_what_must_serve(start_sim: StartSim, start_gateway: StartGateway,
                                               required: Any, ready_with_large_down: bool) -> None:
    _, large, gw = two_pools(start_sim, start_gateway, readiness={"pools": required})
    assert ready(gw)[0] == 200
    large.server.stop()
    status, body = wait_unready_pools(gw, ["large"])
    assert (status == 200) is ready_with_large_down and body["ready"] is ready_with_large_down


def test_readiness_none_keeps_a_replica_ready_with_no_pool_serving_until_it_drains(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """`none` (the single-pool Kubernetes overlays): every pool down, the replica stays ready and
    answers the request itself (503 with Retry-After); draining still makes it unready."""
    small, large, gw = two_pools(start_sim, start_gateway, readiness={"pools": "none"})
    small.server.stop()
    large.server.stop()
    status, body = wait_unready_pools(gw, ["small", "large"])
    assert status == 200 and body["ready"] is True
    refused = httpx.post(gw.url + "/v1/chat/completions", json=SHORT, timeout=30)
    assert refused.status_code == 503 and "retry-after" in refused.headers
    begin_draining(gw.server.app)
    status, body = ready(gw)
    assert status == 503 and body["draining"] is True


def test_draining_makes_a_serving_replica_unready(start_sim: StartSim, start_gateway: StartGateway) -> None:
    _, _, gw = two_pools(start_sim, start_gateway)
    begin_draining(gw.server.app)
    status, body = ready(gw)
    assert status == 503 and body == {**body, "ready": False, "draining": True, "unready_pools": []}
    assert httpx.get(gw.url + "/health", timeout=5).status_code == 200  # liveness is not readiness


def test_readiness_pools_must_name_configured_pools() -> None:
    with pytest.raises(ValidationError, match=r"readiness\.pools names no configured pool: \['nvl72'\]"):
        parse_config({"pools": [pool("small", "vllm", ["http://127.0.0.1:1"], 4096)],
                      "readiness": {"pools": ["nvl72"]}}, environ={})
    with pytest.raises(ValidationError, match=r"readiness\.pools"):
        parse_config({"pools": [pool("small", "vllm", ["http://127.0.0.1:1"], 4096)],
                      "readiness": {"pools": "most"}}, environ={})
