"""Issue 22 §2, what to unload to make room for an on-demand LoRA adapter: the pure choices of
gateway/backends/lora_loader.py (`eviction_choice`, `plan_load`, `has_room`) and the engines' error
bodies it reads (`engine_message`: vLLM's error object, SGLang's `LoRAUpdateOutput`)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.lora_loader import engine_message, eviction_choice, has_room, plan_load
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import parse_config

NOW = 1000.0
GRACE = 10.0


def owned(**loaded_at: float) -> dict[str, tuple[str, float]]:
    return {name: (f"/loras/{name}", at) for name, at in loaded_at.items()}


def test_the_least_recently_used_adapter_goes() -> None:
    loaded = owned(a=100.0, b=100.0, c=100.0)
    assert eviction_choice(loaded, {}, {"a": 500.0, "b": 300.0, "c": 900.0}, NOW, GRACE) == "b"


def test_one_in_flight_is_never_chosen() -> None:
    loaded = owned(a=100.0, b=100.0)
    used = {"a": 200.0, "b": 300.0}
    assert eviction_choice(loaded, {"a": 1}, used, NOW, GRACE) == "b"
    assert eviction_choice(loaded, {"a": 1, "b": 2}, used, NOW, GRACE) is None
    assert eviction_choice(loaded, {"a": 0}, used, NOW, GRACE) == "a"  # a count down to 0 is free


def test_kept_and_unowned_adapters_are_never_chosen() -> None:
    """Only what the gateway loaded is in `owned`: a declared or operator-loaded adapter, however
    old its last use, is not a candidate; `keep` (declared names, the one being loaded) wins too."""
    loaded = owned(a=100.0, b=100.0)
    used = {"a": 200.0, "b": 300.0, "declared": 1.0, "operators": 1.0}
    assert eviction_choice(loaded, {}, used, NOW, GRACE, keep={"a"}) == "b"
    assert eviction_choice(loaded, {}, used, NOW, GRACE, keep={"a", "b"}) is None
    assert eviction_choice({}, {}, used, NOW, GRACE) is None


def test_a_fresh_load_waits_for_its_request_within_the_grace() -> None:
    """Loaded 2 s ago and not used since: the request that loaded it may still be queued."""
    loaded = owned(fresh=NOW - 2.0, old=100.0)
    assert eviction_choice(loaded, {}, {"fresh": NOW - 2.0, "old": 900.0}, NOW, GRACE) == "old"
    assert eviction_choice(owned(fresh=NOW - 2.0), {}, {}, NOW, GRACE) is None
    assert eviction_choice(owned(fresh=NOW - 2.0), {}, {"fresh": NOW - 1.0}, NOW, GRACE) == "fresh"  # used since
    assert eviction_choice(owned(stale=NOW - 11.0), {}, {}, NOW, GRACE) == "stale"  # grace over


def test_ties_are_broken_by_name() -> None:
    assert eviction_choice(owned(b=1.0, a=1.0), {}, {}, NOW, GRACE) == "a"


def pool(**fields: Any) -> PoolConfig:
    return PoolConfig.model_validate({
        "name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "max_context_tokens": 1024, "lora_adapters": ["declared"],
        "lora_on_demand": [{"name": n, "path": f"/loras/{n}"} for n in ("a", "b", "c")], **fields})


def worker(index: int, adapters: set[str], load: int = 0, **loaded_at: float) -> Worker:
    w = Worker("p", index, f"http://127.0.0.1:{index + 1}", ENGINES["vllm"])
    w.adapters = frozenset(adapters)
    w.in_flight = load
    w.on_demand = owned(**loaded_at)
    w.adapter_used_at = {name: at for name, at in loaded_at.items()}
    return w


def test_has_room_counts_the_pools_on_demand_adapters_only() -> None:
    full = worker(0, {"a", "declared", "operators"})
    assert has_room(full, pool(max_loras=2)) and not has_room(full, pool(max_loras=1))
    assert has_room(worker(0, {"a", "b", "c"}), pool())  # no bound
    assert has_room(Worker("p", 0, "http://x:1", ENGINES["vllm"]), pool(max_loras=1))  # never read: empty


def test_plan_takes_the_least_loaded_worker_with_room() -> None:
    busy, idle, full = worker(0, set(), load=5), worker(1, set(), load=1), worker(2, {"a"}, load=0, a=1.0)
    assert plan_load([busy, idle, full], pool(max_loras=1), "b", NOW) == (idle, None)


def test_plan_evicts_only_when_asked_and_only_what_may_go() -> None:
    w0 = worker(0, {"a"}, load=3, a=100.0)
    w1 = worker(1, {"b"}, load=1, b=100.0)
    assert plan_load([w0, w1], pool(max_loras=1), "c", NOW) is None  # lora_evict: never
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", NOW) == (w1, "b")
    w1.adapter_in_flight["b"] = 1
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", NOW) == (w0, "a")
    w0.adapter_in_flight["a"] = 1
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", NOW) is None


def test_the_evict_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="lora_evict"):
        pool(lora_evict="fifo")


@pytest.mark.parametrize(("body", "message"), [
    ({"error": {"message": "The lora adapter 'x' has already been loaded.", "type": "InvalidUserInput"}},
     "The lora adapter 'x' has already been loaded."),
    ({"object": "error", "message": "old flat shape"}, "old flat shape"),
    ({"rid": None, "http_worker_ipc": None, "success": False,
      "error_message": "Failed to load LoRA adapter x because it is already loaded", "loaded_adapters": {}},
     "Failed to load LoRA adapter x because it is already loaded"),
    ({"detail": "Not Found"}, None),
])
def test_engine_messages_are_read_from_each_engines_error_shape(body: dict[str, Any], message: str | None) -> None:
    assert engine_message(orjson.dumps(body)) == message


def test_a_plain_text_answer_is_its_own_message() -> None:
    assert engine_message(b"  Internal Server Error \n") == "Internal Server Error"
    assert engine_message(b"") is None


def registry_worker() -> tuple[WorkerRegistry, Worker]:
    on_demand_a = [{"name": "a", "path": "/loras/a"}]
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1"],
                                      "max_context_tokens": 1024, "lora_on_demand": on_demand_a}]}, environ={})
    registry = WorkerRegistry(config)
    found = registry.find("p", 0)
    assert found is not None
    return registry, found


def test_a_list_read_before_a_load_or_unload_does_not_undo_it() -> None:
    registry, w = registry_worker()
    before = time.monotonic()
    registry.adapter_loaded(w, "a", "/loras/a")
    registry.set_adapters(w, frozenset(), {}, read_at=before)  # asked before the load: it stays
    assert w.adapters == {"a"} and set(w.on_demand) == {"a"}
    registry.set_adapters(w, frozenset(), {}, read_at=time.monotonic())  # asked after: a restart lost it
    assert w.adapters == frozenset() and w.on_demand == {}
    registry.adapter_loaded(w, "a", "/loras/a")
    before = time.monotonic()
    registry.adapter_unloaded(w, "a")
    registry.set_adapters(w, frozenset({"a"}), {"a": "/loras/a"}, read_at=before - 1)  # stale list
    assert w.adapters == frozenset() and w.on_demand == {}


def test_an_adapter_listed_from_another_path_is_no_longer_the_gateways() -> None:
    registry, w = registry_worker()
    registry.adapter_loaded(w, "a", "/loras/a")
    registry.set_adapters(w, frozenset({"a"}), {"a": "/loras/a"}, read_at=time.monotonic())
    assert set(w.on_demand) == {"a"}
    registry.set_adapters(w, frozenset({"a"}), {"a": "/operators/a"}, read_at=time.monotonic())
    assert w.adapters == {"a"} and w.on_demand == {}  # served still, never unloaded by the gateway
    registry.adapter_loaded(w, "a")  # "already loaded": served, not owned
    assert w.on_demand == {}
