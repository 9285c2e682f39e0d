"""Plan files and the model card as pydantic models; loading them; a gateway pool derived from a plan.

A plan (`config/plans/*.yaml`) is the one place a deployment's facts are typed: hardware, engine,
parallelism, precision, max context, replicas, port, served model name and the engine's API key
variable. The gateway's pool (`pools: - plan: plans/plan-a.yaml` in a gateway config), the engine
launch scripts (`kimi-gateway plan FILE --emit DIR`) and the capacity report all read it. The model
card (`config/models/kimi-k3.yaml`) holds the model's sizes and the planner's labelled assumptions.

This package stays off the request path: the gateway imports it only while loading a config.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.flow.params import PoolFlowConfig

Precision = Literal["bf16", "mxfp8", "mxfp4"]
PlanEngineKind = Literal["vllm", "sglang", "ascend"]
Modality = Literal["text", "image", "audio", "video", "file"]

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Pool fields a plan decides; a gateway config that names a plan may not set them again.
DERIVED_POOL_FIELDS = ("name", "engine", "workers", "max_context_tokens", "served_model_name", "api_key")


class PlanError(ValueError):
    """A plan or model card that cannot be read or is invalid; the message names the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Assumption(_Strict):
    """One number the planner needs that no published source gives: its value, unit and where it comes from."""

    value: float
    unit: str
    source: str = Field(min_length=1, description="why this value; starts with `assumption:`")


class ModelAssumptions(_Strict):
    """The model card's assumed numbers (each printed as an assumption in every report)."""

    attention_heads: Assumption
    kda_heads: Assumption
    layers: Assumption
    kv_bytes_per_token: Assumption
    state_bytes_per_sequence: Assumption
    replicated_parameters: Assumption
    activation_reserve_bytes_per_device: Assumption
    mla_kv_replicated_across_tp: Assumption


class ParameterSplit(_Strict):
    """Routed-expert vs dense parameters (derived from the guide's totals; `source` says how)."""

    expert: int = Field(gt=0, description="parameters of the MoE layers' routed experts")
    dense: int = Field(gt=0, description="every other parameter: attention, shared experts, embeddings")
    source: str = Field(min_length=1, description="the derivation; starts with `derived`")


class PartPrecision(_Strict):
    """Bytes per parameter of each part at one precision, as the engines load them.

    Block-scaled formats (MXFP4, MXFP8) add `scale_bytes` per `block_size` expert values.
    """

    expert_bytes: float = Field(gt=0)
    dense_bytes: float = Field(gt=0)
    scale_bytes: float = Field(default=0, ge=0, description="bytes of one block scale")
    block_size: int = Field(default=1, ge=1, description="values sharing one scale")
    source: str = Field(min_length=1, description="which engine source says what is quantized")

    @property
    def expert_bytes_with_scales(self) -> float:
        """Bytes per expert parameter including its share of the block scale (0.5 + 1/32 for MXFP4)."""
        return self.expert_bytes + self.scale_bytes / self.block_size


class Checkpoint(_Strict):
    """A published checkpoint of the model: its path and the precision its weights are stored in."""

    path: str = Field(min_length=1)
    precision: Precision
    quant_method: str | None = Field(default=None, description="config.json quantization_config.quant_method")
    source: str = Field(min_length=1)


class ModelCard(_Strict):
    """The served model's sizes (`config/models/kimi-k3.yaml`): parameters split into experts and dense
    layers, per-part bytes per precision, the maximum context and the published checkpoints."""

    name: str
    repo: str
    source: str
    parameters: int = Field(gt=0)
    experts: int = Field(gt=0)
    active_experts: int = Field(gt=0)
    active_parameters: int = Field(gt=0)
    max_context_tokens: int = Field(gt=0, description="the model's maximum context, tokens")
    parameter_split: ParameterSplit
    precisions: dict[Precision, PartPrecision]
    checkpoints: list[Checkpoint] = Field(default_factory=list)
    assumptions: ModelAssumptions

    @model_validator(mode="after")
    def _split_matches_the_totals(self) -> ModelCard:
        split = self.parameter_split
        if abs(split.expert + split.dense - self.parameters) > 1:
            raise ValueError(f"parameter_split: expert {split.expert:,} + dense {split.dense:,} != parameters "
                             f"{self.parameters:,}")
        if not 0 <= self.assumptions.replicated_parameters.value < split.dense:
            raise ValueError(f"assumptions.replicated_parameters {self.assumptions.replicated_parameters.value:,.0f} "
                             f"must be part of the dense parameters ({split.dense:,})")
        active = split.dense + split.expert * self.active_experts / self.experts
        if abs(active - self.active_parameters) > 0.001 * self.active_parameters:
            raise ValueError(f"parameter_split: dense + expert x {self.active_experts}/{self.experts} = "
                             f"{active:,.0f}, not active_parameters {self.active_parameters:,}")
        return self

    def expert_weight_bytes(self, precision: Precision) -> float:
        """Bytes of all routed experts at `precision`, block scales included."""
        return self.parameter_split.expert * self.precisions[precision].expert_bytes_with_scales

    def dense_weight_bytes(self, precision: Precision) -> float:
        """Bytes of the dense part at `precision` (BF16 under mxfp4: the engines quantize experts only)."""
        return self.parameter_split.dense * self.precisions[precision].dense_bytes

    def replicated_weight_bytes(self, precision: Precision) -> float:
        """Bytes of the dense parameters every tensor-parallel rank holds whole (router gates, latent-MoE
        projections: `assumptions.replicated_parameters`), at the dense part's bytes per parameter."""
        return self.assumptions.replicated_parameters.value * self.precisions[precision].dense_bytes

    def weight_bytes(self, precision: Precision) -> float:
        """Bytes of all weights at `precision`: experts (with scales) + dense part."""
        return self.expert_weight_bytes(precision) + self.dense_weight_bytes(precision)

    def checkpoint(self, path: str) -> Checkpoint | None:
        """The card's checkpoint at `path` (a Hugging Face repo or its `/models/...` copy), or None."""
        for checkpoint in self.checkpoints:
            if path == checkpoint.path or path.rstrip("/").endswith("/" + checkpoint.path):
                return checkpoint
        return None


class Hardware(_Strict):
    """The devices ONE engine instance (one gateway worker) runs on."""

    accelerator: str = Field(min_length=1, description="e.g. B300, B200, GB200, Ascend 950")
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    memory_per_device_gb: float = Field(gt=0, description="decimal GB (10^9 bytes) of HBM per device")
    memory_source: str = Field(min_length=1, description="where memory_per_device_gb comes from")

    @property
    def devices(self) -> int:
        """GPUs/NPUs of one engine instance."""
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        """All device memory of one engine instance, bytes."""
        return self.devices * self.memory_per_device_gb * 1e9


class Parallelism(_Strict):
    """How one engine instance splits the model: tensor x pipeline x data = devices; expert <= devices
    (vLLM, vllm-ascend: 1 or all devices, as --enable-expert-parallel has no size)."""

    tensor: int = Field(default=1, ge=1)
    pipeline: int = Field(default=1, ge=1)
    data: int = Field(default=1, ge=1, description="data-parallel (attention) ranks inside one instance")
    expert: int = Field(default=1, ge=1, description="devices the experts are spread over (1: no EP)")


class LaunchSpec(_Strict):
    """The engine server: kind, model, precision and how it is exposed."""

    kind: PlanEngineKind
    model_path: str = Field(min_length=1, description="Hugging Face repo or local path of the weights")
    served_model_name: str = Field(min_length=1)
    precision: Precision
    quantization: str | None = Field(
        default=None, description="force the engine's --quantization; None (the default): the engine reads "
        "the checkpoint's quantization_config itself. Must equal the checkpoint's quant_method",
    )
    checkpoint_precision: Precision | None = Field(
        default=None, description="what model_path holds, for a path the model card does not list",
    )
    checkpoint_quant_method: str | None = Field(
        default=None, description="its config.json quantization_config.quant_method, with checkpoint_precision",
    )
    memory_utilization: float = Field(
        description="vLLM --gpu-memory-utilization / SGLang --mem-fraction-static, in (0, 1)"
    )
    memory_utilization_source: str = Field(default="the guide", description="where memory_utilization comes from")
    port: int = Field(ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=_ENV_NAME, description="variable holding the engine key")
    chunked_prefill: bool = False
    trust_remote_code: bool = True
    extra_args: list[str] = Field(default_factory=list, description="further engine flags, passed as given")

    @field_validator("memory_utilization")
    @classmethod
    def _utilization_in_range(cls, value: float) -> float:
        if not 0 < value < 1:
            raise ValueError(f"{value:g} is outside (0, 1): the share of each device's memory the engine may "
                             "take (weights + KV cache); 1 or more leaves nothing for the CUDA context and "
                             "the activations, 0 or less holds nothing")
        return value

    def quantization_flag(self) -> str | None:
        """The --quantization value to pass (only when the plan forces one), else None: the engine detects it."""
        return self.quantization


class GatewayPoolSpec(_Strict):
    """The gateway side of the plan: the pool's name and its gateway-only defaults."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    default_output_tokens: int = Field(default=1024, ge=0)
    modalities: list[Modality] = Field(default_factory=lambda: list[Modality](["text", "image"]))
    spillover: bool = True
    worker_env: str | None = Field(
        default=None, pattern=_ENV_NAME,
        description="prefix of the worker URL variables (PREFIX_0, PREFIX_1...); default: the pool name in "
        "upper case with - and . as _, plus _WORKER",
    )
    worker_host: str = Field(
        default="{pool}-{index}", description="host a worker URL falls back to; {pool} and {index} are filled in"
    )
    flow_control: PoolFlowConfig | None = Field(
        default=None, description="the pool's flow control (gateway/flow/); with engine_priority the launch script "
        "turns the engine's priority scheduling on (gateway/flow/priority.py `launch_flags`)")


class Plan(_Strict):
    """One K3 deployment plan (`config/plans/*.yaml`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    title: str
    source: str = Field(description="where the plan's facts come from")
    model: str = Field(default="../models/kimi-k3.yaml", description="model card path, relative to the plan file")
    hardware: Hardware
    parallelism: Parallelism
    engine: LaunchSpec
    max_context_tokens: int = Field(gt=0, description="tokens, prompt + output; the engine's max model length")
    replicas: int = Field(ge=1, description="engine instances (gateway workers) in the pool")
    pool: GatewayPoolSpec

    @model_validator(mode="after")
    def _parallel_sizes_fit(self) -> Plan:
        par, devices = self.parallelism, self.hardware.devices
        if par.tensor * par.pipeline * par.data != devices:
            raise ValueError(f"parallelism: tensor {par.tensor} x pipeline {par.pipeline} x data {par.data} = "
                             f"{par.tensor * par.pipeline * par.data}, but the hardware has {devices} devices")
        if par.expert > devices:
            raise ValueError(f"parallelism.expert {par.expert} exceeds the {devices} devices")
        if self.engine.kind in ("vllm", "ascend") and par.expert not in (1, devices):
            # --enable-expert-parallel has no size: EP = TP x DP in each pipeline stage (all devices).
            raise ValueError(f"parallelism.expert {par.expert}: vLLM's expert parallelism spreads the experts "
                             f"over every device, so it is 1 or all {devices} devices")
        if self.engine.kind == "sglang" and par.pipeline > 1:
            raise ValueError("the emitted SGLang command supports tensor/data/expert parallelism only")
        return self

    def worker_env(self) -> str:
        """Prefix of the worker URL variables, e.g. VLLM_128K_WORKER."""
        return self.pool.worker_env or re.sub(r"[^A-Za-z0-9]", "_", self.pool.name).upper() + "_WORKER"

    def worker_refs(self) -> list[str]:
        """The pool's worker URLs as `${PREFIX_i:-http://host:port}` references, one per replica."""
        refs = []
        for index in range(self.replicas):
            host = self.pool.worker_host.format(pool=self.pool.name, index=index)
            refs.append(f"${{{self.worker_env()}_{index}:-http://{host}:{self.engine.port}}}")
        return refs

    def gateway_pool(self) -> dict[str, Any]:
        """The gateway pool this plan defines, as a `pools:` entry (before `${VAR}` interpolation)."""
        pool: dict[str, Any] = {
            "name": self.pool.name,
            "engine": self.engine.kind,
            "workers": self.worker_refs(),
            "max_context_tokens": self.max_context_tokens,
            "served_model_name": self.engine.served_model_name,
            "modalities": list(self.pool.modalities),
            "default_output_tokens": self.pool.default_output_tokens,
            "spillover": self.pool.spillover,
        }
        if self.engine.api_key_env:
            pool["api_key"] = f"${{{self.engine.api_key_env}:-}}"
        if self.pool.flow_control is not None:
            pool["flow_control"] = self.pool.flow_control.model_dump(exclude_unset=True)
        return pool

    @property
    def engine_priority(self) -> bool:
        """Whether the pool's engines run priority scheduling (its `flow_control.engine_priority`)."""
        return self.pool.flow_control is not None and self.pool.flow_control.engine_priority


class LoadedPlan(BaseModel):
    """A plan with its file's path and its model card."""

    model_config = ConfigDict(frozen=True)

    path: Path
    plan: Plan
    card: ModelCard

    def checkpoint(self) -> Checkpoint:
        """What the plan's engine.model_path holds: the card's entry, or the plan's checkpoint_* fields."""
        engine = self.plan.engine
        known = self.card.checkpoint(engine.model_path)
        if known is not None:
            return known
        if engine.checkpoint_precision is None:
            raise PlanError(f"{self.path}: engine.model_path {engine.model_path!r} is not a checkpoint the model "
                            "card lists: set engine.checkpoint_precision (and checkpoint_quant_method) to what it "
                            "holds")
        return Checkpoint(path=engine.model_path, precision=engine.checkpoint_precision,
                          quant_method=engine.checkpoint_quant_method, source=f"the plan {self.path.name}")


def expert_parallel_size(plan: Plan) -> int:
    """The expert-parallel group the engine forms: SGLang's --ep-size; vLLM's (and vllm-ascend's)
    --enable-expert-parallel makes it TP x DP in each pipeline stage (vllm/model_executor/layers/
    fused_moe/config.py, FusedMoEParallelConfig.make), 1 without it."""
    par = plan.parallelism
    if plan.engine.kind == "sglang":
        return par.expert
    return par.tensor * par.data if par.expert > 1 else 1


def parallel_problems(plan: Plan, card: ModelCard) -> list[str]:
    """What about the plan's parallel sizes the model cannot take (empty when all divide):

    - tensor must divide the attention heads (vLLM's ModelConfig.verify_with_parallel_config refuses);
    - pipeline may not exceed the layers (vLLM splits uneven counts, vllm/distributed/utils.py
      get_pp_indices, so an uneven split is counted, not refused);
    - SGLang's --ep-size must divide the experts (srt/layers/moe/fused_moe_triton/layer.py asserts
      num_experts % moe_ep_size == 0) and the tensor size, as must --dp-size with DP attention.
      vLLM's determine_expert_map hands the remainder to the first ranks, so an uneven vLLM split is
      counted (the fullest rank), not refused; more EP ranks than experts is refused for both.
    """
    par, problems = plan.parallelism, []
    heads, layers = int(card.assumptions.attention_heads.value), int(card.assumptions.layers.value)
    if heads % par.tensor:
        problems.append(f"tensor {par.tensor} does not divide the {heads} attention heads (assumed)")
    if par.pipeline > layers:
        problems.append(f"pipeline {par.pipeline} exceeds the {layers} layers (assumed)")
    ep = expert_parallel_size(plan)
    if ep > card.experts:
        problems.append(f"the expert-parallel group of {ep} exceeds the {card.experts} experts")
    if plan.engine.kind == "sglang":
        if card.experts % ep:
            problems.append(f"expert {ep} does not divide the {card.experts} experts (SGLang needs equal shares)")
        if par.tensor % ep:
            problems.append(f"expert {ep} does not divide tensor {par.tensor} (SGLang's MoE TP = tp / ep)")
        if par.data > 1 and par.tensor % par.data:
            problems.append(f"data {par.data} does not divide tensor {par.tensor} (SGLang's DP attention)")
    return problems


def check_plan_against_card(loaded: LoadedPlan) -> None:
    """Refuse (PlanError naming the file) a plan the model or its checkpoint cannot serve: a context above
    the model's maximum, parallel sizes that do not divide (parallel_problems), a precision other than
    the checkpoint's (--dtype does not dequantize), a forced --quantization the checkpoint does not declare."""
    plan, card, path = loaded.plan, loaded.card, loaded.path
    problems = []
    if plan.max_context_tokens > card.max_context_tokens:
        problems.append(f"max_context_tokens {plan.max_context_tokens:,} exceeds {card.name}'s maximum of "
                        f"{card.max_context_tokens:,} tokens")
    problems += [f"parallelism: {p}" for p in parallel_problems(plan, card)]
    checkpoint = loaded.checkpoint()
    engine = plan.engine
    if engine.precision != checkpoint.precision:
        problems.append(f"engine.precision {engine.precision}, but {checkpoint.path} holds {checkpoint.precision} "
                        f"weights ({checkpoint.source}); the engines load a checkpoint as stored (--dtype does not "
                        f"dequantize): point engine.model_path at a {engine.precision} checkpoint")
    if engine.precision not in card.precisions:
        problems.append(f"engine.precision {engine.precision}: the model card has no bytes per parameter for it")
    if engine.quantization is not None and engine.quantization != checkpoint.quant_method:
        declared = checkpoint.quant_method or "no quantization"
        problems.append(f"engine.quantization {engine.quantization!r}, but {checkpoint.path} declares {declared}: "
                        "vLLM and SGLang refuse a --quantization that differs from the checkpoint's "
                        "quantization_config; leave engine.quantization unset so the engine detects it")
    if problems:
        raise PlanError(f"{path}: " + "; ".join(problems))


def stage_layers(plan: Plan, card: ModelCard) -> int:
    """Layers of the largest pipeline stage (vLLM gives the remainder of an uneven split to some stages)."""
    return math.ceil(card.assumptions.layers.value / plan.parallelism.pipeline)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise PlanError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{path}: the top level must be a mapping")
    return data


def _explain(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors())


def load_model_card(path: str | Path) -> ModelCard:
    """Read a model card YAML. Raises PlanError naming the file and the offending field."""
    path = Path(path)
    try:
        return ModelCard.model_validate(_read_yaml(path))
    except ValidationError as exc:
        raise PlanError(f"{path}: {_explain(exc)}") from None


def is_plan_data(data: dict[str, Any]) -> bool:
    """True for a parsed plan file (it has `hardware:`), False for a gateway config (`pools:`)."""
    return "hardware" in data and "pools" not in data


def load_plan(path: str | Path) -> LoadedPlan:
    """Read a plan file and its model card. Raises PlanError naming the file and the offending field."""
    path = Path(path)
    try:
        plan = Plan.model_validate(_read_yaml(path))
    except ValidationError as exc:
        raise PlanError(f"{path}: {_explain(exc)}") from None
    loaded = LoadedPlan(path=path, plan=plan, card=load_model_card(path.parent / plan.model))
    check_plan_against_card(loaded)
    return loaded


def plan_refs(data: dict[str, Any], base_dir: Path) -> list[Path]:
    """Paths of the plans a parsed gateway config's `pools: - plan: FILE` entries name, in pool order."""
    pools = data.get("pools")
    if not isinstance(pools, list):
        return []
    return [base_dir / item["plan"] for item in pools if isinstance(item, dict) and "plan" in item]


def expand_plan_refs(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """Replace each `pools:` entry `{plan: FILE, ...}` with the pool the plan defines.

    FILE is relative to `base_dir` (the config file's directory). Other keys of the entry override
    the plan's gateway-only defaults (policy, limits, default_output_tokens...); a key the plan
    decides (DERIVED_POOL_FIELDS) is refused so nothing is typed twice. Raises PlanError.
    """
    pools = data.get("pools")
    if not isinstance(pools, list) or not any(isinstance(p, dict) and "plan" in p for p in pools):
        return data
    expanded: list[Any] = []
    for index, item in enumerate(pools):
        if not (isinstance(item, dict) and "plan" in item):
            expanded.append(item)
            continue
        if not isinstance(item["plan"], str):
            raise PlanError(f"pools.{index}.plan: must be a path to a plan file")
        twice = sorted(set(item) & set(DERIVED_POOL_FIELDS))
        if twice:
            raise PlanError(f"pools.{index}: {', '.join(twice)} come(s) from the plan {item['plan']}; "
                            "set them there, not here")
        loaded = load_plan(base_dir / item["plan"])
        overrides = {k: v for k, v in item.items() if k != "plan"}
        flow = overrides.get("flow_control")
        if flow is not None and (loaded.plan.pool.flow_control is not None
                                 or (isinstance(flow, dict) and flow.get("engine_priority"))):
            raise PlanError(f"pools.{index}: flow_control comes from the plan {item['plan']} when it sets one or "
                            "turns engine_priority on (its engines' launch flags follow it); set it in the plan's "
                            "`pool:`")
        expanded.append({**loaded.plan.gateway_pool(), **overrides})
    return {**data, "pools": expanded}
