"""Issue 37 §3: on-demand LoRA adapter slots are the fleet's, not one gateway process's. Two gateway
replicas (and a restarted one) in front of one simulated vLLM worker with runtime LoRA loading
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), sharing the real Redis (own key prefix,
deleted afterwards): a replica unloads an adapter the other loaded, by the least recent use across
both; never one with a request in flight in the other; a replica whose view is stale loads the
adapter again instead of passing the engine's 404 on; a restarted replica frees slots too."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HI = [{"role": "user", "content": "hi"}]
STALE = {"interval": 0.2, "timeout": 2.0, "verify_models": True, "models_refresh": 3600.0}
"""Each replica reads the worker's /v1/models once at start, then (for the test's length) only
before a load: what another replica did meanwhile is unknown to it until then."""


StartReplica = Callable[..., RunningGateway]


@pytest.fixture
def prefix() -> str:
    """A fresh Redis key prefix (the replicas' `affinity.key_prefix`), deleted by `start_replica`."""
    return f"test-lora-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_replica(start_gateway: StartGateway, prefix: str) -> Iterator[StartReplica]:
    """Factory: `start_replica(sim, max_loras, **settings)` -> a gateway replica in front of `sim`
    (vLLM, on-demand adapters a, b, c, `lora_evict: lru`) on the shared Redis under `prefix`. At the
    end every replica is stopped (its last use written) and then the prefix's keys are deleted."""
    started: list[RunningGateway] = []

    def start(sim: RunningSim, max_loras: int, **settings: Any) -> RunningGateway:
        gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_loras=max_loras, lora_evict="lru",
                                 lora_on_demand=[{"name": n, "path": f"/loras/{n}"} for n in ("a", "b", "c")])],
                           redis_url=shared_redis_url(), affinity={"enabled": False, "key_prefix": prefix},
                           load={"enabled": False}, **settings)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.server.stop()
    client = redis.Redis.from_url(shared_redis_url())
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def ask(gw: RunningGateway, model: str) -> None:
    answer = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).chat.completions.create(
        model=model, messages=HI, max_tokens=2)
    assert answer.choices[0].message.content


def shared(prefix: str, sim: RunningSim, kind: str) -> dict[str, float]:
    """The worker's Redis sorted set `kind` (`used`, `busy`, `loaded`), member -> score."""
    client = redis.Redis.from_url(shared_redis_url())
    try:
        members = client.zrange(f"{prefix}:lora:{{{sim.url}}}:{kind}", 0, -1, withscores=True)
    finally:
        client.close()
    return {member.decode(): score for member, score in members}


def used_since_load(prefix: str, sim: RunningSim, adapter: str) -> bool:
    """Whether Redis has a use of `adapter` on the worker after its last load (until then every
    replica leaves it alone: the request that loaded it may still wait for a slot)."""
    used, loaded = shared(prefix, sim, "used"), shared(prefix, sim, "loaded")
    return adapter in used and used[adapter] > loaded.get(adapter, float("-inf"))


def until(what: str, condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)


def test_replicas_unload_each_others_adapters_by_their_shared_use(
        start_sim: StartSim, start_replica: StartReplica, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two slots. `first` loads a, `second` b, `first` uses a again: `second`'s c unloads b, the
    least recently used across both (alone it would have taken a, whose use it never saw). Then
    `second` uses c again and loads b: it unloads a, which `first` loaded and it never used (a
    process that frees only its own slots would unload its c, used a moment ago)."""
    caplog.set_level(logging.INFO, logger="gateway.lora")
    sim = start_sim("vllm", runtime_lora_updating=True)
    first, second = (start_replica(sim, 2) for _ in range(2))
    ask(first, "a")
    ask(second, "b")
    ask(first, "a")
    until("first's use of a after second's of b reached Redis",
          lambda: shared(prefix, sim, "used").keys() >= {"a", "b"}
          and shared(prefix, sim, "used")["a"] > shared(prefix, sim, "used")["b"])
    ask(second, "c")
    assert set(sim.engine.loras) == {"a", "c"}
    ask(second, "c")
    ask(second, "b")
    assert set(sim.engine.loras) == {"c", "b"}
    unloads = [r.getMessage() for r in caplog.records if "unloaded LoRA adapter" in r.getMessage()]
    assert [line.split("unloaded LoRA adapter ")[1].split(" ")[0] for line in unloads] == ["b", "a"]
    assert second.metric('kimi_gateway_lora_unloads_total{outcome="ok",pool="p"}') == 2
    assert first.metric("kimi_gateway_lora_unloads_total") == 0


def test_an_adapter_with_a_request_in_flight_in_another_replica_is_not_unloaded(
        start_sim: StartSim, start_replica: StartReplica, prefix: str) -> None:
    """One slot. While `first` streams from a (the engine stalls after 3 events: the stream lasts
    until its client leaves), `second` finds nothing it may unload (503, as for a request of its own
    in flight); once the client left (and `first` said so), `second` unloads a and loads b."""
    sim = start_sim("vllm", runtime_lora_updating=True, faults=SimFaults(stall_after_chunks=3))
    first, second = (start_replica(sim, 1) for _ in range(2))
    body = {"model": "a", "messages": HI, "max_tokens": 60, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", first.v1 + "/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # held: a closed iterator would hang up the stream
        assert any(line.startswith("data: ") for line in lines)
        until("first's request in flight on a reached Redis", lambda: any(
            member.startswith("a\x00") for member in shared(prefix, sim, "busy")))
        with pytest.raises(openai.InternalServerError) as busy:
            ask(second, "b")
        assert busy.value.status_code == 503 and "none to unload" in busy.value.message
        assert list(sim.engine.loras) == ["a"]
    first.wait_until_idle()
    until("first's request on a over in Redis", lambda: not shared(prefix, sim, "busy"))
    ask(second, "b")
    assert list(sim.engine.loras) == ["b"]


def test_a_stale_replica_reloads_and_a_restarted_one_frees_slots(start_sim: StartSim, start_replica: StartReplica,
                                                                 prefix: str) -> None:
    """One slot; each replica read the worker's list at its start only. `second` unloads a (which
    `first` loaded) to load b; `first`, still believing a loaded, gets vLLM's 404 for it and loads it
    again (unloading b) instead of passing the 404 on. Then `first` restarts: the new process, which
    loaded nothing, unloads a to load c."""
    sim = start_sim("vllm", runtime_lora_updating=True)
    first, second = (start_replica(sim, 1, health=STALE) for _ in range(2))
    until("both replicas read the worker's list", lambda: sim.engine.models_reads >= 2)
    ask(first, "a")
    until("first's use of a reached Redis", lambda: used_since_load(prefix, sim, "a"))
    ask(second, "b")
    assert list(sim.engine.loras) == ["b"]
    until("second's use of b reached Redis", lambda: used_since_load(prefix, sim, "b"))
    ask(first, "a")
    assert list(sim.engine.loras) == ["a"]
    sent = [(r.body["model"], r.status) for r in sim.engine.records]
    assert sent == [("a", 200), ("b", 200), ("a", 404), ("a", 200)]  # the 404 was not the client's answer
    assert first.metric('kimi_gateway_lora_loads_total{outcome="ok",pool="p"}') == 2
    until("first's use of a reached Redis", lambda: used_since_load(prefix, sim, "a"))
    first.server.stop()
    restarted = start_replica(sim, 1, health=STALE)
    ask(restarted, "c")
    assert list(sim.engine.loras) == ["c"]
    assert restarted.metric('kimi_gateway_lora_unloads_total{outcome="ok",pool="p"}') == 1
