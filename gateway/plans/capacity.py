"""Capacity planner: does a plan's model fit its hardware, and how many max-context sequences fit beside it?

Per engine instance (one gateway worker), in decimal GB (10^9 bytes), the guide's own arithmetic:

    memory     = nodes x devices_per_node x memory_per_device_gb          (8 x 192 = 1,536 GB)
    weights    = parameters x bytes_per_param[precision]                  (2.8T x 0.5 = 1,400 GB)
    usable     = memory x memory_utilization                              (1,536 x 0.95 = 1,459.2 GB)
    headroom   = usable - weights                                         (59.2 GB: thin)

then per device, with the model card's labelled assumptions:

    kv_budget  = usable/device - weights/device - activation_reserve      (weights spread evenly)
    per token  = kv_bytes_per_token / pipeline   (MLA latent kept whole on every TP rank: assumption)
    per seq    = max_context x per token + state_bytes_per_sequence / (tensor x pipeline)
    sequences  = floor(kv_budget / per seq) x data                        (each DP rank holds its own)

A plan is refused when its weights exceed the usable memory, or when the KV budget holds not one
max-context sequence; the refusal carries the numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from gateway.plans.models import LoadedPlan, Precision

GB = 1e9
THIN_HEADROOM = 0.10  # headroom after weights below this share of all memory is called thin


@dataclass(frozen=True)
class AssumptionUsed:
    """One assumed number the report depends on, with its unit and source (from the model card)."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class PrecisionFit:
    """Weights at one precision and whether they fit the plan's usable memory."""

    precision: str
    weight_bytes: float
    fits: bool


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
    precision: str
    parameters: int
    bytes_per_param: float
    weight_bytes: float
    memory_utilization: float
    usable_bytes: float
    headroom_bytes: float
    headroom_thin: bool
    activation_reserve_bytes: float
    kv_budget_bytes: float
    kv_budget_per_device_bytes: float
    kv_bytes_per_token_per_device: float
    state_bytes_per_sequence_per_device: float
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
    precisions: list[PrecisionFit] = field(default_factory=list)
    assumptions: list[AssumptionUsed] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def plan_capacity(loaded: LoadedPlan, precision: Precision | None = None) -> CapacityReport:
    """Compute the capacity report of a plan, optionally at another `precision` (a what-if)."""
    plan, card = loaded.plan, loaded.card
    precision = precision or plan.engine.precision
    hw, par = plan.hardware, plan.parallelism
    devices = hw.devices
    per_device = hw.memory_per_device_gb * GB
    memory = devices * per_device
    util = plan.engine.memory_utilization
    usable = memory * util
    weights = card.weight_bytes(precision)
    headroom = usable - weights

    a = card.assumptions
    reserve_per_device = a.activation_reserve_bytes_per_device.value
    kv_per_device = per_device * util - weights / devices - reserve_per_device
    tp_split = 1 if a.mla_kv_replicated_across_tp.value else par.tensor
    per_token = a.kv_bytes_per_token.value / (par.pipeline * tp_split)
    state = a.state_bytes_per_sequence.value / (par.pipeline * par.tensor)
    per_sequence = plan.max_context_tokens * per_token + state
    room = max(kv_per_device, 0.0)
    sequences = math.floor(room / per_sequence) * par.data
    tokens = math.floor(room / per_token) * par.data

    refusal = None
    if weights > usable:
        refusal = (f"{precision} weights need {weights / GB:,.0f} GB ({card.parameters / 1e12:g}T params x "
                   f"{card.bytes_per_param[precision]:g} bytes) but {devices} x {hw.accelerator} hold "
                   f"{memory / GB:,.0f} GB, {usable / GB:,.1f} GB usable at {util:g}: "
                   f"{(weights - usable) / GB:,.1f} GB short")
    elif sequences < 1:
        refusal = (f"weights fit ({weights / GB:,.0f} of {usable / GB:,.1f} GB usable) but the KV budget "
                   f"({kv_per_device / GB:,.2f} GB per device after the {reserve_per_device / GB:g} GB activation "
                   f"reserve) holds no {plan.max_context_tokens:,}-token sequence "
                   f"({per_sequence / GB:,.2f} GB per device)")
    fits_by_precision = [
        PrecisionFit(p, card.weight_bytes(p), card.weight_bytes(p) <= usable)
        for p in get_args(Precision) if p in card.bytes_per_param
    ]
    assumptions = [AssumptionUsed(name, getattr(a, name).value, getattr(a, name).unit, getattr(a, name).source)
                   for name in type(a).model_fields]
    return CapacityReport(
        plan=plan.name, title=plan.title, pool=plan.pool.name, engine=plan.engine.kind, replicas=plan.replicas,
        accelerator=hw.accelerator, devices=devices, memory_per_device_bytes=per_device, memory_bytes=memory,
        memory_source=hw.memory_source, precision=precision, parameters=card.parameters,
        bytes_per_param=card.bytes_per_param[precision], weight_bytes=weights, memory_utilization=util,
        usable_bytes=usable, headroom_bytes=headroom, headroom_thin=0 <= headroom < THIN_HEADROOM * memory,
        activation_reserve_bytes=reserve_per_device * devices, kv_budget_bytes=kv_per_device * devices,
        kv_budget_per_device_bytes=kv_per_device, kv_bytes_per_token_per_device=per_token,
        state_bytes_per_sequence_per_device=state, max_context_tokens=plan.max_context_tokens,
        sequence_bytes_per_device=per_sequence, max_context_sequences=sequences, kv_tokens=tokens,
        tensor=par.tensor, pipeline=par.pipeline, data=par.data, expert=par.expert,
        fits=refusal is None, refusal=refusal, precisions=fits_by_precision, assumptions=assumptions,
    )


def _gb(value: float) -> str:
    return f"{value / GB:,.1f} GB".replace(".0 GB", " GB")


def render_report(report: CapacityReport, assumptions: bool = True) -> str:
    """The report as text lines for a terminal; assumed numbers are marked `[assumption]`, and with
    `assumptions` each one is listed with its source (a multi-plan report lists them once instead)."""
    r = report
    lines = [
        f"{r.plan}: {r.title} -> pool {r.pool} ({r.engine}, {r.replicas} replica(s))",
        f"  memory       {r.devices} x {r.accelerator} x {_gb(r.memory_per_device_bytes)} = {_gb(r.memory_bytes)}"
        f"  ({r.memory_source})",
        f"  weights      {r.parameters / 1e12:g}T params x {r.bytes_per_param:g} bytes ({r.precision}) = "
        f"{_gb(r.weight_bytes)}, {_gb(r.weight_bytes / r.devices)} per device",
        f"  usable       {_gb(r.memory_bytes)} x {r.memory_utilization:g} = {_gb(r.usable_bytes)}; "
        f"headroom after weights {_gb(r.headroom_bytes)}"
        + (f" ({r.headroom_bytes / r.memory_bytes:.1%} of memory: thin)" if r.headroom_thin else ""),
        f"  parallelism  TP {r.tensor} x PP {r.pipeline} x DP {r.data} = {r.devices} devices, EP {r.expert}",
    ]
    if r.weight_bytes <= r.usable_bytes:
        lines += kv_lines(r)
    if r.fits:
        lines.append(f"  fits         {r.max_context_sequences:,} sequence(s) of {r.max_context_tokens:,} tokens "
                     f"per replica ({r.kv_tokens:,} tokens of KV cache)")
    else:
        lines.append(f"  REFUSED      {r.refusal}")
    lines.append("  precisions   " + "; ".join(
        f"{p.precision} {_gb(p.weight_bytes)} {'fits' if p.fits else 'does not fit'}" for p in r.precisions))
    if assumptions:
        lines.append("  assumptions (model card):")
        lines.extend(f"    {format_assumption(a)}" for a in r.assumptions)
    return "\n".join(lines)


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
    ]
