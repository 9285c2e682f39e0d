"""The worker set changing at run time (WorkerRegistry.configure / set_discovered / sweep), the
pool policies keeping unchanged pools' policies, metric series of a gone worker, discovery config rules."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from gateway.backends.periodic import PeriodicEach
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig, parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.pool_policies import PoolPolicies


def config(*pools: dict[str, Any]) -> GatewayConfig:
    return parse_config({"pools": list(pools)}, environ={})


def pool(name: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "engine": "vllm", "max_context_tokens": 1000, "workers": urls, **extra}


class Watcher:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.gone: list[str] = []

    def worker_added(self, worker: Worker) -> None:
        self.added.append(worker.id)

    def worker_gone(self, worker: Worker) -> None:
        self.gone.append(worker.id)


def test_added_worker_waits_for_a_probe_and_removed_one_finishes_its_requests() -> None:
    metrics = GatewayMetrics()
    reg = WorkerRegistry(config(pool("p", ["http://a:1", "http://b:1"])), metrics)
    watcher = Watcher()
    reg.watchers.append(watcher)
    a, b = reg.pools["p"]
    assert a.healthy and b.healthy  # the start-up set begins healthy, as before
    before = reg.pools["p"]
    b.in_flight = 2  # two streams open on b

    changes = reg.configure(config(pool("p", ["http://a:1", "http://c:1"])).pools)
    assert changes == ["pool p changed", "worker p/2 (http://c:1) added",
                       "worker p/1 (http://b:1) removed; 2 in flight finish"]
    assert before == [a, b]  # the old list is untouched: a request holding it sees a consistent set
    c = reg.find("p", 2)
    assert c is not None and not c.healthy and c.last_error == "not probed yet"
    assert reg.candidates("p") == [a]  # b gets no new requests, c none until probed
    assert watcher.added == ["p/2"]
    reg.probe_passed(c)
    assert reg.candidates("p") == [a, c]

    assert reg.sweep() == [] and reg.retiring == [b]  # still streaming
    b.in_flight = 0
    text = generate_latest(metrics.registry).decode()
    assert 'worker="p/1"' in text
    assert reg.sweep() == [b]
    assert watcher.gone == ["p/1"] and reg.retiring == []
    assert 'worker="p/1"' not in generate_latest(metrics.registry).decode()
    assert reg.find("p", 1) is None


def test_indices_are_not_reused_and_a_url_back_while_retiring_is_the_same_worker() -> None:
    reg = WorkerRegistry(config(pool("p", ["http://a:1", "http://b:1"])))
    b = reg.pools["p"][1]
    b.in_flight = 1
    reg.configure(config(pool("p", ["http://a:1"])).pools)
    reg.configure(config(pool("p", ["http://a:1", "http://b:1", "http://d:1"])).pools)
    assert reg.pools["p"][1] is b and not b.retired and reg.retiring == []
    assert [w.id for w in reg.pools["p"]] == ["p/0", "p/1", "p/2"]
    reg.configure(config(pool("p", ["http://a:1"])).pools)
    b.in_flight = 0
    reg.sweep()
    reg.configure(config(pool("p", ["http://a:1", "http://b:1"])).pools)
    assert reg.pools["p"][1].id == "p/3"  # gone for good: a new worker, a new id


def test_pools_added_removed_and_discovered_workers_beside_static_ones() -> None:
    reg = WorkerRegistry(config(pool("p", ["http://a:1"])))
    discovering = pool("q", [], discover={"name": "q.k3.test", "port": 8000})
    reg.configure(config(pool("p", ["http://a:1"]), discovering).pools)
    assert reg.pools["q"] == [] and reg.candidates("q") == []
    reg.set_discovered("q", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    assert [w.url for w in reg.pools["q"]] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    reg.configure(config(discovering, pool("p", ["http://a:1"], max_in_flight=3)).pools)  # reordered, changed
    assert list(reg.pools) == ["q", "p"] and len(reg.pools["q"]) == 2  # discovered workers kept
    assert reg.gates["p"].total == 3
    reg.configure(config(pool("q", ["http://s:1"])).pools)  # p removed; q no longer discovers
    assert list(reg.pools) == ["q"] and [w.url for w in reg.pools["q"]] == ["http://s:1"]
    assert reg.candidates("p") == [] and reg.find("p", 0) is None
    assert reg.set_discovered("p", ["http://x:1"]) == []  # a late answer for a removed pool: ignored
    assert {w.url for w in reg.retiring} == {"http://a:1", "http://10.0.0.1:8000", "http://10.0.0.2:8000"}


def test_engine_kind_change_replaces_the_workers() -> None:
    reg = WorkerRegistry(config(pool("p", ["http://a:1"])))
    old = reg.pools["p"][0]
    reg.configure(config({**pool("p", ["http://a:1"]), "engine": "sglang"}).pools)
    assert reg.pools["p"][0] is not old and reg.pools["p"][0].engine.kind == "sglang"
    assert reg.retiring == [old]


def test_pool_policies_update_keeps_unchanged_policies() -> None:
    first = config(pool("p", ["http://a:1"], policy="round_robin"), pool("q", ["http://b:1"], policy="least_load"))
    policies = PoolPolicies(first)
    p, q = policies.policy("p"), policies.policy("q")
    policies.update(config(pool("p", ["http://c:1"], policy="round_robin"), pool("q", ["http://b:1"]),
                         pool("r", ["http://d:1"])).pools)
    assert policies.policy("p") is p  # same policy and params: its state (round-robin position) stays
    assert policies.policy("q") is not q and policies.policy("q").name == "ttft_cost"  # the default
    assert policies.policy("r").name == "ttft_cost"


def test_periodic_each_adds_and_removes_items_while_running() -> None:
    seen: list[str] = []

    async def round_fn(item: str) -> None:
        seen.append(item)

    async def run() -> None:
        loop = PeriodicEach("t", 60.0, ["a"], round_fn)
        loop.add("b")  # before start: only listed
        assert seen == []
        loop.start()
        await asyncio.sleep(0)
        loop.add("c")  # while running: its first round at once
        await asyncio.sleep(0)
        assert sorted(seen) == ["a", "b", "c"]
        loop.remove("a")
        assert loop.items == ["b", "c"]
        await loop.stop()

    asyncio.run(run())


@pytest.mark.parametrize(("pool_fields", "message"), [
    ({"workers": []}, "at least one worker URL, or `discover`"),
    ({"workers": [], "discover": {"name": "v.k3.test"}}, "record: a needs a port"),
    ({"workers": [], "discover": {"name": "_http._tcp.v", "record": "srv", "port": 80}}, "takes the port"),
    ({"workers": [], "discover": {"name": "bad name!", "port": 80}}, "pattern"),
])
def test_discover_rules(pool_fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config({**pool("p", []), **pool_fields})


def test_discovery_nameservers_are_addresses() -> None:
    with pytest.raises(ValidationError, match="a nameserver is an IP address"):
        parse_config({"pools": [pool("p", ["http://a:1"])], "discovery": {"nameservers": ["dns.local"]}}, environ={})
    ok = parse_config({"pools": [pool("p", [], discover={"name": "v", "port": 8000})],
                       "discovery": {"nameservers": ["127.0.0.1", "::1"], "port": 5353}}, environ={})
    assert ok.discovery.port == 5353 and ok.pools[0].workers == []
