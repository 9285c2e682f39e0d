"""Issue 22 §2 and issue 37 §3, what to unload to make room for an on-demand LoRA adapter: the pure
choices of gateway/backends/lora_loader.py (`eviction_choice`, `plan_load`, `has_room`) on the
fleet's use (`lora_slots.SlotUse`), which adapters are the gateway's to unload
(`WorkerRegistry.set_adapters`), and the engines' error bodies it reads (`engine_message`: vLLM's
error object, SGLang's `LoRAUpdateOutput`; `adapter_missing`)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.lora_loader import adapter_missing, engine_message, eviction_choice, has_room, plan_load
from gateway.backends.lora_slots import SlotUse
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import UNKNOWN_LOAD, WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import parse_config

NOW = 1000.0
GRACE = 10.0


def use(loaded: dict[str, float] | None = None, used: dict[str, float] | None = None,
        busy: set[str] | None = None) -> SlotUse:
    return SlotUse(loaded or {}, used or {}, frozenset(busy or ()))


def test_the_least_recently_used_adapter_goes() -> None:
    seen = use({"a": 100.0, "b": 100.0, "c": 100.0}, {"a": 500.0, "b": 300.0, "c": 900.0})
    assert eviction_choice(["a", "b", "c"], seen, NOW, GRACE) == "b"


def test_one_in_flight_is_never_chosen() -> None:
    used = {"a": 200.0, "b": 300.0}
    assert eviction_choice(["a", "b"], use(used=used, busy={"a"}), NOW, GRACE) == "b"
    assert eviction_choice(["a", "b"], use(used=used, busy={"a", "b"}), NOW, GRACE) is None


def test_kept_and_unowned_adapters_are_never_chosen() -> None:
    """Only what the gateway may unload is in `owned`: a declared or operator-loaded adapter,
    however old its last use, is not a candidate; `keep` (declared names, the one being loaded) wins too."""
    seen = use(used={"a": 200.0, "b": 300.0, "declared": 1.0, "operators": 1.0})
    assert eviction_choice(["a", "b"], seen, NOW, GRACE, keep={"a"}) == "b"
    assert eviction_choice(["a", "b"], seen, NOW, GRACE, keep={"a", "b"}) is None
    assert eviction_choice([], seen, NOW, GRACE) is None


def test_a_fresh_load_waits_for_its_request_within_the_grace() -> None:
    """Loaded 2 s ago and not used since: the request that loaded it may still be queued."""
    assert eviction_choice(["fresh", "old"], use({"fresh": NOW - 2.0, "old": 100.0}, {"old": 900.0}),
                           NOW, GRACE) == "old"
    assert eviction_choice(["fresh"], use({"fresh": NOW - 2.0}), NOW, GRACE) is None
    assert eviction_choice(["fresh"], use({"fresh": NOW - 2.0}, {"fresh": NOW - 1.0}), NOW, GRACE) == "fresh"
    assert eviction_choice(["stale"], use({"stale": NOW - 11.0}), NOW, GRACE) == "stale"  # grace over


def test_an_adapter_of_unknown_load_and_use_goes_first() -> None:
    """Listed by the worker but loaded by another replica before this one started, and used by
    nobody it knows of: the oldest, as far as anyone can tell."""
    assert eviction_choice(["seen", "unknown"], use({"seen": 100.0}, {"seen": 200.0}), NOW, GRACE) == "unknown"


def test_ties_are_broken_by_name() -> None:
    assert eviction_choice(["b", "a"], use({"b": 1.0, "a": 1.0}), NOW, GRACE) == "a"


def test_the_fleets_use_and_this_processs_own_merge() -> None:
    """The later time of each, and busy in either: another replica's recent use or request in
    flight keeps an adapter this process last used long ago."""
    mine = use({"a": 100.0}, {"a": 150.0, "b": 900.0})
    fleet = use({"a": 50.0, "c": 300.0}, {"a": 950.0}, busy={"c"})
    merged = mine.merged(fleet)
    assert merged.loaded_at == {"a": 100.0, "c": 300.0} and merged.used_at == {"a": 950.0, "b": 900.0}
    assert merged.busy == {"c"}
    assert eviction_choice(["a", "b", "c"], merged, NOW, GRACE) == "b"


def pool(**fields: Any) -> PoolConfig:
    return PoolConfig.model_validate({
        "name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "max_context_tokens": 1024, "lora_adapters": ["declared"],
        "lora_on_demand": [{"name": n, "path": f"/loras/{n}"} for n in ("a", "b", "c")], **fields})


def worker(index: int, adapters: set[str], load: int = 0, **loaded_at: float) -> Worker:
    """A worker listing `adapters`, `load` requests on it, on-demand ones loaded (and last used) at
    `loaded_at` (time.monotonic() s, long ago)."""
    w = Worker("p", index, f"http://127.0.0.1:{index + 1}", ENGINES["vllm"])
    w.adapters = frozenset(adapters)
    w.in_flight = load
    w.on_demand = {name: (f"/loras/{name}", at) for name, at in loaded_at.items()}
    w.adapter_used_at = dict(loaded_at)
    return w


def test_has_room_counts_the_pools_on_demand_adapters_only() -> None:
    full = worker(0, {"a", "declared", "operators"})
    assert has_room(full, pool(max_loras=2)) and not has_room(full, pool(max_loras=1))
    assert has_room(worker(0, {"a", "b", "c"}), pool())  # no bound
    assert has_room(Worker("p", 0, "http://x:1", ENGINES["vllm"]), pool(max_loras=1))  # never read: empty


def test_plan_takes_the_least_loaded_worker_with_room() -> None:
    busy, idle, full = worker(0, set(), load=5), worker(1, set(), load=1), worker(2, {"a"}, load=0, a=1.0)
    assert plan_load([busy, idle, full], pool(max_loras=1), "b", time.time()) == (idle, None)


def test_plan_evicts_only_when_asked_and_only_what_may_go() -> None:
    w0 = worker(0, {"a"}, load=3, a=100.0)
    w1 = worker(1, {"b"}, load=1, b=100.0)
    now = time.time()
    assert plan_load([w0, w1], pool(max_loras=1), "c", now) is None  # lora_evict: never
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", now) == (w1, "b")
    w1.adapter_in_flight["b"] = 1
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", now) == (w0, "a")
    w0.adapter_in_flight["a"] = 1
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", now) is None
    w0.adapter_in_flight.clear()
    w1.adapter_in_flight.clear()
    busy_elsewhere = {w1.url: use(busy={"b"})}  # another replica's request in flight on w1's b
    assert plan_load([w0, w1], pool(max_loras=1, lora_evict="lru"), "c", now, busy_elsewhere) == (w0, "a")


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
    registry.adapter_loaded(w, "a")  # no path: served, not owned
    assert w.on_demand == {}


def test_an_on_demand_adapter_someone_else_loaded_is_the_gateways_to_unload() -> None:
    """Listed from the pool's path (or with no root), whoever loaded it: another replica, this one
    before a restart. Its load time is unknown here; a declared or operator's name never counts."""
    registry, w = registry_worker()
    registry.set_adapters(w, frozenset({"a", "ops"}), {"a": "/loras/a", "ops": "/operators/ops"},
                          read_at=time.monotonic())
    assert w.on_demand == {"a": ("/loras/a", UNKNOWN_LOAD)}
    registry.set_adapters(w, frozenset({"a"}), {"a": None}, read_at=time.monotonic())
    assert set(w.on_demand) == {"a"}
    registry.set_adapters(w, frozenset(), {}, read_at=time.monotonic())
    assert w.on_demand == {}


@pytest.mark.parametrize(("status", "body", "missing"), [
    (404, {"error": {"message": "The model `a` does not exist. Valid aliases: kimi-k3.", "type": "NotFoundError",
                     "param": "model", "code": 404}}, True),
    (400, {"object": "error", "message": "The following requested LoRA adapters are not loaded: a\n"
           "Loaded adapters: odict_keys(['b']).", "type": "BadRequest", "param": None, "code": 400}, True),
    (400, {"object": "error", "message": "The model `a` does not exist. The served model name is `kimi-k3`.",
           "type": "BadRequestError", "param": None, "code": 400}, True),
    (404, {"error": {"message": "The model `b` does not exist.", "type": "NotFoundError"}}, False),  # another
    (400, {"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError"}}, False),
    (500, {"error": {"message": "The model `a` does not exist."}}, False),
])
def test_an_engines_refusal_for_a_missing_adapter_is_recognized(status: int, body: dict[str, Any],
                                                               missing: bool) -> None:
    assert adapter_missing(status, orjson.dumps(body), "a") is missing
