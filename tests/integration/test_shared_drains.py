"""Operator drains shared through Redis: a drain sent to one gateway holds in every one."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from gateway.backends.drains import GONE_PROBES
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"kgw-test-drains-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(shared_redis_url())
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _workers_used(gw: RunningGateway, n: int = 8) -> set[str]:
    return {httpx.post(gw.v1 + "/chat/completions", json=CHAT).headers["x-kimi-gateway-worker"] for _ in range(n)}


def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the drain did not reach the other gateway"
        time.sleep(0.1)


def test_drain_on_one_gateway_holds_on_another(start_sim: StartSim, start_gateway: StartGateway,
                                               key_prefix: str) -> None:
    sims = [start_sim("vllm"), start_sim("vllm")]
    config = {"redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix}}
    first, second = (start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                                   **config) for _ in range(2))
    assert _workers_used(second) == {"p/0", "p/1"}

    drained = httpx.post(first.url + "/admin/workers/p/0/drain").json()
    assert drained["draining"] is True and drained["shared"] is True
    assert _workers_used(first) == {"p/1"}  # at once where it was sent
    _eventually(lambda: httpx.get(second.url + "/admin/workers/p/0").json()["draining"] is True)
    assert _workers_used(second) == {"p/1"}
    assert second.metric('kimi_gateway_worker_draining{pool="p",worker="p/0"}') == 1

    assert httpx.post(second.url + "/admin/workers/p/0/undrain").json()["shared"] is True
    _eventually(lambda: httpx.get(first.url + "/admin/workers/p/0").json()["draining"] is False)
    assert _workers_used(first) == {"p/0", "p/1"}


def test_a_drain_names_the_engine_not_its_index_on_every_replica(start_sim: StartSim, start_gateway: StartGateway,
                                                                 key_prefix: str) -> None:
    """Replicas that numbered the same workers differently (one reloaded a changed list, one started
    fresh) drain the same engine: what Redis holds is the worker's pool and URL."""
    s0, s1 = start_sim("vllm"), start_sim("vllm")
    config = {"redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix}}
    first = start_gateway([pool("p", "vllm", [s0.url, s1.url], 131072, policy="round_robin")], **config)
    second = start_gateway([pool("p", "vllm", [s1.url, s0.url], 131072, policy="round_robin")], **config)
    assert httpx.get(first.url + "/admin/workers/p/1").json()["url"] == s1.url
    assert httpx.get(second.url + "/admin/workers/p/0").json()["url"] == s1.url

    assert httpx.post(first.url + "/admin/workers/p/1/drain").json()["shared"] is True  # s1
    _eventually(lambda: httpx.get(second.url + "/admin/workers/p/0").json()["draining"] is True)
    assert httpx.get(second.url + "/admin/workers/p/1").json()["draining"] is False  # s0 keeps serving
    store = redis.Redis.from_url(shared_redis_url(), decode_responses=True)
    assert store.smembers(f"{key_prefix}:drained-urls") == {f"p {s1.url}"}
    assert _workers_used(second) == {"p/1"} and _workers_used(first) == {"p/0"}  # s0 on both
    # Both replicas report their in-flight count on s1 under the same name, and either answers for both.
    _eventually(lambda: httpx.get(second.url + "/admin/workers/p/0").json()["fleet_in_flight"]["reporters"] == 2)
    assert httpx.get(first.url + "/admin/workers/p/1").json()["fleet_in_flight"] == {"in_flight": 0, "reporters": 2}

    assert httpx.post(second.url + "/admin/workers/p/0/undrain").json()["shared"] is True  # s1 again
    _eventually(lambda: httpx.get(first.url + "/admin/workers/p/1").json()["draining"] is False)
    assert store.smembers(f"{key_prefix}:drained-urls") == set()
    store.close()


def test_without_redis_a_drain_says_it_is_not_shared(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    assert httpx.post(gw.url + "/admin/workers/p/0/drain").json()["shared"] is False


def test_a_drain_holds_through_a_listener_blip_and_lifts_for_a_restarted_engine(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The same simulated engine (one process start time in its /metrics, as vLLM with one API
    server) stops listening long enough for the probes to find it gone, then listens again: still
    drained. A new engine at that address (another start time): the drain is lifted."""
    sim = start_sim("vllm")
    port = sim.server.port
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], health={"interval": 0.2, "timeout": 1.0})

    def worker() -> dict[str, object]:
        return httpx.get(gw.url + "/admin/workers/p/0").json()  # type: ignore[no-any-return]

    def probed_twice() -> Callable[[], bool]:
        """True once two more probes reached the engine: the first of them started after this call,
        and had told the gateway what it saw before the second began."""
        start = sim.engine.health_checks
        return lambda: sim.engine.health_checks >= start + 2

    assert httpx.post(gw.url + "/admin/workers/p/0/drain").json()["draining"] is True
    _eventually(probed_twice(), timeout=10)  # the drained engine was seen answering
    sim.server.stop()  # nothing listens there now: connections are refused
    _eventually(lambda: worker()["failed_probes"] >= GONE_PROBES, timeout=10)
    again = ThreadedServer(sim.app, port=port).start()  # the same engine listens again
    try:
        _eventually(lambda: worker()["healthy"] is True, timeout=10)
        _eventually(probed_twice(), timeout=10)
        assert worker()["draining"] is True
    finally:
        again.stop()
    _eventually(lambda: worker()["failed_probes"] >= GONE_PROBES, timeout=10)
    restarted = ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=131072)), port=port)
    restarted.start()
    try:
        _eventually(lambda: worker()["draining"] is False, timeout=10)
    finally:
        restarted.stop()
