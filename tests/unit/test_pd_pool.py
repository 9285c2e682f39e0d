"""Prefill/decode pools without a socket: their config and its errors, the roles the registry
gives their workers, per-role candidates and limits, the policy per role, and the
protocol helpers of the two-leg attempt (rooms, the vLLM prefill leg's body)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.backends.registry import WorkerRegistry
from gateway.config import GatewayConfig, load_config, parse_config
from gateway.config_base import explain_validation_error
from gateway.dispatch.kinds import AGGREGATED, Disaggregated, kind_of
from gateway.dispatch.steps import PoolStep, choose_pool
from gateway.observability.metrics import GatewayMetrics
from gateway.plans.safety import production_findings
from gateway.protocol.pd import MAX_ROOM, NIXL_PREFILL_PARAMS, sglang_fields, vllm_prefill_body
from gateway.routing.pool_policies import PoolPolicies
from gateway.routing.pools import serves
from gateway.streaming import Holding

PD = {"mode": "sglang", "prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998}, "http://p1:30000"],
      "decode": ["http://d0:30000", "http://d1:30000/"]}


def config(pd: dict[str, Any] | None = None, **pool: Any) -> GatewayConfig:
    pd = {**PD, "prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998},
                            {"url": "http://p1:30000", "bootstrap_port": 8998}], **(pd or {})}
    return parse_config({"pools": [
        {"name": "pd", "engine": "sglang", "max_context_tokens": 524288, "disaggregation": pd, **pool},
        {"name": "big", "engine": "vllm", "max_context_tokens": 1048576, "workers": ["http://big:1"]},
    ]}, environ={})


def error_of(pd: dict[str, Any] | None = None, **pool: Any) -> str:
    with pytest.raises(ValidationError) as info:
        config(pd, **pool)
    return explain_validation_error(info.value)


def test_pd_pool_config_and_its_defaults() -> None:
    pool = config().pools[0]
    assert pool.disaggregation is not None
    assert (pool.disaggregation.prefill_policy, pool.disaggregation.decode_policy) == ("prefix_affinity", "least_load")
    assert pool.pd_workers() == [("http://p0:30000", "prefill", 8998), ("http://p1:30000", "prefill", 8998),
                                 ("http://d0:30000", "decode", None), ("http://d1:30000", "decode", None)]
    assert isinstance(kind_of(pool), Disaggregated) and kind_of(config().pools[1]) is AGGREGATED


@pytest.mark.parametrize(("pd", "pool", "words"), [
    ({"prefill": ["http://p0:1"]}, {}, "mode sglang needs its bootstrap_port (the --disaggregation-bootstrap-port"),
    ({"mode": "vllm-mooncake", "prefill": ["http://p0:1"]}, {"engine": "vllm"}, "VLLM_MOONCAKE_BOOTSTRAP_PORT"),
    ({"mode": "vllm-nixl", "prefill": [{"url": "http://p0:1", "bootstrap_port": 1}]}, {"engine": "vllm"},
     "bootstrap_port is for modes sglang and vllm-mooncake"),
    ({"mode": "vllm-nixl", "prefill": ["http://p0:1"]}, {}, "mode vllm-nixl needs engine vllm or ascend, not sglang"),
    ({"decode": ["http://p0:30000"]}, {}, "either prefill or decode, not both"),
    ({"decode": []}, {}, "decode"),
    ({"decode_policy": "fastest"}, {}, "unknown decode_policy 'fastest'"),
    ({}, {"workers": ["http://w:1"]}, "leave `workers` and `discover` out"),
    ({}, {"policy": "round_robin"}, "set disaggregation.prefill_policy and disaggregation.decode_policy"),
    ({"mode": "dynamo"}, {}, "mode"),
])
def test_pd_config_errors_are_clear(pd: dict[str, Any], pool: dict[str, Any], words: str) -> None:
    assert words in error_of(pd, **pool)


def test_registry_roles_candidates_and_per_role_limits() -> None:
    cfg = config({"prefill_max_in_flight_per_worker": 1, "decode_max_in_flight_per_worker": 2})
    registry = WorkerRegistry(cfg)
    workers = registry.pools["pd"]
    assert [(w.id, w.role, w.bootstrap_port) for w in workers] == [
        ("pd/0", "prefill", 8998), ("pd/1", "prefill", 8998), ("pd/2", "decode", None), ("pd/3", "decode", None)]
    assert [w.id for w in registry.candidates("pd")] == ["pd/2", "pd/3"]
    assert [w.id for w in registry.candidates("pd", role="prefill")] == ["pd/0", "pd/1"]
    assert workers[0].snapshot()["role"] == "prefill"
    pools = list(cfg.pools)
    holding = Holding()
    metrics = GatewayMetrics()
    gate = registry.gates["pd"]
    for prefill in workers[:2]:  # both prefill workers full: no room in the pool though decode has some
        holding.lease(prefill, metrics, gate, counted=False)
    assert gate.in_flight == 0  # a prefill leg is not a request of the pool
    step, to, _ = choose_pool(registry, pools[0], pools, set())
    assert (step, to.name) == (PoolStep.SATURATED, "big")
    asyncio.run(holding.aclose())  # nothing opened: only the slots are released
    step, _, room = choose_pool(registry, pools[0], pools, set())
    assert step is PoolStep.ROUTE and [w.id for w in room] == ["pd/2", "pd/3"]
    for _ in range(2):
        holding.lease(workers[2], metrics, gate)
    step, _, room = choose_pool(registry, pools[0], pools, set())
    assert [w.id for w in room] == ["pd/3"] and gate.in_flight == 2


def test_pd_pool_without_a_prefill_candidate_is_unavailable() -> None:
    cfg = config()
    registry = WorkerRegistry(cfg)
    pools = list(cfg.pools)
    prefills = registry.candidates("pd", role="prefill")
    step, to, _ = choose_pool(registry, pools[0], pools, set(prefills))
    assert (step, to.name) == (PoolStep.UNAVAILABLE, "big")
    for worker in prefills:
        registry.connect_failed(worker, "refused")
    assert registry.unready_pools() == ["pd"]


def test_pool_policies_has_a_policy_per_role() -> None:
    policies = PoolPolicies(config({"prefill_policy": "round_robin", "decode_policy": "power_of_two"}))
    assert (policies.policy("pd").name, policies.policy("pd", "decode").name) == ("round_robin", "power_of_two")
    assert policies.policy("big").name == "ttft_cost"  # an aggregated pool's default


def test_sglang_rooms_and_the_vllm_prefill_leg() -> None:
    one = sglang_fields({"messages": []}, "p0", 8998)
    assert (one["bootstrap_host"], one["bootstrap_port"]) == ("p0", 8998) and 0 <= one["bootstrap_room"] <= MAX_ROOM
    assert len({sglang_fields({}, "p0", 1)["bootstrap_room"] for _ in range(50)}) == 50  # fresh every time
    batch = sglang_fields({"prompt": ["a", "b", "c"]}, "p0", 8998)
    assert batch["bootstrap_host"] == ["p0"] * 3 and len(set(batch["bootstrap_room"])) == 3
    assert isinstance(sglang_fields({"prompt": [1, 2, 3]}, "p0", 1)["bootstrap_room"], int)  # one token list
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50,
            "max_completion_tokens": 50, "min_tokens": 10}
    leg = vllm_prefill_body(body, dict(NIXL_PREFILL_PARAMS))
    assert leg == {"messages": [], "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                   "kv_transfer_params": NIXL_PREFILL_PARAMS}
    assert body["stream"] is True  # the original request is left as it was (the decode leg's)


def test_the_pd_example_config_loads() -> None:
    loaded = load_config(Path(__file__).parents[2] / "config" / "k3-pd.yaml", environ={})
    names = [(p.name, p.disaggregation.mode if p.disaggregation else None) for p in loaded.pools]
    assert names == [("vllm-128k", None), ("sglang-pd-512k", "sglang"), ("nvl72-1m", None)]


def test_a_reload_turns_an_aggregated_pool_into_a_pd_pool() -> None:
    before = parse_config({"pools": [{"name": "pd", "engine": "sglang", "max_context_tokens": 524288,
                                      "workers": ["http://p0:30000", "http://d0:30000"]}]}, environ={})
    registry, policies = WorkerRegistry(before), PoolPolicies(before)
    old = list(registry.pools["pd"])
    after = config()
    changes = registry.configure(after.pools)
    policies.update(after.pools)
    assert "pool pd changed" in changes
    assert [(w.url, w.role) for w in registry.pools["pd"]] == [
        ("http://p0:30000", "prefill"), ("http://p1:30000", "prefill"), ("http://d0:30000", "decode"),
        ("http://d1:30000", "decode")]
    assert all(w.retired for w in old)  # same URLs in a new role are new workers; the old ones finish
    assert policies.policy("pd", "decode").name == "least_load"


def test_pd_pools_serve_chat_and_completions_only() -> None:
    cfg = config()
    pd = cfg.pools[0]
    assert [serves(pd, api) for api in ("chat", "completions", "messages", "count_tokens", "responses")] == [
        True, True, False, False, False]
    assert serves(cfg.pools[1], "messages")
    assert "a PD pool serves only chat and completions" in error_of(apis=["chat", "messages"])


def test_strict_check_finds_placeholder_hosts_among_pd_workers() -> None:
    cfg = config({"decode": ["http://decode-0.example.com:30000", "http://d1:30000"]})
    paths = [f.path for f in production_findings({}, cfg, {})]
    assert "pools.0.disaggregation.decode.0" in paths
    assert not [p for p in paths if "prefill" in p]
