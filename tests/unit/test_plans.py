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
from gateway.plans.capacity import GB, CapacityReport, plan_capacity
from gateway.plans.emit import emit_scripts, render_script
from gateway.plans.models import LoadedPlan, PlanError, Precision, load_model_card, load_plan
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


# --- the corrected arithmetic ------------------------------------------------------------------
# MXFP4 is applied to the MoE experts only (vLLM mxfp4.py: LinearBase -> UnquantizedLinearMethod;
# SGLang server_args.py: "mxfp4",  # MOE-only), with one uint8 scale per 32 values; the dense part
# derived from the guide's totals stays BF16.

EXPERT_B = (2800e9 - 104e9) * 896 / 880          # 2,745.0B, derived
DENSE_B = 2800e9 - EXPERT_B                        # 55.0B
MXFP4_WEIGHTS = EXPERT_B * (0.5 + 1 / 32) + DENSE_B * 2   # 1,568.25 GB
# Of the dense part, the router gates and latent-MoE projections are whole on every TP rank (assumed):
# 63 MoE layers x (2 x 7,168 x 3,584 + 7,168 x 896).
REPLICATED = 63 * (2 * 7168 * 3584 + 7168 * 896)   # 3,641.6M


def dense_per_device(tensor: int) -> float:
    """BF16 bytes of the dense part on one TP rank of a one-stage layout."""
    return (DENSE_B - REPLICATED) * 2 / tensor + REPLICATED * 2


def guide_figure(tmp_path: Path, name: str, gb: float) -> LoadedPlan:
    """A copy of plan `name` at the guide's memory per device (`gb`)."""
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / f"{name}.yaml"
    edit_yaml(path, lambda d: d["hardware"].update(memory_per_device_gb=gb))
    return load_plan(path)


def test_weights_count_the_bf16_dense_part_and_the_block_scales() -> None:
    card = load_model_card(CONFIG / "models" / "kimi-k3.yaml")
    assert card.parameter_split.expert == pytest.approx(EXPERT_B, abs=1)
    assert card.parameter_split.dense == pytest.approx(DENSE_B, abs=1)
    assert card.parameter_split.source.startswith("derived")
    mxfp4 = card.precisions["mxfp4"].source
    assert "MOE-only" in mxfp4 and "UnquantizedLinearMethod" in mxfp4
    report = plan_capacity(plan("plan-a"))
    assert report.expert_weight_bytes == pytest.approx(EXPERT_B * 0.53125)
    assert report.dense_weight_bytes == pytest.approx(DENSE_B * 2)
    assert report.weight_bytes == pytest.approx(MXFP4_WEIGHTS)
    assert report.weight_bytes / GB == pytest.approx(1568.25, abs=0.01)
    assert report.scale_bytes_per_param == 1 / 32
    assert plan_capacity(plan("plan-a"), "bf16").weight_bytes == pytest.approx(5600 * GB)


def test_plan_a_at_the_guides_192_gb_is_short_and_fits_at_nvidias_288(tmp_path: Path) -> None:
    report = plan_capacity(guide_figure(tmp_path, "plan-a", 192))
    assert not report.fits and report.memory_bytes == pytest.approx(1536 * GB)
    assert report.weight_bytes > report.memory_bytes  # 1,568 GB of weights on 1,536 GB of HBM
    # Resident: 1,568.3 GB once, plus 7 more copies of the 7.3 GB replicated on every TP rank.
    assert report.resident_weight_bytes == pytest.approx(MXFP4_WEIGHTS + 7 * REPLICATED * 2)
    assert ("mxfp4 weights need 1,619.2 GB on the devices (1,568.3 GB once" in report.refusal
            and "3.6B of them whole on every TP rank" in report.refusal
            and "8 x B300 hold 1,536 GB, 1,459.2 GB usable at 0.95: 160.0 GB short" in report.refusal)
    assert any("192 GB per B300 disagrees with the vendor's 288 GB" in w and "docs.nvidia.com" in w
               for w in report.warnings)
    vendor = report.at_vendor_figure
    assert vendor is not None and vendor.fits and vendor.memory_per_device_bytes == 288 * GB
    assert vendor.max_context_sequences >= 20 and vendor.at_vendor_figure is None
    shipped = plan_capacity(plan("plan-a"))  # the plan file carries NVIDIA's figure
    assert shipped.fits and shipped.at_vendor_figure is None and not shipped.warnings
    assert shipped.max_context_sequences == vendor.max_context_sequences


def test_plan_b_at_the_guides_144_gb_holds_no_512k_sequence_and_two_at_nvidias_180_gb(tmp_path: Path) -> None:
    report = plan_capacity(guide_figure(tmp_path, "plan-b", 144))
    assert report.memory_bytes == pytest.approx(2304 * GB)
    assert not report.fits and "holds no 524,288-token sequence" in report.refusal
    vendor = report.at_vendor_figure
    assert vendor is not None and vendor.fits and vendor.memory_bytes == pytest.approx(2880 * GB)
    assert vendor.max_context_sequences == 2
    assert plan_capacity(plan("plan-b")).max_context_sequences == vendor.max_context_sequences


def test_plan_c_serves_its_mxfp4_checkpoint_and_bf16_is_a_what_if() -> None:
    rack = plan_capacity(plan("plan-c"))
    assert (rack.precision, rack.checkpoint_precision, rack.devices) == ("mxfp4", "mxfp4", 72)
    assert rack.fits and rack.memory_bytes == pytest.approx(72 * 186 * GB) and rack.at_vendor_figure is None
    assert rack.max_context_tokens == 1048576 and rack.max_context_sequences >= 1
    # vLLM's EP group is TP x DP = 24 per pipeline stage: 896 experts split 38/37, the fullest counted.
    assert (rack.expert_parallel_size, rack.experts_per_device, rack.stage_layers) == (24, 38, 22)
    bf16 = plan_capacity(plan("plan-c"), "bf16")
    assert bf16.fits and bf16.weight_bytes == pytest.approx(5600 * GB)
    assert any("what-if only: moonshotai/Kimi-K3 holds mxfp4" in w for w in bf16.warnings)
    for name in ("plan-a", "plan-b", "ascend"):
        assert not plan_capacity(plan(name), "bf16").fits, name
    assert [(p.precision, p.fits) for p in plan_capacity(plan("plan-a")).precisions] == [
        ("bf16", False), ("mxfp8", False), ("mxfp4", True)]


def test_without_expert_parallelism_vllm_shards_the_experts_over_tp_x_dp(tmp_path: Path) -> None:
    # vLLM's FusedMoEParallelConfig.make flattens TP across DP for the MoE layers; the dense part is
    # only TP-sharded (each DP rank keeps its own copy). Plan C: 24 ranks per stage, 22 of 64 layers.
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-c.yaml"
    edit_yaml(path, lambda d: d["parallelism"].update(expert=1))
    report = plan_capacity(load_plan(path))
    assert report.expert_parallel_size == 1 and "--enable-expert-parallel" not in render_script(load_plan(path))
    expected = (EXPERT_B * 0.53125 / 24 + dense_per_device(8)) * 22 / 64
    assert report.weights_per_device_bytes == pytest.approx(expected)


def test_k3_has_96_kda_and_attention_heads_and_the_state_follows_them() -> None:
    """vLLM 0.33's K3 code: 96 KDA heads (not K2's 64); the state per sequence is 48 KDA layers x 96
    heads x 128 x 128 FP32, split over the TP ranks."""
    card = load_model_card(CONFIG / "models" / "kimi-k3.yaml")
    a = card.assumptions
    assert (a.kda_heads.value, a.attention_heads.value) == (96, 96)
    assert a.state_bytes_per_sequence.value == 48 * a.kda_heads.value * 128 * 128 * 4
    report = plan_capacity(plan("plan-b"))
    assert report.state_bytes_per_sequence_per_device == pytest.approx(48 * 96 * 128 * 128 * 4 / 16)


def test_replicated_router_gates_and_latent_projections_are_on_every_tp_rank() -> None:
    """Router gates and the latent-MoE projections are not split by TP: every rank holds them whole."""
    card = load_model_card(CONFIG / "models" / "kimi-k3.yaml")
    assert card.assumptions.replicated_parameters.value == REPLICATED
    report = plan_capacity(plan("plan-a"))  # TP 8, EP 8: 112 of 896 experts per device
    assert report.weights_per_device_bytes == pytest.approx(EXPERT_B * 0.53125 / 8 + dense_per_device(8))
    assert report.replicated_weight_bytes_per_device == pytest.approx(REPLICATED * 2)
    assert report.weights_per_device_bytes - (EXPERT_B * 0.53125 + DENSE_B * 2) / 8 == pytest.approx(
        REPLICATED * 2 * 7 / 8)  # what counting them as TP-split missed, per device


def test_sglang_splits_the_budget_between_linear_attention_state_and_mla_kv(tmp_path: Path) -> None:
    """SGLang (model_runner_kv_cache_mixin.py) gives the state pool ratio / (1 + ratio) of the memory
    left after weights (ratio 0.9 by default); MLA KV gets the rest. Plan B: 2 sequences of 512K,
    where one shared pool (vLLM's way) would hold 5."""
    report = plan_capacity(plan("plan-b"))
    room = report.kv_budget_per_device_bytes
    state, per_token = report.state_bytes_per_sequence_per_device, report.kv_bytes_per_token_per_device
    share = 0.9 / 1.9
    assert report.state_pool_share == pytest.approx(share)
    states = int(room * share // state)
    assert report.state_pool_sequences == states
    kv_sequences = int((room - states * state) // (524288 * per_token))
    assert report.max_context_sequences == min(states, kv_sequences) == 2
    assert int(room // (524288 * per_token + state)) == 5  # one pool: the 5 reported before
    assert plan_capacity(plan("plan-a")).state_pool_share is None  # vLLM: one pool
    # A plan may set SGLang's ratio: less for the state, more KV.
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-b.yaml"
    edit_yaml(path, lambda d: d["engine"].update(extra_args=["--mamba-full-memory-ratio=0.05"]))
    small = plan_capacity(load_plan(path))
    assert small.state_pool_share == pytest.approx(0.05 / 1.05) and small.max_context_sequences == 4
    assert "--mamba-full-memory-ratio=0.05" in render_script(load_plan(path))


def test_plan_c_is_reported_in_both_layouts_of_its_72_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's EP group is TP x DP per pipeline stage: TP 8 x PP 3 x DP 3 gives EP 24 (38 experts on the
    fullest GPU, 22 layers); the same rack as TP 8 x DP 9 without PP gives EP 72 (13 experts, 64 layers)."""
    rack = plan_capacity(plan("plan-c"))
    planned, flat = rack.layouts
    assert planned.planned and (planned.tensor, planned.pipeline, planned.data) == (8, 3, 3)
    assert (planned.expert_parallel_size, planned.experts_per_device, planned.stage_layers) == (24, 38, 22)
    assert planned.max_context_sequences == rack.max_context_sequences
    assert not flat.planned and (flat.tensor, flat.pipeline, flat.data) == (8, 1, 9)
    assert (flat.expert_parallel_size, flat.experts_per_device, flat.stage_layers) == (72, 13, 64)
    assert flat.weights_per_device_bytes == pytest.approx(EXPERT_B * 0.53125 * 13 / 896 + dense_per_device(8))
    assert flat.fits and flat.max_context_sequences >= 1
    for name in ("plan-a", "plan-b", "ascend"):
        assert plan_capacity(plan(name)).layouts == [], name
    with pytest.raises(SystemExit):
        main(["plan", str(CONFIG / "plans" / "plan-c.yaml")])
    out = capsys.readouterr().out
    assert "  layout       TP 8 x PP 3 x DP 3: EP 24 per stage, 38 experts x 22 layers per device" in out
    assert "  or layout    TP 8 x PP 1 x DP 9: EP 72, 13 experts x 64 layers per device" in out


def test_an_unlisted_accelerator_is_flagged_unchecked() -> None:
    report = plan_capacity(plan("ascend"))
    assert report.vendor_memory_per_device_bytes is None and report.at_vendor_figure is None
    assert any("no vendor figure for Ascend 950" in w for w in report.warnings)


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
    assert "REFUSED" in out and "bf16 weights need 5,651 GB on the devices (5,600 GB once" in out
    assert "8 x B300 hold 2,304 GB, 2,188.8 GB usable at 0.95: 3,462.2 GB short" in out
    assert "what-if only" in out and "plan plan-a refused" in err


def test_weights_that_fit_but_leave_no_room_for_one_sequence_are_refused(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: (d.update(max_context_tokens=1048576), d["hardware"].update(memory_per_device_gb=215)))
    report = plan_capacity(load_plan(path))
    assert report.weights_per_device_bytes <= report.usable_bytes / report.devices
    assert not report.fits and "holds no 1,048,576-token sequence" in report.refusal


def test_cli_and_json_show_the_new_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    guide_figure(tmp_path, "plan-a", 192)
    with pytest.raises(SystemExit) as info:
        main(["plan", str(tmp_path / "config" / "plans" / "plan-a.yaml")])
    assert info.value.code == 1
    out = capsys.readouterr().out
    for line in ("  checkpoint   moonshotai/Kimi-K3 (mxfp4); serving mxfp4",
                 "  parameters   2.8T = 2,745.0B experts + 55.0B dense [derived]",
                 "  weights      experts 2,745.0B x 0.5 + scales 0.03125 bytes = 1,458.3 GB; dense 55.0B x 2 bytes "
                 "= 110 GB; total 1,568.3 GB (mxfp4)",
                 "  WARNING      the plan's 192 GB per B300 disagrees with the vendor's 288 GB",
                 "  at vendor's  8 x 288 GB = 2,304 GB: fits 27 sequence(s) of 131,072 tokens"):
        assert line in out, line
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path / "config" / "plans" / "plan-a.yaml"), "--json"])
    (report,) = json.loads(capsys.readouterr().out)
    assert report["expert_weight_bytes"] == pytest.approx(EXPERT_B * 0.53125)
    assert report["dense_weight_bytes"] == pytest.approx(DENSE_B * 2)
    assert (report["checkpoint"], report["checkpoint_precision"]) == ("moonshotai/Kimi-K3", "mxfp4")
    assert report["vendor_memory_per_device_bytes"] == 288 * GB and report["fits"] is False
    assert report["at_vendor_figure"]["fits"] is True and report["at_vendor_figure"]["max_context_sequences"] == 27
    assert any("disagrees" in w for w in report["warnings"])


def test_assumptions_are_labelled_with_their_sources(capsys: pytest.CaptureFixture[str]) -> None:
    card = load_model_card(CONFIG / "models" / "kimi-k3.yaml")
    names = list(type(card.assumptions).model_fields)
    for name in names:
        assert getattr(card.assumptions, name).source.startswith("assumption:"), name
    with pytest.raises(SystemExit) as info:
        main(["plan", str(PRODUCTION)])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("[assumption]") == 3 * 4  # per-device, reserve and per-sequence lines of four plans
    assert out.count("[derived]") == 4
    for name in names:
        assert f"  {name} = " in out
    with pytest.raises(SystemExit):
        main(["plan", str(PRODUCTION), "--json"])
    reports = json.loads(capsys.readouterr().out)
    assert [r["pool"] for r in reports] == ["vllm-128k", "ascend-128k", "sglang-512k", "nvl72-1m"]
    assert all(r["fits"] for r in reports)
    assert {a["name"] for a in reports[0]["assumptions"]} == set(names)


# --- refusals: what the model, its checkpoint or the engines cannot take -------------------------

def refused(tmp_path: Path, name: str, change: Callable[[dict[str, Any]], object]) -> str:
    """Load a copy of plan `name` after `change`; return the PlanError message it must raise."""
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / f"{name}.yaml"
    edit_yaml(path, change)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    return str(info.value)


def test_a_context_above_the_models_maximum_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "plan-c", lambda d: d.update(max_context_tokens=2 * 1048576))
    assert "max_context_tokens 2,097,152 exceeds Kimi K3's maximum of 1,048,576 tokens" in message


@pytest.mark.parametrize("value", [1.0, 0, -0.5, 1.2])
def test_memory_utilization_outside_zero_one_is_refused(tmp_path: Path, value: float) -> None:
    message = refused(tmp_path, "plan-a", lambda d: d["engine"].update(memory_utilization=value))
    assert "engine.memory_utilization" in message and "is outside (0, 1)" in message


def test_a_tensor_size_that_does_not_divide_the_heads_is_refused(tmp_path: Path) -> None:
    def five(d: dict[str, Any]) -> None:
        d["hardware"].update(devices_per_node=5)
        d["parallelism"].update(tensor=5, expert=5)
    assert "parallelism: tensor 5 does not divide the 96 attention heads" in refused(tmp_path, "plan-a", five)


def test_an_sglang_expert_size_that_does_not_divide_the_experts_is_refused(tmp_path: Path) -> None:
    def three_nodes(d: dict[str, Any]) -> None:
        d["hardware"].update(nodes=3)
        d["parallelism"].update(tensor=24, expert=24)
    message = refused(tmp_path, "plan-b", three_nodes)
    assert "expert 24 does not divide the 896 experts" in message
    assert "attention heads" not in message  # 96 = 24 x 4


def test_an_sglang_expert_size_that_does_not_divide_the_tensor_size_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "plan-b", lambda d: d["parallelism"].update(expert=7))
    assert "expert 7 does not divide the 896 experts" not in message  # 896 = 7 x 128
    assert "expert 7 does not divide tensor 16" in message


def test_more_pipeline_stages_than_layers_are_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "plan-c", lambda d: d["parallelism"].update(tensor=1, pipeline=72, data=1))
    assert "parallelism: pipeline 72 exceeds the 64 layers" in message


def test_a_bf16_plan_on_the_mxfp4_checkpoint_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "plan-c", lambda d: d["engine"].update(precision="bf16"))
    assert "engine.precision bf16, but moonshotai/Kimi-K3 holds mxfp4 weights" in message
    assert "--dtype does not dequantize" in message


def test_a_bf16_plan_needs_a_bf16_checkpoint_path(tmp_path: Path) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-c.yaml"
    edit_yaml(path, lambda d: d["engine"].update(precision="bf16", model_path="/models/kimi-k3-bf16"))
    with pytest.raises(PlanError, match=r"not a checkpoint the model card lists: set engine.checkpoint_precision"):
        load_plan(path)
    edit_yaml(path, lambda d: d["engine"].update(checkpoint_precision="bf16"))
    loaded = load_plan(path)
    report = plan_capacity(loaded)
    assert report.fits and report.checkpoint_precision == "bf16" and report.weight_bytes == pytest.approx(5600 * GB)
    assert not any("what-if only" in w for w in report.warnings)
    text = render_script(loaded)
    assert "--dtype bfloat16" in text and "--quantization" not in text


def test_a_forced_quantization_must_be_the_checkpoints(tmp_path: Path) -> None:
    message = refused(tmp_path, "plan-a", lambda d: d["engine"].update(quantization="fp8"))
    assert "engine.quantization 'fp8', but moonshotai/Kimi-K3 declares mxfp4" in message
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: d["engine"].update(quantization="mxfp4"))  # the plan says otherwise
    assert _flag(render_script(load_plan(path)), "--quantization") == "mxfp4"


def test_a_refused_plan_file_is_a_clean_cli_error_and_emits_nothing(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    copy_config(tmp_path)
    path = tmp_path / "config" / "plans" / "plan-a.yaml"
    edit_yaml(path, lambda d: d["engine"].update(precision="bf16"))
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path), "--emit", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "plan error:" in err and "holds mxfp4 weights" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_emitting_a_precision_the_checkpoint_lacks_is_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(CONFIG / "plans" / "plan-c.yaml"), "--precision", "bf16", "--emit", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "--precision bf16 with --emit: plan plan-c mounts moonshotai/Kimi-K3, which holds mxfp4" in (
        capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as info:
        main(["plan", str(CONFIG / "plans" / "plan-c.yaml"), "--precision", "mxfp4", "--emit", str(tmp_path / "ok")])
    assert info.value.code == 0
    text = (tmp_path / "ok" / "nvl72-1m.sh").read_text()
    assert "--dtype" not in text and "--quantization" not in text


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
        assert "--api-key" not in text, pool.name  # the key stays off the command line
        (key_var,) = re.findall(r'(?m)^: "\$\{(\w+):\?set \w+: the bearer key', text)
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
        # SGLang reads its key from no variable: a `python3 -c` launcher runs sglang.launch_server.
        assert 'exec python3 -c "$launcher"' in text and "sglang.launch_server" in text
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
    # Every shipped plan mounts the MXFP4 checkpoint: the engine reads its quantization_config, so the
    # script forces neither a method (the engines refuse one that differs) nor --dtype bfloat16.
    assert loaded.checkpoint().precision == p.engine.precision == "mxfp4"
    assert "--quantization" not in text and "--dtype" not in text


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
    assert f"```\n{out}\n```" in (REPO_ROOT / "docs" / "deploying.md").read_text(), \
        "docs/deploying.md: paste `kimi-gateway plan` again"


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


def test_the_plan_verdicts_in_deploy_readme_are_the_planners(tmp_path: Path) -> None:
    """deploy/README.md, "Plan verdicts": each figure it quotes is what the planner computes."""
    text = (REPO_ROOT / "deploy" / "README.md").read_text()
    verdicts = text[text.index("### Plan verdicts"):text.index("## 2. On a laptop")]

    def at(name: str, gb: float, precision: Precision | None = None) -> CapacityReport:
        folder = tmp_path / f"{name}-{gb:g}-{precision}"
        folder.mkdir()
        return plan_capacity(guide_figure(folder, name, gb), precision)

    a_guide, a_vendor = at("plan-a", 192), at("plan-a", 288)
    assert not a_guide.fits and f"{(a_guide.resident_weight_bytes - a_guide.usable_bytes) / GB:,.1f} GB short" in (
        f"{a_guide.refusal}") and "**160.0 GB short**" in verdicts
    assert f"{(a_guide.weight_bytes - a_guide.memory_bytes) / GB:,.1f} GB less than the 1,568.3 GB" in verdicts
    assert f"headroom {a_vendor.headroom_bytes / GB:,.1f} GB, **{a_vendor.max_context_sequences}** sequences" in (
        verdicts)
    b_guide = at("plan-b", 144)
    assert not b_guide.fits and b_guide.refusal is not None and f"headroom {b_guide.headroom_bytes / GB:,.1f} GB" in (
        verdicts)
    budget, _, left, sequence = re.findall(r"\d+\.\d\d GB", b_guide.refusal)  # per device; MLA KV's share
    for figure in (budget, left, sequence):
        assert figure in verdicts, figure
    for name, guide_gb, vendor_gb in (("plan-b", None, 180), ("plan-c", 186, 186)):
        if guide_gb is not None:
            guide = at(name, guide_gb)
            quoted = f"headroom {guide.headroom_bytes / GB:,.1f} GB, **{guide.max_context_sequences}** "
            assert guide.fits and quoted in verdicts, name
        vendor = at(name, vendor_gb) if vendor_gb != guide_gb else at(name, vendor_gb, "bf16")
        assert f"headroom {vendor.headroom_bytes / GB:,.1f} GB, **{vendor.max_context_sequences}** " in verdicts, name
    planned, flat = plan_capacity(plan("plan-c")).layouts
    assert "EP 24 per stage** (896" in verdicts and f"), {planned.max_context_sequences}\nsequences" in verdicts
    assert f"EP 72** ({flat.experts_per_device} experts" in verdicts
    assert f"GPU), {flat.max_context_sequences} sequences" in verdicts
    assert f"{MXFP4_WEIGHTS / GB:,.1f} GB" == "1,568.3 GB" and "**1,568.3 GB**" in verdicts
