"""Issue 37 §3, the fleet's use of on-demand LoRA adapters (gateway/backends/lora_slots.py): this
process's own use in unix time, merged with the other replicas' as the real (shared) Redis holds it
(own key prefix, deleted afterwards): each process writes only what changed, renews `busy` while it
has requests in flight and removes it after; a lapsed `busy` entry (a process that stopped writing)
no longer counts; a load is fresh until its first use is written, an unload forgets both."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from gateway.backends.lora_slots import BUSY_TTL_S, NO_USE, LoraSlots, SlotUse, local_use
from gateway.backends.registry import UNKNOWN_LOAD, WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import parse_config
from tests.support import shared_redis_url

URL = "http://127.0.0.1:1"


def registry() -> WorkerRegistry:
    return WorkerRegistry(parse_config({"pools": [{
        "name": "p", "engine": "vllm", "workers": [URL], "max_context_tokens": 1024, "lora_evict": "lru",
        "max_loras": 2, "lora_on_demand": [{"name": n, "path": f"/loras/{n}"} for n in ("a", "b")]}]}, environ={}))


def the_worker(reg: WorkerRegistry) -> Worker:
    found = reg.find("p", 0)
    assert found is not None
    return found


def test_local_use_is_in_unix_time_and_knows_no_load_it_did_not_see() -> None:
    w = the_worker(registry())
    w.on_demand = {"a": ("/loras/a", 100.0), "b": ("/loras/b", UNKNOWN_LOAD)}
    w.adapter_used_at = {"a": 150.0}
    w.adapter_in_flight = {"a": 1, "b": 0}
    use = local_use(w, wall_offset=1_000.0)
    assert use == SlotUse({"a": 1_100.0}, {"a": 1_150.0}, frozenset({"a"}))


def test_merging_takes_the_later_times_and_every_busy_one() -> None:
    merged = SlotUse({"a": 1.0}, {"a": 5.0}, frozenset({"a"})).merged(SlotUse({"a": 2.0, "b": 3.0}, {"a": 4.0},
                                                                                frozenset({"b"})))
    assert merged == SlotUse({"a": 2.0, "b": 3.0}, {"a": 5.0}, frozenset({"a", "b"}))
    assert NO_USE.merged(NO_USE) == NO_USE


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"test-lora-unit-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(shared_redis_url())
    keys = list(client.scan_iter(f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def replicas(prefix: str) -> AsyncIterator[tuple[LoraSlots, LoraSlots]]:
    """Two processes' stores (their own registries) on one worker URL, sharing Redis; not started:
    the test syncs them itself."""
    first, second = (LoraSlots(registry(), shared_redis_url(), prefix) for _ in range(2))
    yield first, second
    await first.stop()
    await second.stop()


@pytest.mark.anyio
async def test_a_replicas_use_reaches_the_other(replicas: tuple[LoraSlots, LoraSlots]) -> None:
    first, second = replicas
    mine, theirs = the_worker(first.registry), the_worker(second.registry)
    now = time.monotonic()
    mine.on_demand["a"] = ("/loras/a", now - 5)
    await first.loaded(mine, "a")
    seen = await second.fleet_use(theirs)
    assert seen.loaded_at.keys() == {"a"} and seen.used_at == {} and seen.busy == frozenset()  # fresh
    mine.adapter_used_at["a"] = now - 5  # the load itself is no use
    await first.sync()
    assert (await second.fleet_use(theirs)).used_at == {}
    mine.adapter_in_flight["a"] = 1
    mine.adapter_used_at["a"] = now
    await first.sync()
    seen = await second.fleet_use(theirs)
    assert seen.busy == {"a"} and seen.used_at["a"] > seen.loaded_at["a"]
    mine.adapter_in_flight["a"] = 0
    await first.sync()
    assert (await second.fleet_use(theirs)).busy == frozenset()
    await second.unloaded(theirs, "a")
    assert await first.fleet_use(mine) == NO_USE


@pytest.mark.anyio
async def test_only_the_pools_on_demand_adapters_are_written(replicas: tuple[LoraSlots, LoraSlots]) -> None:
    first, second = replicas
    mine = the_worker(first.registry)
    mine.adapter_in_flight["declared"] = 3
    mine.adapter_used_at["declared"] = time.monotonic()
    await first.sync()
    assert await second.fleet_use(the_worker(second.registry)) == NO_USE


@pytest.mark.anyio
async def test_a_busy_entry_no_longer_renewed_lapses(replicas: tuple[LoraSlots, LoraSlots], prefix: str) -> None:
    """A process that died holding a request: its entry counts until its expiry, not after."""
    first, second = replicas
    theirs = the_worker(second.registry)
    client = redis.Redis.from_url(shared_redis_url())
    try:
        client.zadd(second.key(theirs, "busy"), {"a\x00dead-host:1:x": time.time() + BUSY_TTL_S,
                                                 "b\x00dead-host:1:x": time.time() - 1})
    finally:
        client.close()
    assert (await first.fleet_use(the_worker(first.registry))).busy == {"a"}


@pytest.mark.anyio
async def test_without_redis_a_process_knows_only_its_own_use() -> None:
    slots = LoraSlots(registry(), None, "unused")
    w = the_worker(slots.registry)
    await slots.loaded(w, "a")
    await slots.sync()
    assert not slots.shared and await slots.fleet_use(w) == NO_USE
    await slots.stop()
