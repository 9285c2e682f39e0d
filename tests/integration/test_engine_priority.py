"""The engines' `priority` field under the gateway's control (issue 39, gateway/flow/priority.py):
a client's own reaches an engine only when its key may set it; a pool whose engines run priority
scheduling gets the request's band in its engine's terms. Keys in a real Redis (their limits)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.auth.keys import hash_key
from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
REDIS_URL = shared_redis_url()
KEYS = {"alice": "sk-alice-" + "a" * 32, "trusted": "sk-trusted-" + "t" * 30, "gold": "sk-gold-" + "g" * 33}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"test-prio-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def auth(prefix: str) -> dict[str, Any]:
    per_key: dict[str, dict[str, Any]] = {"trusted": {"client_priority": True},
                                          "gold": {"priority": 2, "max_priority": 3}}
    return {"enabled": True, "key_prefix": prefix, "keys": [
        {"name": name, "sha256": hash_key(key), "requests_per_minute": 10_000, **per_key.get(name, {})}
        for name, key in KEYS.items()]}


def sent_priority(sim: RunningSim) -> Any:
    """The last engine request's `priority` ("absent" when it had none)."""
    return sim.engine.records[-1].body.get("priority", "absent")


def post(gw: RunningGateway, who: str, path: str = "/chat/completions", headers: dict[str, str] | None = None,
         **fields: Any) -> httpx.Response:
    if path == "/messages":
        body = {"model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **fields}
    elif path == "/completions":
        body = {"model": "kimi-k3", "max_tokens": 1, "prompt": "hi", **fields}
    else:
        body = {"model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **fields}
    answer = httpx.post(gw.v1 + path, json=body, headers={"authorization": f"Bearer {KEYS[who]}", **(headers or {})},
                        timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.parametrize("offload", [False, True])
def test_a_clients_priority_reaches_the_engine_only_when_its_key_may_set_it(
        start_sim: StartSim, start_gateway: StartGateway, key_prefix: str, offload: bool) -> None:
    sim = start_sim("vllm")
    settings: dict[str, Any] = {"parse_offload_bytes": 0} if offload else {}  # 0: every body in a parse process
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], redis_url=REDIS_URL, auth=auth(key_prefix), **settings)
    post(gw, "alice", priority=-100, routed_dp_rank=0)    # would jump every queue on a priority engine
    assert sent_priority(sim) == "absent" and "routed_dp_rank" not in sim.engine.records[-1].body
    post(gw, "alice", "/completions", priority=-100)
    assert sent_priority(sim) == "absent"
    post(gw, "trusted", priority=-100, routed_dp_rank=0)
    assert sent_priority(sim) == -100 and sim.engine.records[-1].body["routed_dp_rank"] == 0
    post(gw, "alice")
    assert sent_priority(sim) == "absent"                 # nothing added on a pool without engine_priority


def test_auth_off_passes_the_clients_priority_as_before(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    answer = httpx.post(gw.v1 + "/chat/completions", json={"model": "kimi-k3", "max_tokens": 1, "priority": 3,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and sent_priority(sim) == 3


@pytest.mark.parametrize(("engine", "sign"), [("vllm", -1), ("sglang", 1)])
def test_a_priority_pool_gets_the_band_in_its_engines_terms(start_sim: StartSim, start_gateway: StartGateway,
                                                            key_prefix: str, engine: str, sign: int) -> None:
    sim = start_sim(engine)
    gw = start_gateway([pool("p", engine, [sim.url], 131072, flow_control={"engine_priority": True})],
                       redis_url=REDIS_URL, auth=auth(key_prefix))
    post(gw, "gold", priority=-100)                       # its own is stripped, its band set
    assert sent_priority(sim) == sign * 2
    post(gw, "gold", headers={"x-kimi-priority": "9"})    # capped at its max_priority, 3
    assert sent_priority(sim) == sign * 3
    post(gw, "gold", "/completions", headers={"x-kimi-priority": "-1"})
    assert sent_priority(sim) == sign * -1
    post(gw, "alice")
    assert sent_priority(sim) == 0
    post(gw, "trusted", priority=7)                       # a key that may set it keeps its own
    assert sent_priority(sim) == 7
    post(gw, "gold", "/messages")                          # no `priority` in the engines' Messages requests
    assert sent_priority(sim) == "absent"


def test_spilling_to_a_pool_without_priority_scheduling_drops_the_field(
        start_sim: StartSim, start_gateway: StartGateway, key_prefix: str) -> None:
    """The first pool's engine answers 503 to the body with the band's priority; the request goes
    on to a pool whose engines run no priority scheduling: no `priority` there."""
    small, big = start_sim("vllm", faults=SimFaults(fail_status=503)), start_sim("vllm")
    gw = start_gateway([pool("small", "vllm", [small.url], 131072, flow_control={"engine_priority": True}),
                        pool("big", "vllm", [big.url], 131072)], redis_url=REDIS_URL, auth=auth(key_prefix))
    answer = post(gw, "gold")
    assert answer.headers["x-kimi-gateway-pool"] == "big"
    assert sent_priority(small) == -2 and sent_priority(big) == "absent"
