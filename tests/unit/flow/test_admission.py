"""Flows and bands of requests (gateway/flow/admission.py `FlowControl.flow_of`)."""

from __future__ import annotations

from typing import Any

from gateway.auth.keys import KeyRing, hash_key
from gateway.backends.registry import WorkerRegistry
from gateway.config import GatewayConfig, parse_config
from gateway.flow.admission import ANONYMOUS, Flow, FlowControl
from gateway.observability.metrics import GatewayMetrics


def config(**flow: Any) -> GatewayConfig:
    keys = [{"name": "alice", "sha256": hash_key("a" * 40)},
            {"name": "bob", "sha256": hash_key("b" * 40), "priority": 1, "max_priority": 3, "flow": "team"},
            {"name": "bob2", "sha256": hash_key("c" * 40), "flow": "team", "priority": -2, "client_priority": True}]
    return parse_config({"pools": [{"name": "p", "engine": "vllm", "workers": ["http://w:1"],
                                    "max_context_tokens": 1000, "flow_control": {"enabled": True}}],
                         "auth": {"enabled": True, "keys": keys}, "flow_control": flow})


def flows(cfg: GatewayConfig) -> tuple[FlowControl, KeyRing]:
    return FlowControl(WorkerRegistry(cfg), GatewayMetrics()), KeyRing(cfg.auth.keys)


def test_the_tenant_is_the_keys_flow_or_its_name_and_the_band_its_priority() -> None:
    cfg = config()
    control, ring = flows(cfg)
    alice, bob, bob2 = (ring.lookup(k * 40) for k in "abc")
    assert control.flow_of(cfg, alice, {}) == Flow("alice", "", 0, False)
    assert control.flow_of(cfg, bob, {}) == Flow("team", "", 1, False)
    assert control.flow_of(cfg, bob2, {}) == Flow("team", "", -2, True)
    assert control.flow_of(cfg, None, {"x-kimi-priority": "9"}) == Flow(ANONYMOUS, "", 0, True)


def test_the_priority_header_is_capped_at_the_keys_max_and_may_lower_it() -> None:
    cfg = config()
    control, ring = flows(cfg)
    alice, bob = ring.lookup("a" * 40), ring.lookup("b" * 40)
    assert control.flow_of(cfg, alice, {"x-kimi-priority": "5"}).band == 0
    assert control.flow_of(cfg, alice, {"x-kimi-priority": "-4"}).band == -4
    assert control.flow_of(cfg, alice, {"x-kimi-priority": "-400"}).band == -10
    assert control.flow_of(cfg, bob, {"x-kimi-priority": " 2 "}).band == 2
    assert control.flow_of(cfg, bob, {"x-kimi-priority": "7"}).band == 3
    assert control.flow_of(cfg, bob, {"x-kimi-priority": "high"}).band == 1  # not an integer: ignored


def test_the_sub_flow_header_names_a_sub_flow_within_the_tenant() -> None:
    cfg = config(flow_header="X-End-User", priority_header=None)
    control, ring = flows(cfg)
    bob = ring.lookup("b" * 40)
    flow = control.flow_of(cfg, bob, {"x-end-user": "u" * 500, "x-kimi-priority": "3"})
    assert flow.tenant == "team" and flow.sub == "u" * 128 and flow.band == 1  # no priority header configured
    assert control.flow_of(cfg, bob, {}).sub == ""


def test_a_keys_max_priority_is_not_below_its_priority() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_priority"):
        parse_config({"pools": [{"name": "p", "engine": "vllm", "workers": ["http://w:1"], "max_context_tokens": 9}],
                      "auth": {"keys": [{"name": "k", "sha256": hash_key("k" * 40), "priority": 2,
                                         "max_priority": 1}]}})
