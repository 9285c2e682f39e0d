"""Plan files and the model card as pydantic models; loading them; a gateway pool derived from a plan.

A plan (`config/plans/*.yaml`) is the one place a deployment's facts are typed: hardware, engine,
parallelism, precision, max context, replicas, port, served model name and the engine's API key
variable. The gateway's pool (`pools: - plan: plans/plan-a.yaml` in a gateway config), the engine
launch scripts (`kimi-gateway plan FILE --emit DIR`) and the capacity report all read it. The model
card (`config/models/kimi-k3.yaml`) holds the model's sizes and the planner's labelled assumptions.

This package stays off the request path: the gateway imports it only while loading a config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Precision = Literal["bf16", "mxfp8", "mxfp4"]
PlanEngine = Literal["vllm", "sglang", "ascend"]
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

    kv_bytes_per_token: Assumption
    state_bytes_per_sequence: Assumption
    activation_reserve_bytes_per_device: Assumption
    mla_kv_replicated_across_tp: Assumption


class ModelCard(_Strict):
    """The served model's sizes (`config/models/kimi-k3.yaml`): parameters, experts, bytes per parameter."""

    name: str
    repo: str
    source: str
    parameters: int = Field(gt=0)
    experts: int = Field(gt=0)
    active_experts: int = Field(gt=0)
    active_parameters: int = Field(gt=0)
    bytes_per_param: dict[Precision, float]
    assumptions: ModelAssumptions

    def weight_bytes(self, precision: Precision) -> float:
        """Bytes of weights at `precision` (parameters x bytes per parameter)."""
        return self.parameters * self.bytes_per_param[precision]


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


class EngineSpec(_Strict):
    """The engine server: kind, model, precision and how it is exposed."""

    kind: PlanEngine
    model_path: str = Field(min_length=1, description="Hugging Face repo or local path of the weights")
    served_model_name: str = Field(min_length=1)
    precision: Precision
    quantization: str | None = Field(
        default=None, description="the engine's --quantization value; None: derived from precision "
        "(mxfp4 -> mxfp4, bf16 -> none with --dtype bfloat16)",
    )
    memory_utilization: float = Field(
        gt=0, le=1, description="vLLM --gpu-memory-utilization / SGLang --mem-fraction-static"
    )
    memory_utilization_source: str = Field(default="the guide", description="where memory_utilization comes from")
    port: int = Field(ge=1, le=65535)
    api_key_env: str | None = Field(default=None, pattern=_ENV_NAME, description="variable holding the engine key")
    chunked_prefill: bool = False
    trust_remote_code: bool = True
    extra_args: list[str] = Field(default_factory=list, description="further engine flags, passed as given")

    @model_validator(mode="after")
    def _quantization_known(self) -> EngineSpec:
        if self.precision == "mxfp8" and self.quantization is None:
            raise ValueError("precision mxfp8 needs an explicit engine.quantization (the engine's flag value)")
        return self

    def quantization_flag(self) -> str | None:
        """The --quantization value to pass, or None for unquantized (BF16) weights."""
        if self.quantization is not None:
            return self.quantization
        return "mxfp4" if self.precision == "mxfp4" else None


class GatewayPoolSpec(_Strict):
    """The gateway side of the plan: the pool's name and its gateway-only defaults."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    default_output_tokens: int = Field(default=1024, ge=0)
    modalities: list[Modality] = Field(default_factory=lambda: ["text", "image"])
    spillover: bool = True
    worker_env: str | None = Field(
        default=None, pattern=_ENV_NAME,
        description="prefix of the worker URL variables (PREFIX_0, PREFIX_1...); default: the pool name in "
        "upper case with - and . as _, plus _WORKER",
    )
    worker_host: str = Field(
        default="{pool}-{index}", description="host a worker URL falls back to; {pool} and {index} are filled in"
    )


class Plan(_Strict):
    """One K3 deployment plan (`config/plans/*.yaml`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    title: str
    source: str = Field(description="where the plan's facts come from")
    model: str = Field(default="../models/kimi-k3.yaml", description="model card path, relative to the plan file")
    hardware: Hardware
    parallelism: Parallelism
    engine: EngineSpec
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
        return pool


class LoadedPlan(BaseModel):
    """A plan with its file's path and its model card."""

    model_config = ConfigDict(frozen=True)

    path: Path
    plan: Plan
    card: ModelCard


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
    return LoadedPlan(path=path, plan=plan, card=load_model_card(path.parent / plan.model))


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
        expanded.append({**loaded.plan.gateway_pool(), **overrides})
    return {**data, "pools": expanded}
