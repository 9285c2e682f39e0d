"""A pool's config section (pydantic models): `PoolConfig`, its prefill/decode split and the PD
protocol tables. A pool's `policy_params` are checked with the policy's own model, which lives with
the policy: `gateway.routing.registry.POLICY_PARAMS` is this module's one import of code beyond the
schema (the allowed arrow of tests/unit/test_package_imports.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator

from gateway.backends.params import DiscoverConfig, EngineKind, LoraModule, Modality, clean_worker_urls
from gateway.config_base import Section, explain_validation_error
from gateway.dialects.names import CHAT, COMPLETIONS, Api
from gateway.flow.params import PoolFlowConfig
from gateway.routing.registry import POLICY_PARAMS

PdMode = Literal["sglang", "vllm-nixl", "vllm-mooncake"]
"""A prefill/decode protocol: SGLang's bootstrap rooms, vLLM's NixlConnector or MooncakeConnector
(the wire protocol: gateway/protocol/pd.py; the dispatch side: gateway/dispatch/pd/)."""


PD_APIS = frozenset({CHAT, COMPLETIONS})
"""The APIs a prefill/decode pool serves: those whose two legs the peer routers (sglang-router,
vllm-router) send and tests/integration/test_pd_wire.py checks. Other requests (Anthropic Messages,
count_tokens, Responses) go to the other fitting pools (`x-kimi-gateway-skipped-pools` names the PD pool)."""


PD_ENGINES: dict[str, tuple[str, ...]] = {"sglang": ("sglang",), "vllm-nixl": ("vllm", "ascend"),
                                          "vllm-mooncake": ("vllm", "ascend")}
"""The engine kinds that speak each PD protocol."""


class PrefillWorkerConfig(Section):
    """A prefill worker of a PD pool: its base URL and, for SGLang and vLLM Mooncake, the port of
    its bootstrap server (SGLang `--disaggregation-bootstrap-port`, vLLM
    `VLLM_MOONCAKE_BOOTSTRAP_PORT`; 8998 by default in both); for vLLM NIXL, where its KV handles
    may point (`side_channel_host`, `side_channel_port`: `NixlAttempt` refuses a handle naming
    another host or port). A bare URL string is accepted."""

    url: str = Field(description="the prefill worker's base URL (`http://host:port`)")
    bootstrap_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="SGLang and vLLM Mooncake: its bootstrap server's port (null: the engine's default, 8998)")
    side_channel_host: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="vLLM NIXL: the host its KV handles name (`remote_host`, the engine's "
        "VLLM_NIXL_SIDE_CHANNEL_HOST); null: the host of `url`. A handle naming another host fails the attempt")
    side_channel_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="vLLM NIXL: the port its KV handles name (`remote_port`, VLLM_NIXL_SIDE_CHANNEL_PORT, 5600 by "
        "default); null: not checked")

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        return clean_worker_urls([url])[0]


class DisaggregationConfig(Section):
    """A prefill/decode (PD) pool's two worker groups and how requests are split between them.

    Every request takes one prefill and one decode worker: `prefill_policy` picks the prefill worker
    (default `prefix_affinity`: the prefix cache lives on the prefill workers), `decode_policy` the
    decode worker (default `least_load`: decode is bound by running requests and KV memory). The
    per-worker limits count this replica's requests on one worker of each role (None: the pool's
    `max_in_flight_per_worker`); the pool's `max_in_flight` counts requests, not legs.
    """

    mode: PdMode = Field(description="the PD protocol: SGLang's bootstrap rooms, vLLM's NixlConnector or "
                         "MooncakeConnector")
    prefill: list[PrefillWorkerConfig] = Field(min_length=1)
    decode: list[str] = Field(min_length=1, description="decode worker base URLs")
    prefill_policy: str = Field(default="prefix_affinity", description="the policy that picks the prefill worker")
    prefill_policy_params: dict[str, Any] = Field(default_factory=dict, description="its parameters")
    decode_policy: str = Field(default="least_load", description="the policy that picks the decode worker")
    decode_policy_params: dict[str, Any] = Field(default_factory=dict, description="its parameters")
    prefill_max_in_flight_per_worker: int | None = Field(
        default=None, ge=1, description="this replica's requests on one prefill worker at most (null: the pool's "
        "`max_in_flight_per_worker`)")
    decode_max_in_flight_per_worker: int | None = Field(
        default=None, ge=1, description="this replica's requests on one decode worker at most (null: the pool's "
        "`max_in_flight_per_worker`)")

    @field_validator("decode")
    @classmethod
    def _check_decode(cls, urls: list[str]) -> list[str]:
        return clean_worker_urls(urls)

    @model_validator(mode="after")
    def _check(self) -> DisaggregationConfig:
        prefill = clean_worker_urls([p.url for p in self.prefill])  # unique among themselves
        both = set(prefill) & set(self.decode)
        if both:
            raise ValueError(f"a worker is either prefill or decode, not both: {sorted(both)}")
        for worker in self.prefill:
            url = worker.url
            if self.mode in ("sglang", "vllm-mooncake") and worker.bootstrap_port is None:
                server = "--disaggregation-bootstrap-port" if self.mode == "sglang" else "VLLM_MOONCAKE_BOOTSTRAP_PORT"
                raise ValueError(f"prefill worker {url}: mode {self.mode} needs its bootstrap_port (the {server} "
                                 "it serves; 8998 by default)")
            if self.mode == "vllm-nixl" and worker.bootstrap_port is not None:
                raise ValueError(f"prefill worker {url}: bootstrap_port is for modes sglang and vllm-mooncake; "
                                 "NIXL finds the KV through the prefill answer's kv_transfer_params")
            if self.mode != "vllm-nixl" and (worker.side_channel_host, worker.side_channel_port) != (None, None):
                raise ValueError(f"prefill worker {url}: side_channel_host and side_channel_port are for mode "
                                 "vllm-nixl (the host and port its KV handles name)")
        for role, name, params in (("prefill", self.prefill_policy, self.prefill_policy_params),
                                   ("decode", self.decode_policy, self.decode_policy_params)):
            _check_policy(name, params, f"{role}_policy")
        return self


def _check_policy(name: str, params: dict[str, Any], what: str = "policy") -> None:
    """Raise ValueError for an unknown policy name or parameters its model refuses."""
    model = POLICY_PARAMS.get(name)
    if model is None:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(POLICY_PARAMS))}")
    try:
        model.model_validate(params)
    except ValidationError as exc:
        raise ValueError(f"for {what} {name}: {explain_validation_error(exc)}") from None


class PoolConfig(Section):
    """A pool: interchangeable workers of one engine kind that share a max context.

    `workers` are engine base URLs (`http://host:port`, no `/v1`); `discover` adds the workers a
    DNS name resolves to, re-resolved every `discovery.interval` seconds. Pools are listed in cost
    order, cheapest first; the gateway takes the cheapest pool whose `max_context_tokens` fits
    prompt + output tokens.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the pool's name (logs, metrics, admin API)")
    engine: EngineKind = Field(description="the engine its workers run (health probe, metrics, dialect quirks)")
    disaggregation: DisaggregationConfig | None = Field(
        default=None, description="prefill/decode workers and protocol (a PD pool; `workers` stays empty)")
    discover: DiscoverConfig | None = Field(default=None, description="workers from DNS (headless Service)")
    workers: list[str] = Field(default_factory=list, validate_default=True,
                               description="engine base URLs; may be empty with `discover`")
    max_context_tokens: int = Field(gt=0, description="tokens, prompt + output")
    served_model_name: str | None = Field(
        default=None, min_length=1, description="name the engines serve the model under; `model` is rewritten to it"
    )
    lora_adapters: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, description="LoRA adapter names its engines serve (vLLM `--lora-modules`, SGLang "
        "`--lora-paths`): a request naming one goes to this pool's workers with the adapter's name as `model`. "
        "Adapters its workers list in /v1/models (`parent` set) are found without it (`health.verify_models`)")
    lora_on_demand: list[LoraModule] = Field(
        default_factory=list, description="LoRA adapters loaded on a worker when a request names one no worker "
        "has (vLLM's POST /v1/load_lora_adapter, which needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; SGLang's "
        "POST /load_lora_adapter, which needs --enable-lora); also written in `lora_adapters` as "
        "{name, path, load_on_demand: true}")
    max_loras: int | None = Field(
        default=None, ge=1, description="on-demand adapters this gateway loads on one worker at most (keep it "
        "within vLLM's --max-cpu-loras, SGLang's --max-loaded-loras less its --lora-paths); None: no bound")
    lora_evict: Literal["never", "lru"] = Field(
        default="never", description="when every candidate worker has its max_loras on-demand adapters (or "
        "SGLang refuses a load for its --max-loaded-loras): `never` answers 503; `lru` unloads, on the "
        "least-loaded such worker, the pool's on-demand adapter used least recently there (by any replica: "
        "shared through Redis with `redis_url`, gateway/backends/lora_slots.py), with no request in flight "
        "on it, then loads the new one. `never` by default: a working set larger than the slots makes "
        "every request reload an adapter")
    modalities: list[Modality] = Field(
        default_factory=lambda: ["text", "image"],
        description="input kinds its model takes; a request holding another kind is not sent here")
    apis: list[Api] | None = Field(
        default=None, description="the proxied APIs its engines serve; null: what its engine kind serves in the "
        "versions the gateway knows (gateway/backends/engine_kinds.py: never the pooling APIs embeddings, rerank "
        "and score); set it for an older engine version, or for a pool of a pooling model")
    default_output_tokens: int = Field(
        default=1024, ge=0, description="tokens reserved for output when the request sets no max_tokens"
    )
    spillover: bool = Field(default=True, description="may spill to the next larger pool when down")
    migrate: bool = Field(
        default=True,
        description="a stream whose worker fails after content reached the client goes on on another worker of "
        "this pool (a PD pool: another prefill/decode pair) from the text so far (`migration:`, "
        "gateway/dispatch/migration.py); false: such a stream ends with one SSE error event, as before migration")
    policy: str = Field(
        default="ttft_cost", description="the routing policy (gateway/routing/policies/; docs/routing.md): "
        "ttft_cost, the lowest predicted time to first token, is the default since 2026-12-03 (prefix_affinity "
        "before: loadtest/README.md \"Latest results\" says why)")
    policy_params: dict[str, Any] = Field(default_factory=dict, description="the policy's own parameters")
    api_key: SecretStr | None = Field(default=None, description="bearer credential sent to the engines")
    max_in_flight_per_worker: int | None = Field(
        default=None, ge=1, description="requests this replica sends one worker at once (None: no limit)"
    )
    max_in_flight: int | None = Field(default=None, ge=1, description="requests in the whole pool at once")
    max_queue: int = Field(default=256, ge=0, description="requests that may wait for a free slot")
    queue_timeout: float = Field(default=10.0, ge=0, description="seconds a request may wait for a slot")
    flow_control: PoolFlowConfig = Field(
        default_factory=PoolFlowConfig, description="hold new requests at the gateway while the pool's workers are "
        "saturated, released by priority band and fairly across flows (docs/flow-control.md); off by default")
    upstream_keep_alive: float = Field(
        default=4.0, gt=0,
        description="seconds an idle connection to this pool's engines is kept for reuse; keep it below the "
        "engines' own idle keep-alive (5 s: uvicorn's default, which vLLM and SGLang run with, and llama.cpp's) "
        "so the gateway never sends a request on a connection the engine is closing",
    )
    allow_kv_transfer_fields: bool = Field(
        default=False,
        description="pass a client's kv_transfer_params, bootstrap_host, bootstrap_port and bootstrap_room on to "
        "this pool's workers (a trusted client running its own prefill/decode hand-off); off: the gateway strips "
        "them, since they make a worker with a KV connector pull or push KV cache from a host the client names. "
        "Never on a PD pool (it sets its own)",
    )

    @model_validator(mode="before")
    @classmethod
    def _on_demand_entries(cls, data: Any) -> Any:
        """`lora_adapters` entries written `{name, path, load_on_demand}`: on demand ones move to
        `lora_on_demand`, the others stay as their name."""
        entries = data.get("lora_adapters") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not any(isinstance(e, dict) for e in entries):
            return data
        names, on_demand = [], list(data.get("lora_on_demand") or [])
        for entry in entries:
            if isinstance(entry, dict) and entry.get("load_on_demand"):
                on_demand.append({k: v for k, v in entry.items() if k != "load_on_demand"})
            elif isinstance(entry, dict):
                names.append(entry.get("name"))
            else:
                names.append(entry)
        return {**data, "lora_adapters": names, "lora_on_demand": on_demand}

    @model_validator(mode="after")
    def _check_on_demand(self) -> PoolConfig:
        if not self.lora_on_demand:
            return self
        if self.engine not in ("vllm", "ascend", "sglang") or self.disaggregation is not None:
            raise ValueError("lora_on_demand needs an aggregated vllm, ascend or sglang pool (their runtime "
                             "load endpoints: vLLM's /v1/load_lora_adapter, SGLang's /load_lora_adapter); "
                             "declare the adapters the engines load at start in `lora_adapters`")
        names = [m.name for m in self.lora_on_demand]
        if len(set(names)) != len(names) or set(names) & set(self.lora_adapters):
            raise ValueError(f"LoRA adapter names must be distinct across lora_adapters and lora_on_demand, "
                             f"got {self.lora_adapters} and {names}")
        return self

    def adapter_path(self, name: str) -> str | None:
        """The path of on-demand LoRA adapter `name`, None when it is not one."""
        return next((m.path for m in self.lora_on_demand if m.name == name), None)

    @field_validator("workers")
    @classmethod
    def _check_urls(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        if not urls and info.data.get("discover") is None and info.data.get("disaggregation") is None:
            raise ValueError("a pool needs at least one worker URL, or `discover` (workers from DNS), or "
                             "`disaggregation` (prefill and decode workers)")
        return clean_worker_urls(urls)

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICY_PARAMS:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICY_PARAMS))}")
        return name

    @field_validator("policy_params")
    @classmethod
    def _valid_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("policy", "")
        model = POLICY_PARAMS.get(name)
        if model is not None:
            try:
                model.model_validate(params)
            except ValidationError as exc:
                raise ValueError(f"for policy {name}: {explain_validation_error(exc)}") from None
        return params

    @model_validator(mode="after")
    def _check_disaggregation(self) -> PoolConfig:
        pd = self.disaggregation
        if pd is None:
            return self
        if self.workers or self.discover is not None:
            raise ValueError("a PD pool's workers are its disaggregation.prefill and .decode lists; "
                             "leave `workers` and `discover` out")
        if self.engine not in PD_ENGINES[pd.mode]:
            raise ValueError(f"disaggregation mode {pd.mode} needs engine {' or '.join(PD_ENGINES[pd.mode])}, "
                             f"not {self.engine}")
        if self.apis is not None and set(self.apis) - PD_APIS:
            raise ValueError(f"a PD pool serves only {' and '.join(sorted(PD_APIS))} (the APIs of its two-leg "
                             f"protocols), not {', '.join(sorted(set(self.apis) - PD_APIS))}")
        if {"policy", "policy_params"} & self.model_fields_set:
            raise ValueError("a PD pool has two policies: set disaggregation.prefill_policy and "
                             "disaggregation.decode_policy instead of `policy`")
        if self.allow_kv_transfer_fields:
            raise ValueError("allow_kv_transfer_fields is for aggregated pools: a PD pool sets kv_transfer_params "
                             "and the bootstrap fields of both legs itself")
        return self

    def pd_workers(self) -> list[tuple[str, str | None, int | None]]:
        """(URL, role, bootstrap port) of every static worker: role None for an aggregated pool's,
        "prefill" / "decode" for a PD pool's (prefill first)."""
        pd = self.disaggregation
        if pd is None:
            return [(url, None, None) for url in self.workers]
        return ([(p.url, "prefill", p.bootstrap_port) for p in pd.prefill]
                + [(url, "decode", None) for url in pd.decode])
