"""K3 plans (config/plans/): the guide's memory arithmetic, refusals, pools derived from plans, and the
engine launch scripts in deploy/engines/ (no drift; max model length and served name agree with the pools)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import main
from gateway.config import ConfigError, load_config
from gateway.plans.capacity import GB, plan_capacity
from gateway.plans.emit import emit_scripts, render_script
from gateway.plans.models import LoadedPlan, PlanError, load_model_card, load_plan
from tests.support import REPO_ROOT

CONFIG = REPO_ROOT / "config"
PRODUCTION = CONFIG / "k3-production.yaml"
ENGINES = REPO_ROOT / "deploy" / "engines"
KEYS = {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64}


def plan(name: str) -> LoadedPlan:
    return load_plan(CONFIG / "plans" / f"{name}.yaml")


def copy_config(tmp_path: Path) -> Path:
    """A writable copy of config/ (production file, plans, model card); returns the production file's copy."""
    shutil.copytree(CONFIG, tmp_path / "config")
    return tmp_path / "config" / "k3-production.yaml"


def edit_yaml(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


# --- the guide's arithmetic -------------------------------------------------------------------

def test_plan_a_fits_mxfp4_with_thin_headroom() -> None:
    report = plan_capacity(plan("plan-a"))
    assert report.memory_bytes == pytest.approx(1536 * GB)
    assert report.weight_bytes == pytest.approx(1400 * GB)
    assert report.memory_bytes >= report.weight_bytes
    assert report.usable_bytes == pytest.approx(1536 * 0.95 * GB)
    assert report.headroom_bytes == pytest.approx(59.2 * GB)
    assert report.headroom_thin
    assert report.fits and report.refusal is None
    assert report.max_context_tokens == 131072 and report.max_context_sequences >= 1


def test_plan_b_has_2304_gb_and_fits_mxfp4_but_not_bf16() -> None:
    report = plan_capacity(plan("plan-b"))
    assert report.memory_bytes == pytest.approx(2304 * GB)
    assert report.fits and not report.headroom_thin
    assert report.max_context_tokens == 524288 and report.max_context_sequences >= 1
    bf16 = plan_capacity(plan("plan-b"), "bf16")
    assert bf16.weight_bytes == pytest.approx(5600 * GB)
    assert not bf16.fits and "5,600 GB" in bf16.refusal and "2,304 GB" in bf16.refusal


def test_bf16_needs_the_rack() -> None:
    """5.6 TB of BF16 weights fit only Plan C's 72 GPUs; every other plan refuses them."""
    rack = plan_capacity(plan("plan-c"))
    assert (rack.precision, rack.devices) == ("bf16", 72)
    assert rack.weight_bytes == pytest.approx(5600 * GB)
    assert rack.fits and rack.memory_bytes == pytest.approx(72 * 186 * GB)
    assert rack.max_context_tokens == 1048576 and rack.max_context_sequences >= 1
    for name in ("plan-a", "plan-b", "ascend"):
        assert not plan_capacity(plan(name), "bf16").fits, name
    assert [(p.precision, p.fits) for p in plan_capacity(plan("plan-a")).precisions] == [
        ("bf16", False), ("mxfp8", False), ("mxfp4", True)]


def test_trimming_context_from_1m_to_128k_cuts_kv_to_an_eighth(tmp_path: Path) -> None:
    copy_config(tmp_path)
    short = tmp_path / "config" / "plans" / "plan-c.yaml"
    edit_yaml(short, lambda d: d.update(max_context_tokens=131072))
    long, trimmed = plan_capacity(plan("plan-c")), plan_capacity(load_plan(short))
    kv = [r.sequence_bytes_per_device - r.state_bytes_per_sequence_per_device for r in (long, trimmed)]
    assert kv[0] / kv[1] == pytest.approx(8.0)
    assert trimmed.max_context_sequences > 7 * long.max_context_sequences


def test_cli_refuses_bf16_on_plan_a_with_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(CONFIG / "plans" / "plan-a.yaml"), "--precision", "bf16"])
    assert info.value.code == 1
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "bf16 weights need 5,600 GB" in out
    assert "8 x B300 hold 1,536 GB, 1,459.2 GB usable at 0.95: 4,140.8 GB short" in out
    assert "plan plan-a refused" in err


def test_a_plan_file_with_bf16_is_refused_and_emits_nothing(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: d["engine"].update(precision="bf16"))
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path), "--emit", str(tmp_path / "out")])
    assert info.value.code == 1
    assert not (tmp_path / "out").exists()


def test_weights_that_fit_but_leave_no_room_for_one_sequence_are_refused(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: d.update(max_context_tokens=1048576))
    report = plan_capacity(load_plan(path))
    assert report.weight_bytes <= report.usable_bytes
    assert not report.fits and "holds no 1,048,576-token sequence" in report.refusal


def test_assumptions_are_labelled_with_their_sources(capsys: pytest.CaptureFixture[str]) -> None:
    card = load_model_card(CONFIG / "models" / "kimi-k3.yaml")
    names = list(type(card.assumptions).model_fields)
    for name in names:
        assert getattr(card.assumptions, name).source.startswith("assumption:"), name
    with pytest.raises(SystemExit) as info:
        main(["plan", str(PRODUCTION)])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("[assumption]") == 2 * 4  # reserve and per-sequence lines of four plans
    for name in names:
        assert f"  {name} = " in out
    with pytest.raises(SystemExit):
        main(["plan", str(PRODUCTION), "--json"])
    reports = json.loads(capsys.readouterr().out)
    assert [r["pool"] for r in reports] == ["vllm-128k", "ascend-128k", "sglang-512k", "nvl72-1m"]
    assert all(r["fits"] for r in reports)
    assert {a["name"] for a in reports[0]["assumptions"]} == set(names)


def test_parallel_sizes_must_multiply_to_the_devices(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-c.yaml"
    edit_yaml(path, lambda d: d["parallelism"].update(data=1))
    with pytest.raises(PlanError, match=r"tensor 8 x pipeline 3 x data 1 = 24, but the hardware has 72 devices"):
        load_plan(path)


@pytest.mark.parametrize(("name", "expert"), [("plan-a", 3), ("plan-a", 4), ("plan-c", 24), ("ascend", 8)])
def test_a_vllm_expert_size_other_than_all_devices_is_refused(tmp_path: Path, name: str, expert: int) -> None:
    # vLLM's --enable-expert-parallel takes no size (EP = TP x DP in each pipeline stage, so the
    # experts spread over every device): a plan saying EP 3 would report what the engine never runs.
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / f"{name}.yaml"
    edit_yaml(path, lambda d: d["parallelism"].update(expert=expert))
    with pytest.raises(PlanError, match=rf"parallelism.expert {expert}: .*1 or all \d+ devices"):
        load_plan(path)
    edit_yaml(path, lambda d: d["parallelism"].update(expert=1))
    assert "--enable-expert-parallel" not in render_script(load_plan(path))


# --- pools derived from plans -----------------------------------------------------------------

def test_production_pools_come_from_the_plans() -> None:
    config = load_config(PRODUCTION, environ=KEYS)
    names = ["plan-a", "ascend", "plan-b", "plan-c"]
    assert [p.name for p in config.pools] == [plan(n).plan.pool.name for n in names]
    for pool, name in zip(config.pools, names, strict=True):
        p = plan(name).plan
        assert (pool.engine, pool.max_context_tokens, pool.served_model_name) == (
            p.engine.kind, p.max_context_tokens, p.engine.served_model_name)
        assert len(pool.workers) == p.replicas
        assert {urlsplit(w).port for w in pool.workers} == {p.engine.port}
    assert "max_context_tokens" not in PRODUCTION.read_text()  # typed once, in the plans


def test_a_pool_naming_a_plan_may_not_repeat_what_the_plan_decides(tmp_path: Path) -> None:
    path = copy_config(tmp_path)
    edit_yaml(path, lambda d: d["pools"][0].update(max_context_tokens=524288))
    with pytest.raises(ConfigError, match=r"pools.0: max_context_tokens come\(s\) from the plan plans/plan-a.yaml"):
        load_config(path, environ=KEYS)
    edit_yaml(path, lambda d: d["pools"][0].pop("max_context_tokens") and d["pools"][0].update(policy="least_load"))
    assert load_config(path, environ=KEYS).pools[0].policy == "least_load"


def test_worker_urls_and_engine_keys_come_from_the_plans_variables() -> None:
    env = {**KEYS, "VLLM_128K_WORKER_1": "http://10.0.0.7:8000", "VLLM_API_KEY": "engine-secret"}
    pool = load_config(PRODUCTION, environ=env).pools[0]
    assert pool.workers == ["http://vllm-128k-0:8000", "http://10.0.0.7:8000"]
    assert pool.api_key is not None and pool.api_key.get_secret_value() == "engine-secret"


# --- engine launch scripts --------------------------------------------------------------------

def test_emitted_scripts_match_the_checked_in_ones(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(PRODUCTION), "--emit", str(tmp_path)])
    assert info.value.code == 0
    emitted = {p.name: p.read_text() for p in tmp_path.glob("*.sh")}
    checked_in = {p.name: p.read_text() for p in ENGINES.glob("*.sh")}
    assert sorted(emitted) == sorted(checked_in) == [
        "ascend-128k.sh", "nvl72-1m.sh", "sglang-512k.sh", "vllm-128k.sh"]
    for name, text in emitted.items():
        assert text == checked_in[name], f"deploy/engines/{name} drifted from its plan: emit again"


def test_a_changed_plan_is_drift(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: d.update(max_context_tokens=65536))
    (script,) = emit_scripts([load_plan(path)], tmp_path / "out")
    assert script.read_text() != (ENGINES / "vllm-128k.sh").read_text()
    assert "--max-model-len 65536" in script.read_text()


def _flag(text: str, *names: str) -> str:
    alternatives = "|".join(map(re.escape, names))
    values = [m.group(2) for m in re.finditer(rf"(?m)^\s+({alternatives}) (\S+)", text)]
    assert len(values) == 1, (names, values)
    return values[0].strip('"')


def test_scripts_agree_with_the_gateway_pools() -> None:
    config = load_config(PRODUCTION, environ=KEYS)
    for pool in config.pools:
        text = (ENGINES / f"{pool.name}.sh").read_text()
        assert int(_flag(text, "--max-model-len", "--context-length")) == pool.max_context_tokens, pool.name
        assert _flag(text, "--served-model-name") == pool.served_model_name, pool.name
        assert int(_flag(text, "--port")) == urlsplit(pool.workers[0]).port, pool.name
        key_var = _flag(text, "--api-key").lstrip("$")
        assert f"${{{key_var}:-}}" in str(plan_pool(pool.name)["api_key"]), pool.name


def plan_pool(pool_name: str) -> dict[str, object]:
    """The gateway pool entry of the plan that defines `pool_name`."""
    for name in ("plan-a", "plan-b", "plan-c", "ascend"):
        if plan(name).plan.pool.name == pool_name:
            return plan(name).plan.gateway_pool()
    raise KeyError(pool_name)


@pytest.mark.parametrize("name", ["plan-a", "plan-b", "plan-c", "ascend"])
def test_script_flags_follow_the_plan(name: str) -> None:
    loaded = plan(name)
    p, text = loaded.plan, render_script(loaded)
    if p.engine.kind == "sglang":
        assert "exec python3 -m sglang.launch_server" in text
        assert int(_flag(text, "--tp-size")) == p.parallelism.tensor
        assert int(_flag(text, "--ep-size")) == p.parallelism.expert
        assert float(_flag(text, "--mem-fraction-static")) == p.engine.memory_utilization
        assert int(_flag(text, "--nnodes")) == p.hardware.nodes
    else:
        assert 'exec vllm serve "${MODEL_PATH:-moonshotai/Kimi-K3}"' in text
        assert int(_flag(text, "--tensor-parallel-size")) == p.parallelism.tensor
        assert ("--enable-expert-parallel" in text) == (p.parallelism.expert > 1)
        assert float(_flag(text, "--gpu-memory-utilization")) == p.engine.memory_utilization
        assert ("--enable-chunked-prefill" in text) == p.engine.chunked_prefill
        assert ("--pipeline-parallel-size 3" in text) == (p.parallelism.pipeline == 3)
    if p.engine.precision == "bf16":
        assert "--dtype bfloat16" in text and "--quantization" not in text
    else:
        assert _flag(text, "--quantization") == p.engine.quantization_flag()


def test_scripts_are_valid_bash_and_refuse_a_missing_key(tmp_path: Path) -> None:
    for script in sorted(ENGINES.glob("*.sh")):
        assert script.stat().st_mode & 0o111, script.name
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, script.name + check.stderr
    # Without its key the script stops before starting anything (no engine binary is needed to see it).
    run = subprocess.run(["bash", str(ENGINES / "vllm-128k.sh")], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "set VLLM_API_KEY" in run.stderr


def test_readme_shows_the_planners_current_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", str(PRODUCTION)])
    out = capsys.readouterr().out.rstrip()
    assert f"```\n{out}\n```" in (REPO_ROOT / "README.md").read_text(), "README: paste `kimi-gateway plan` again"


def test_an_emit_directory_that_cannot_be_written_is_a_clean_error(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "engines"
    blocker.write_text("a file where the directory should be")
    for out in (blocker, blocker / "sub"):
        with pytest.raises(SystemExit) as info:
            main(["plan", str(CONFIG / "plans" / "plan-a.yaml"), "--emit", str(out)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"plan error: cannot write the launch scripts to {out}:" in err and "Traceback" not in err
