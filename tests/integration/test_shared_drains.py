"""Operator drains shared through Redis: a drain sent to one gateway holds in every one."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"kgw-test-drains-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(shared_redis_url())
    client.delete(f"{prefix}:drained")
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


def test_without_redis_a_drain_says_it_is_not_shared(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    assert httpx.post(gw.url + "/admin/workers/p/0/drain").json()["shared"] is False
