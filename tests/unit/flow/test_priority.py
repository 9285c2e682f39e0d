"""The engines' `priority` under the gateway's control (gateway/flow/priority.py): the band in
each engine's terms, the body edits (a parsed body and one from a parse process), and the engine
launch flags a plan's pool with `flow_control.engine_priority` gets."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import yaml

from gateway.config import parse_config
from gateway.flow.priority import client_value, engine_value, launch_flags, with_priority, without_scheduling_fields
from gateway.parsing import ForwardBody, encode_for
from gateway.plans.emit import render_script
from gateway.plans.models import PlanError, expand_plan_refs, load_plan
from tests.support import REPO_ROOT


def test_vllm_serves_lower_values_first_sglang_higher() -> None:
    assert [engine_value("vllm", b) for b in (-2, 0, 3)] == [2, 0, -3]
    assert engine_value("ascend", 1) == -1
    assert [engine_value("sglang", b) for b in (-2, 0, 3)] == [-2, 0, 3]
    assert launch_flags("vllm") == ("--scheduling-policy priority",)
    assert launch_flags("sglang") == ("--enable-priority-scheduling",)
    assert launch_flags("llamacpp") == ()


@pytest.mark.parametrize("offloaded", [False, True])
def test_the_clients_priority_is_stripped_or_replaced(offloaded: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": -7, "top_k": 3}
    payload = ForwardBody.of(body, "served", False) if offloaded else body
    assert client_value(payload) == -7
    stripped = with_priority(payload, None)
    assert client_value(stripped) is None
    assert "priority" not in orjson.loads(encode_for(stripped, "served", False))
    assert without_scheduling_fields(payload) is not payload
    bare = without_scheduling_fields({**body, "disagg_prefill_dp_rank": 1} if not offloaded else payload)
    assert not {"priority", "disagg_prefill_dp_rank"} & set(orjson.loads(encode_for(bare, "served", False)))
    assert without_scheduling_fields(stripped) is stripped  # nothing to strip: the same payload
    set_ = with_priority(stripped, 4)
    sent = orjson.loads(encode_for(set_, "served", False))
    assert sent["priority"] == 4 and sent["top_k"] == 3 and sent["model"] == "served"


def plan_copy(tmp_path: Path, name: str, flow: dict[str, object] | None) -> Path:
    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "plans" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    if flow is not None:
        data["pool"]["flow_control"] = flow
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(("name", "flag"), [("plan-a", "--scheduling-policy priority"),
                                            ("plan-b", "--enable-priority-scheduling")])
def test_a_pool_with_engine_priority_launches_its_engines_with_priority_scheduling(
        tmp_path: Path, name: str, flag: str) -> None:
    assert flag not in render_script(load_plan(REPO_ROOT / "config" / "plans" / f"{name}.yaml"))
    loaded = load_plan(plan_copy(tmp_path, name, {"enabled": True, "engine_priority": True}))
    assert flag in render_script(loaded)
    pool = loaded.plan.gateway_pool()
    assert pool["flow_control"] == {"enabled": True, "engine_priority": True}
    config = parse_config(expand_plan_refs({"pools": [{"plan": f"plans/{name}.yaml"}]}, tmp_path / "config"),
                          {"VLLM_API_KEY": "k", "SGLANG_API_KEY": "k"})
    assert config.pools[0].flow_control.engine_priority


def test_engine_priority_is_set_in_the_plan_not_beside_it(tmp_path: Path) -> None:
    """The launch flags follow the plan: a config entry may not turn engine priority on beside it."""
    plan_copy(tmp_path, "plan-a", None)
    base = tmp_path / "config"
    with pytest.raises(PlanError, match="flow_control comes from the plan"):
        expand_plan_refs({"pools": [{"plan": "plans/plan-a.yaml", "flow_control": {"engine_priority": True}}]}, base)
    expanded = expand_plan_refs({"pools": [{"plan": "plans/plan-a.yaml", "flow_control": {"enabled": True}}]}, base)
    assert expanded["pools"][0]["flow_control"] == {"enabled": True}
