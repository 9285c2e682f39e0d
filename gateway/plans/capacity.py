"""Capacity planner: does a plan's model fit its hardware, and how many max-context sequences fit beside it?

Per engine instance (one gateway worker), in decimal GB (10^9 bytes). Weights are counted per part,
as the engines load them (model card `precisions`, each with its engine source):

    experts    = expert params x (expert_bytes + scale_bytes / block_size)   (2,745.0B x (0.5 + 1/32) = 1,458.3 GB)
    dense      = dense params x dense_bytes                                   (55.0B x 2 = 110.0 GB: mxfp4 is MoE-only)
    weights    = experts + dense                                              (1,568.3 GB, not the guide's 1,400)

and per device, the fullest device of the layout:

    stage      = ceil(layers / pipeline) / layers                             (the largest pipeline stage's share)
    experts/dv = experts x stage x ceil(n_experts / EP) / n_experts           (EP: the group the engine forms;
                 (experts x stage / (TP x DP) without EP; SGLang: / TP)        vLLM: TP x DP per stage)
    dense/dv   = ((dense - replicated) / tensor + replicated) x stage         (each DP rank keeps its own copy;
                                                                               router gates and latent-MoE
                                                                               projections are whole on every
                                                                               TP rank: `replicated_parameters`)
    usable/dv  = memory_per_device x memory_utilization
    kv_budget  = usable/dv - weights/dv - activation_reserve
    per token  = kv_bytes_per_token x stage   (MLA latent kept whole on every TP rank: assumption)
    state      = state_bytes_per_sequence x stage / tensor                    (KDA heads split by TP)

vLLM keeps each sequence's KV and linear-attention state in one pool:

    per seq    = max_context x per token + state
    sequences  = floor(kv_budget / per seq) x data                            (each DP rank holds its own)

SGLang splits the budget first (python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py: the
linear-attention ("mamba") pool gets `mamba_full_memory_ratio / (1 + ratio)` of the memory left after
weights and activations, ratio 0.9 by default in srt/server_args.py, and sizes max_mamba_cache_size
from it; the MLA KV pool gets the rest):

    states     = floor(kv_budget x r / (1 + r) / state)                       (r = --mamba-full-memory-ratio)
    kv room    = kv_budget - states x state
    sequences  = min(states, floor(kv room / (max_context x per token))) x data

vLLM plans with pipeline stages are also reported in the other layout of the same devices (no PP,
DP = devices / TP: the expert-parallel group spans every device; `layouts`).

A plan is refused when its weights exceed a device's usable memory, or when the KV budget holds not
one max-context sequence; the refusal carries the numbers. The plan's memory per device is checked
against the vendor's published figure (accelerators.py): when they differ, the report warns and
carries the same plan computed at the vendor's figure (`at_vendor_figure`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from gateway.plans.accelerators import vendor_memory
from gateway.plans.models import LoadedPlan, Parallelism, Precision, expert_parallel_size, stage_layers

GB = 1e9
THIN_HEADROOM = 0.10  # headroom after weights below this share of all memory is called thin
# SGLang's --mamba-full-memory-ratio default (python/sglang/srt/server_args.py, mamba_full_memory_ratio=0.9).
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9


@dataclass(frozen=True)
class AssumptionUsed:
    """One assumed number the report depends on, with its unit and source (from the model card)."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class PrecisionFit:
    """Weights at one precision and whether they fit the plan's usable memory (per device)."""

    precision: str
    weight_bytes: float
    fits: bool


@dataclass(frozen=True)
class LayoutFit:
    """One way to lay the plan's devices out (TP x PP x DP) and what it leaves for sequences."""

    tensor: int
    pipeline: int
    data: int
    expert_parallel_size: int
    experts_per_device: int
    stage_layers: int
    weights_per_device_bytes: float
    max_context_sequences: int
    fits: bool
    planned: bool


@dataclass(frozen=True)
class CapacityReport:
    """The planner's answer for one plan (one engine instance). Bytes unless the name says otherwise."""

    plan: str
    title: str
    pool: str
    engine: str
    replicas: int
    accelerator: str
    devices: int
    memory_per_device_bytes: float
    memory_bytes: float
    memory_source: str
    vendor_memory_per_device_bytes: float | None
    vendor_memory_source: str | None
    precision: str
    checkpoint: str
    checkpoint_precision: str
    parameters: int
    expert_parameters: int
    dense_parameters: int
    parameter_split_source: str
    expert_bytes_per_param: float
    dense_bytes_per_param: float
    scale_bytes_per_param: float
    precision_source: str
    expert_weight_bytes: float
    dense_weight_bytes: float
    weight_bytes: float
    weights_per_device_bytes: float
    resident_weight_bytes: float
    expert_parallel_size: int
    experts_per_device: int
    stage_layers: int
    memory_utilization: float
    usable_bytes: float
    headroom_bytes: float
    headroom_thin: bool
    activation_reserve_bytes: float
    kv_budget_bytes: float
    kv_budget_per_device_bytes: float
    kv_bytes_per_token_per_device: float
    state_bytes_per_sequence_per_device: float
    replicated_weight_bytes_per_device: float
    state_pool_share: float | None
    state_pool_sequences: int | None
    max_context_tokens: int
    sequence_bytes_per_device: float
    max_context_sequences: int
    kv_tokens: int
    tensor: int
    pipeline: int
    data: int
    expert: int
    fits: bool
    refusal: str | None
    warnings: list[str] = field(default_factory=list)
    precisions: list[PrecisionFit] = field(default_factory=list)
    assumptions: list[AssumptionUsed] = field(default_factory=list)
    layouts: list[LayoutFit] = field(default_factory=list)
    at_vendor_figure: CapacityReport | None = None

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (`at_vendor_figure` nested the same way, or None)."""
        return asdict(self)


def _weights_per_device(loaded: LoadedPlan, precision: Precision) -> tuple[float, int, int]:
    """(bytes on the fullest device, experts on it, layers of the largest stage) at `precision`."""
    plan, card = loaded.plan, loaded.card
    par = plan.parallelism
    layers = stage_layers(plan, card)
    stage = layers / card.assumptions.layers.value
    ep = expert_parallel_size(plan)
    local_experts = math.ceil(card.experts / ep) if ep > 1 else card.experts
    # Without EP the experts are tensor-sharded: vLLM flattens TP across DP for the MoE layers
    # (FusedMoEParallelConfig.make, flatten_tp_across_dp); SGLang's DP attention sits inside its TP group.
    moe_tp = par.tensor * par.data if plan.engine.kind != "sglang" else par.tensor
    expert_share = local_experts / card.experts if ep > 1 else 1 / moe_tp
    replicated = card.replicated_weight_bytes(precision)
    dense = (card.dense_weight_bytes(precision) - replicated) / par.tensor + replicated
    per_device = card.expert_weight_bytes(precision) * expert_share + dense
    return per_device * stage, local_experts, layers


def mamba_full_memory_ratio(loaded: LoadedPlan) -> float:
    """SGLang's --mamba-full-memory-ratio: the plan's `engine.extra_args` value, or SGLang's default."""
    args = loaded.plan.engine.extra_args
    for index, arg in enumerate(args):
        if arg.startswith("--mamba-full-memory-ratio="):
            return float(arg.split("=", 1)[1])
        if arg == "--mamba-full-memory-ratio" and index + 1 < len(args):
            return float(args[index + 1])
    return SGLANG_MAMBA_FULL_MEMORY_RATIO


def _sequences(loaded: LoadedPlan, room: float, per_token: float, state: float) -> tuple[int, int, int | None]:
    """(max-context sequences, KV tokens, SGLang's state-pool sequences or None) in `room` bytes per device."""
    plan = loaded.plan
    data = plan.parallelism.data
    if plan.engine.kind != "sglang":
        per_sequence = plan.max_context_tokens * per_token + state
        return math.floor(room / per_sequence) * data, math.floor(room / per_token) * data, None
    ratio = mamba_full_memory_ratio(loaded)
    states = math.floor(room * ratio / (1 + ratio) / state) if state else 0
    kv_room = room - states * state
    by_kv = math.floor(kv_room / (plan.max_context_tokens * per_token))
    return min(states, by_kv) * data, math.floor(kv_room / per_token) * data, states * data


def _layouts(loaded: LoadedPlan, precision: Precision, memory_per_device_gb: float | None) -> list[LayoutFit]:
    """The planned layout and, for a vLLM plan with pipeline stages and expert parallelism, the same
    devices without PP (DP = devices / TP): vLLM's EP group is TP x DP per stage, so only that layout
    spreads the experts over every device."""
    plan = loaded.plan
    par = plan.parallelism
    if plan.engine.kind == "sglang" or par.pipeline == 1 or par.expert == 1:
        return []
    flat = Parallelism(tensor=par.tensor, pipeline=1, data=plan.hardware.devices // par.tensor,
                       expert=plan.hardware.devices)
    other = LoadedPlan(path=loaded.path, plan=plan.model_copy(update={"parallelism": flat}), card=loaded.card)
    out = []
    for candidate, planned in ((loaded, True), (other, False)):
        r = plan_capacity(candidate, precision, memory_per_device_gb, layouts=False)
        out.append(LayoutFit(tensor=r.tensor, pipeline=r.pipeline, data=r.data,
                             expert_parallel_size=r.expert_parallel_size, experts_per_device=r.experts_per_device,
                             stage_layers=r.stage_layers, weights_per_device_bytes=r.weights_per_device_bytes,
                             max_context_sequences=r.max_context_sequences, fits=r.fits, planned=planned))
    return out


def _warnings(loaded: LoadedPlan, precision: Precision, local_experts: int, ep: int) -> list[str]:
    plan, card = loaded.plan, loaded.card
    out = []
    checkpoint = loaded.checkpoint()
    if precision != checkpoint.precision:
        out.append(f"what-if only: {checkpoint.path} holds {checkpoint.precision} weights; serving {precision} "
                   f"needs a {precision} checkpoint (--dtype does not dequantize)")
    vendor = vendor_memory(plan.hardware.accelerator)
    if vendor is None:
        out.append(f"no vendor figure for {plan.hardware.accelerator} in gateway/plans/accelerators.py: "
                   f"{plan.hardware.memory_per_device_gb:g} GB per device is unchecked")
    elif vendor.memory_per_device_gb != plan.hardware.memory_per_device_gb:
        out.append(f"the plan's {plan.hardware.memory_per_device_gb:g} GB per {plan.hardware.accelerator} disagrees "
                   f"with the vendor's {vendor.memory_per_device_gb:g} GB ({vendor.source}); the plan is also "
                   f"reported at the vendor's figure")
    if ep > 1 and card.experts % ep:
        out.append(f"{card.experts} experts over an expert-parallel group of {ep} (vLLM: TP x DP per pipeline "
                   f"stage) is uneven: the fullest rank holds {local_experts} (vLLM's determine_expert_map), "
                   "counted here")
    layers = int(card.assumptions.layers.value)
    if layers % plan.parallelism.pipeline:
        out.append(f"{layers} layers (assumed) over {plan.parallelism.pipeline} pipeline stages is uneven: the "
                   f"largest stage holds {stage_layers(plan, card)} (vLLM's get_pp_indices), counted here")
    return out


def plan_capacity(loaded: LoadedPlan, precision: Precision | None = None,
                  memory_per_device_gb: float | None = None, *, layouts: bool = True) -> CapacityReport:
    """Compute the capacity report of a plan, optionally at another `precision` (a what-if) or another
    memory per device in decimal GB (the vendor's figure; then no nested vendor report). With
    `layouts`, a vLLM plan with pipeline stages also carries its no-PP layout (`_layouts`)."""
    plan, card = loaded.plan, loaded.card
    precision = precision or plan.engine.precision
    hw, par = plan.hardware, plan.parallelism
    devices = hw.devices
    per_device = (memory_per_device_gb or hw.memory_per_device_gb) * GB
    memory = devices * per_device
    util = plan.engine.memory_utilization
    usable = memory * util
    part = card.precisions[precision]
    weights = card.weight_bytes(precision)
    weights_device, local_experts, layers = _weights_per_device(loaded, precision)
    resident = weights_device * devices
    headroom = usable - resident

    a = card.assumptions
    stage = layers / a.layers.value
    reserve_per_device = a.activation_reserve_bytes_per_device.value
    kv_per_device = per_device * util - weights_device - reserve_per_device
    tp_split = 1 if a.mla_kv_replicated_across_tp.value else par.tensor
    per_token = a.kv_bytes_per_token.value * stage / tp_split
    state = a.state_bytes_per_sequence.value * stage / par.tensor
    per_sequence = plan.max_context_tokens * per_token + state
    room = max(kv_per_device, 0.0)
    sequences, tokens, state_pool = _sequences(loaded, room, per_token, state)
    state_share = None
    if plan.engine.kind == "sglang":
        ratio = mamba_full_memory_ratio(loaded)
        state_share = ratio / (1 + ratio)

    refusal = None
    if weights_device > per_device * util:
        refusal = (f"{precision} weights need {_gb(resident)} on the devices ({_gb(weights)} once, "
                   f"{_gb(weights_device)} per device: "
                   f"{card.parameter_split.expert / 1e9:,.1f}B expert params x {part.expert_bytes_with_scales:g} bytes "
                   f"+ {card.parameter_split.dense / 1e9:,.1f}B dense x {part.dense_bytes:g} bytes, "
                   f"{a.replicated_parameters.value / 1e9:,.1f}B of them whole on every TP rank) but {devices} x "
                   f"{hw.accelerator} hold {memory / GB:,.0f} GB, {usable / GB:,.1f} GB usable at {util:g}: "
                   f"{(resident - usable) / GB:,.1f} GB short")
    elif sequences < 1:
        refusal = (f"weights fit ({resident / GB:,.1f} of {usable / GB:,.1f} GB usable) but the KV budget "
                   f"({kv_per_device / GB:,.2f} GB per device after the {reserve_per_device / GB:g} GB activation "
                   f"reserve) holds no {plan.max_context_tokens:,}-token sequence "
                   f"({per_sequence / GB:,.2f} GB per device)")
        if state_share is not None and state_pool is not None:
            refusal += (f": SGLang gives the linear-attention state {state_share:.1%} of it, leaving "
                        f"{(room - state_pool / par.data * state) / GB:,.2f} GB per device for MLA KV "
                        f"({plan.max_context_tokens * per_token / GB:,.2f} GB per sequence)")
    fits_by_precision = [
        PrecisionFit(p, card.weight_bytes(p), _weights_per_device(loaded, p)[0] <= per_device * util)
        for p in get_args(Precision) if p in card.precisions
    ]
    assumptions = [AssumptionUsed(name, getattr(a, name).value, getattr(a, name).unit, getattr(a, name).source)
                   for name in type(a).model_fields]
    ep = expert_parallel_size(plan)
    vendor = vendor_memory(hw.accelerator)
    checkpoint = loaded.checkpoint()
    report = CapacityReport(
        plan=plan.name, title=plan.title, pool=plan.pool.name, engine=plan.engine.kind, replicas=plan.replicas,
        accelerator=hw.accelerator, devices=devices, memory_per_device_bytes=per_device, memory_bytes=memory,
        memory_source=hw.memory_source if memory_per_device_gb is None else vendor.source if vendor else "given",
        vendor_memory_per_device_bytes=vendor.memory_per_device_gb * GB if vendor else None,
        vendor_memory_source=vendor.source if vendor else None,
        precision=precision, checkpoint=checkpoint.path, checkpoint_precision=checkpoint.precision,
        parameters=card.parameters, expert_parameters=card.parameter_split.expert,
        dense_parameters=card.parameter_split.dense, parameter_split_source=card.parameter_split.source,
        expert_bytes_per_param=part.expert_bytes, dense_bytes_per_param=part.dense_bytes,
        scale_bytes_per_param=part.scale_bytes / part.block_size, precision_source=part.source,
        expert_weight_bytes=card.expert_weight_bytes(precision), dense_weight_bytes=card.dense_weight_bytes(precision),
        weight_bytes=weights, weights_per_device_bytes=weights_device, resident_weight_bytes=resident,
        expert_parallel_size=ep, experts_per_device=local_experts, stage_layers=layers,
        memory_utilization=util, usable_bytes=usable, headroom_bytes=headroom,
        headroom_thin=0 <= headroom < THIN_HEADROOM * memory,
        activation_reserve_bytes=reserve_per_device * devices, kv_budget_bytes=kv_per_device * devices,
        kv_budget_per_device_bytes=kv_per_device, kv_bytes_per_token_per_device=per_token,
        state_bytes_per_sequence_per_device=state,
        replicated_weight_bytes_per_device=card.replicated_weight_bytes(precision) * stage,
        state_pool_share=state_share, state_pool_sequences=state_pool, max_context_tokens=plan.max_context_tokens,
        sequence_bytes_per_device=per_sequence, max_context_sequences=sequences, kv_tokens=tokens,
        tensor=par.tensor, pipeline=par.pipeline, data=par.data, expert=par.expert,
        fits=refusal is None, refusal=refusal, precisions=fits_by_precision, assumptions=assumptions,
        warnings=_warnings(loaded, precision, local_experts, ep) if memory_per_device_gb is None else [],
        layouts=_layouts(loaded, precision, memory_per_device_gb) if layouts else [],
    )
    if memory_per_device_gb is None and vendor is not None and vendor.memory_per_device_gb != hw.memory_per_device_gb:
        report = dataclasses.replace(report, at_vendor_figure=plan_capacity(loaded, precision,
                                                                            vendor.memory_per_device_gb))
    return report


def _gb(value: float) -> str:
    return f"{value / GB:,.1f} GB".replace(".0 GB", " GB")


def _b(params: int) -> str:
    return f"{params / 1e9:,.1f}B"


def render_report(report: CapacityReport, assumptions: bool = True) -> str:
    """The report as text lines for a terminal; assumed numbers are marked `[assumption]`, derived ones
    `[derived]`, and with `assumptions` each assumption is listed with its source (a multi-plan report
    lists them once instead)."""
    r = report
    scale = f" + scales {r.scale_bytes_per_param:g}" if r.scale_bytes_per_param else ""
    lines = [
        f"{r.plan}: {r.title} -> pool {r.pool} ({r.engine}, {r.replicas} replica(s))",
        f"  memory       {r.devices} x {r.accelerator} x {_gb(r.memory_per_device_bytes)} = {_gb(r.memory_bytes)}"
        f"  ({r.memory_source})",
        f"  checkpoint   {r.checkpoint} ({r.checkpoint_precision}); serving {r.precision}",
        f"  parameters   {r.parameters / 1e12:g}T = {_b(r.expert_parameters)} experts + {_b(r.dense_parameters)} "
        "dense [derived]",
        f"  weights      experts {_b(r.expert_parameters)} x {r.expert_bytes_per_param:g}{scale} bytes = "
        f"{_gb(r.expert_weight_bytes)}; dense {_b(r.dense_parameters)} x {r.dense_bytes_per_param:g} bytes = "
        f"{_gb(r.dense_weight_bytes)}; total {_gb(r.weight_bytes)} ({r.precision})",
        f"  per device   {_gb(r.weights_per_device_bytes)} of weights on the fullest device ({r.experts_per_device} "
        f"experts of EP {r.expert_parallel_size}, {r.stage_layers} layers; {_gb(r.replicated_weight_bytes_per_device)} "
        f"of it replicated on every TP rank [assumption]), {_gb(r.resident_weight_bytes)} over all",
        f"  usable       {_gb(r.memory_bytes)} x {r.memory_utilization:g} = {_gb(r.usable_bytes)}; "
        f"headroom after weights {_gb(r.headroom_bytes)}"
        + (f" ({r.headroom_bytes / r.memory_bytes:.1%} of memory: thin)" if r.headroom_thin else ""),
        f"  parallelism  TP {r.tensor} x PP {r.pipeline} x DP {r.data} = {r.devices} devices, EP "
        f"{r.expert_parallel_size}{' per pipeline stage' if r.pipeline > 1 and r.expert_parallel_size > 1 else ''}",
    ]
    if r.weights_per_device_bytes <= r.usable_bytes / r.devices:
        lines += kv_lines(r)
    lines.append(_verdict(r))
    lines.extend(layout_lines(r))
    lines.append("  precisions   " + "; ".join(
        f"{p.precision} {_gb(p.weight_bytes)} {'fits' if p.fits else 'does not fit'}" for p in r.precisions))
    lines.extend(f"  WARNING      {w}" for w in r.warnings)
    if r.at_vendor_figure is not None:
        v = r.at_vendor_figure
        outcome = (f"fits {v.max_context_sequences:,} sequence(s) of {v.max_context_tokens:,} tokens "
                   f"(headroom {_gb(v.headroom_bytes)})" if v.fits else f"REFUSED: {v.refusal}")
        lines.append(f"  at vendor's  {v.devices} x {_gb(v.memory_per_device_bytes)} = {_gb(v.memory_bytes)}: "
                     + outcome)
    if assumptions:
        lines.append("  assumptions (model card):")
        lines.extend(f"    {format_assumption(a)}" for a in r.assumptions)
    return "\n".join(lines)


def layout_lines(r: CapacityReport) -> list[str]:
    """One line per layout of `r.layouts` (none for a plan with one possible layout)."""
    return [f"  {'layout' if f.planned else 'or layout'}{' ' * (7 if f.planned else 4)}TP {f.tensor} x PP {f.pipeline} "
            f"x DP {f.data}: EP {f.expert_parallel_size}{' per stage' if f.pipeline > 1 else ''}, "
            f"{f.experts_per_device} experts x {f.stage_layers} layers per device, "
            f"{_gb(f.weights_per_device_bytes)} of weights per device, "
            + (f"{f.max_context_sequences:,} sequence(s)" if f.fits else "REFUSED")
            + (" (as planned)" if f.planned else "") for f in r.layouts]


def _verdict(r: CapacityReport) -> str:
    if r.fits:
        return (f"  fits         {r.max_context_sequences:,} sequence(s) of {r.max_context_tokens:,} tokens "
                f"per replica ({r.kv_tokens:,} tokens of KV cache)")
    return f"  REFUSED      {r.refusal}"


def format_assumption(a: AssumptionUsed) -> str:
    """`name = value unit: source` for one assumption."""
    shown = ("true" if a.value else "false") if a.unit == "flag" else f"{a.value:,.0f} {a.unit}"
    return f"{a.name} = {shown}: {a.source}"


def kv_lines(r: CapacityReport) -> list[str]:
    """The KV-budget lines of a report whose weights fit."""
    return [
        f"  reserve      activations {_gb(r.activation_reserve_bytes)} "
        f"({_gb(r.activation_reserve_bytes / r.devices)} per device) [assumption]",
        f"  KV budget    {_gb(r.kv_budget_bytes)} ({r.kv_budget_per_device_bytes / GB:,.2f} GB per device)",
        f"  per sequence {r.max_context_tokens:,} tokens x {r.kv_bytes_per_token_per_device:,.0f} B per device "
        f"+ {r.state_bytes_per_sequence_per_device / 1e6:,.1f} MB state = "
        f"{r.sequence_bytes_per_device / GB:,.2f} GB per device [assumption]",
        *([f"  state pool   SGLang gives linear-attention state {r.state_pool_share:.1%} of the KV budget "
           f"(--mamba-full-memory-ratio): {r.state_pool_sequences:,} sequences' state; MLA KV gets the rest"]
          if r.state_pool_share is not None else []),
    ]
