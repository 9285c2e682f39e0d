"""The gateway's configuration: pydantic models of the YAML file, `${ENV}` interpolation, env overrides.

A config file is YAML whose string values may say `${NAME}` or `${NAME:-default}` (secrets, worker
URLs); top-level fields can also be overridden with `KIMI_GATEWAY_<FIELD>` variables (e.g.
`KIMI_GATEWAY_REDIS_URL`, `KIMI_GATEWAY_PORT`; sections and lists as JSON). Both read one explicit
mapping, the `environ` argument of `parse_config`/`load_config`: the command line passes
`os.environ`, tests pass their own, and nothing here reads the process environment behind it.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.dialects.names import CHAT, COMPLETIONS, Api

EngineKind = Literal["vllm", "sglang", "ascend", "llamacpp"]
Modality = Literal["text", "image", "audio", "video", "file"]

ENV_PREFIX = "KIMI_GATEWAY_"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """The one model the gateway serves and the names clients may call it by."""

    name: str = Field(default="kimi-k3", min_length=1)
    aliases: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["Kimi-K3", "moonshotai/Kimi-K3"])
    owned_by: str = "moonshotai"

    @model_validator(mode="after")
    def _distinct_names(self) -> ModelConfig:
        if len(set(self.names())) != len(self.names()):
            raise ValueError(f"model name and aliases must differ, got {self.names()}")
        return self

    def names(self) -> list[str]:
        """The canonical name first, then the aliases."""
        return [self.name, *self.aliases]


class DiscoverConfig(_Strict):
    """A pool's workers found in DNS, e.g. a Kubernetes headless Service (gateway/backends/discovery.py).

    `record: a` asks for the name's A and AAAA records (one worker per address, on `port`);
    `record: srv` asks for SRV records (RFC 2782: target host and port per worker; each target's
    A/AAAA addresses), e.g. `_http._tcp.vllm.k3.svc.cluster.local` for a named Service port.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,253}$", description="DNS name to resolve")
    record: Literal["a", "srv"] = Field(default="a", description="a: A + AAAA records; srv: SRV records")
    port: int | None = Field(default=None, ge=1, le=65535, description="the engines' port (record: a)")
    scheme: Literal["http", "https"] = "http"

    @model_validator(mode="after")
    def _port_for_a(self) -> DiscoverConfig:
        if self.record == "a" and self.port is None:
            raise ValueError("record: a needs a port (SRV records carry their own)")
        if self.record == "srv" and self.port is not None:
            raise ValueError("record: srv takes the port from the SRV records; drop `port`")
        return self


class NoPolicyParams(_Strict):
    """`policy_params` of a policy without parameters: any key is an error."""


class PrefixAffinityParams(_Strict):
    """`policy_params` of `prefix_affinity` (gateway/routing/policies/prefix_affinity.py)."""

    min_match_tokens: int = Field(default=1024, ge=0, description="tokens; a shorter cached prefix does not count")
    min_match_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of the prompt a cached prefix must cover to count")
    balance_abs: float = Field(
        default=8.0, ge=0.0, description="requests the affinity worker may carry beyond the least-loaded one")
    balance_rel: float = Field(
        default=1.5, ge=1.0, description="...and times the least-loaded one's load (both must be exceeded)")
    kv_usage_max: float = Field(
        default=0.95, gt=0.0, le=1.0, description="KV-cache usage above which the affinity worker is skipped")


class PowerOfTwoParams(_Strict):
    """`policy_params` of `power_of_two` (gateway/routing/policies/power_of_two.py)."""

    seed: int | None = Field(default=None, description="random seed for a reproducible sequence; null: random")


class TtftCostParams(_Strict):
    """`policy_params` of `ttft_cost` (gateway/routing/policies/ttft_cost.py; the rate estimate:
    gateway/routing/prefill.py). Tokens are the gateway's estimated prompt tokens."""

    prior_rate: float = Field(
        default=10_000.0, gt=0, description="tokens/s; a worker's prefill rate before (and long after) any "
        "observation: an order of magnitude for one 8-GPU node of a large MoE model, replaced by measurement")
    min_rate: float = Field(default=100.0, gt=0, description="tokens/s; the estimate never goes below")
    max_rate: float = Field(default=1_000_000.0, gt=0, description="tokens/s; ...nor above")
    half_life_s: float = Field(
        default=30.0, gt=0, description="seconds after which an observation counts half: the estimate follows "
        "a worker that slows down or recovers, and one that gets no traffic returns to its pool's rate (a pool "
        "with none to `prior_rate`)")
    prior_tokens: float = Field(
        default=4096.0, gt=0, description="tokens; the prior weighs as much as this much prefill observed at "
        "`prior_rate`")
    request_tokens: float = Field(
        default=1024.0, ge=0, description="tokens of prefill work one engine-reported request that this replica "
        "did not send stands for, until this replica's own requests to the worker give a mean")
    tie_tolerance: float = Field(
        default=0.1, ge=0, description="predicted TTFTs within this fraction of the lowest are equal; among them "
        "the longest cached prefix wins")
    prefix_value: float = Field(
        default=20.0, ge=0, description="the cache owner (longest match) keeps the request while its predicted "
        "TTFT exceeds the lowest by less than this many times the owner's prefill time of the matched prefix "
        "(plus `stay_s`): moving recomputes the prefix elsewhere and leaves the owner's copy unused")
    stay_s: float = Field(default=0.0, ge=0, description="seconds of predicted TTFT the cache owner may exceed "
                          "the lowest by and keep the request (with `prefix_value`)")
    owner_min_tokens: int = Field(
        default=1024, ge=0, description="tokens; a shorter longest match makes no cache owner for `stay_s` and "
        "`prefix_value` (a system prompt shared by all must not pin traffic)")
    base_ttft_s: float = Field(
        default=0.0, ge=0, description="seconds of every TTFT that no prefill explains (network, scheduling, "
        "the first decode step), taken off each observation before the rate is fitted")

    @model_validator(mode="after")
    def _ordered(self) -> TtftCostParams:
        if not self.min_rate <= self.prior_rate <= self.max_rate:
            raise ValueError("want min_rate <= prior_rate <= max_rate")
        return self


POLICY_PARAMS: dict[str, type[BaseModel]] = {
    "prefix_affinity": PrefixAffinityParams,
    "ttft_cost": TtftCostParams,
    "least_load": NoPolicyParams,
    "power_of_two": PowerOfTwoParams,
    "round_robin": NoPolicyParams,
    "session": NoPolicyParams,
}
"""Every routing policy's name → the model of its `policy_params`. The policies live in
gateway/routing/policies/ and take their parameter models from here (so config imports no routing
code); gateway/routing/registry.py checks at import that both name the same policies."""


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


def clean_worker_urls(urls: list[str]) -> list[str]:
    """Worker base URLs checked (http(s)://host:port, no credentials, query or fragment, a valid
    port) and without a trailing slash. Raises ValueError naming the offending URL."""
    cleaned = []
    for url in urls:
        if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
            raise ValueError(f"worker URL must be http(s)://host:port, got {url!r}")
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"worker URL {parts.hostname!r}: no credentials in the URL (they would show in "
                             "/admin/workers); use the pool's api_key")
        if parts.query or parts.fragment or "?" in url or "#" in url:
            raise ValueError(f"worker URL must not have a query or fragment, got {url!r}")
        try:
            parts.port  # noqa: B018 (raises ValueError when out of range)
        except ValueError:
            raise ValueError(f"worker URL has an invalid port, got {url!r}") from None
        cleaned.append(url.rstrip("/"))
    if len(set(cleaned)) != len(cleaned):
        raise ValueError("worker URLs must be unique within a pool")
    return cleaned


class PrefillWorkerConfig(_Strict):
    """A prefill worker of a PD pool: its base URL and, for SGLang and vLLM Mooncake, the port of
    its bootstrap server (SGLang `--disaggregation-bootstrap-port`, vLLM
    `VLLM_MOONCAKE_BOOTSTRAP_PORT`; 8998 by default in both); for vLLM NIXL, where its KV handles
    may point (`side_channel_host`, `side_channel_port`: `NixlAttempt` refuses a handle naming
    another host or port). A bare URL string is accepted."""

    url: str
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
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


class DisaggregationConfig(_Strict):
    """A prefill/decode (PD) pool's two worker groups and how requests are split between them.

    Every request takes one prefill and one decode worker: `prefill_policy` picks the prefill worker
    (default `prefix_affinity`: the prefix cache lives on the prefill workers), `decode_policy` the
    decode worker (default `least_load`: decode is bound by running requests and KV memory). The
    per-worker limits count this replica's requests on one worker of each role (None: the pool's
    `max_in_flight_per_worker`); the pool's `max_in_flight` counts requests, not legs.
    """

    mode: PdMode
    prefill: list[PrefillWorkerConfig] = Field(min_length=1)
    decode: list[str] = Field(min_length=1, description="decode worker base URLs")
    prefill_policy: str = "prefix_affinity"
    prefill_policy_params: dict[str, Any] = Field(default_factory=dict)
    decode_policy: str = "least_load"
    decode_policy_params: dict[str, Any] = Field(default_factory=dict)
    prefill_max_in_flight_per_worker: int | None = Field(default=None, ge=1)
    decode_max_in_flight_per_worker: int | None = Field(default=None, ge=1)

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


class LoraModule(_Strict):
    """A LoRA adapter a pool's workers load on demand: its name (the request's `model`) and the
    path the engine loads it from (vLLM's `lora_path`: a directory on the engine's host, or a
    Hugging Face repo id with a resolver)."""

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)


class PoolConfig(_Strict):
    """A pool: interchangeable workers of one engine kind that share a max context.

    `workers` are engine base URLs (`http://host:port`, no `/v1`); `discover` adds the workers a
    DNS name resolves to, re-resolved every `discovery.interval` seconds. Pools are listed in cost
    order, cheapest first; the gateway takes the cheapest pool whose `max_context_tokens` fits
    prompt + output tokens.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    engine: EngineKind
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
        "has (vLLM's POST /v1/load_lora_adapter, which needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); also "
        "written in `lora_adapters` as {name, path, load_on_demand: true}")
    max_loras: int | None = Field(
        default=None, ge=1, description="on-demand adapters this gateway loads on one worker at most (keep it "
        "within the engine's --max-cpu-loras); None: no bound")
    modalities: list[Modality] = Field(default_factory=lambda: ["text", "image"])
    apis: list[Api] | None = Field(
        default=None, description="the proxied APIs its engines serve; null: what its engine kind serves in the "
        "versions the gateway knows (gateway/backends/engine_kinds.py); set it for an older engine version")
    default_output_tokens: int = Field(
        default=1024, ge=0, description="tokens reserved for output when the request sets no max_tokens"
    )
    spillover: bool = Field(default=True, description="may spill to the next larger pool when down")
    policy: str = "prefix_affinity"
    policy_params: dict[str, Any] = Field(default_factory=dict, description="the policy's own parameters")
    api_key: SecretStr | None = Field(default=None, description="bearer credential sent to the engines")
    max_in_flight_per_worker: int | None = Field(
        default=None, ge=1, description="requests this replica sends one worker at once (None: no limit)"
    )
    max_in_flight: int | None = Field(default=None, ge=1, description="requests in the whole pool at once")
    max_queue: int = Field(default=256, ge=0, description="requests that may wait for a free slot")
    queue_timeout: float = Field(default=10.0, ge=0, description="seconds a request may wait for a slot")
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
        if self.engine not in ("vllm", "ascend") or self.disaggregation is not None:
            raise ValueError("lora_on_demand needs an aggregated vllm or ascend pool (vLLM's runtime "
                             "/v1/load_lora_adapter); declare the adapters the engines load at start in "
                             "`lora_adapters`")
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


class TimeoutConfig(_Strict):
    """Timeouts, in seconds: upstream ones, the client's upload (`body_idle`) and the overall cap."""

    connect: float = Field(default=5.0, gt=0)
    read: float = Field(default=120.0, gt=0, description="longest allowed gap between upstream bytes")
    write: float = Field(default=30.0, gt=0)
    first_byte_base: float = Field(
        default=60.0, gt=0, description="streaming: budget for the engine's first content (prefill) for a short prompt"
    )
    first_byte_per_1k_tokens: float = Field(
        default=0.5, ge=0, description="extra first-byte budget per 1,000 estimated prompt tokens (prefill)"
    )
    response_header: float = Field(
        default=30.0, gt=0,
        description="streaming: seconds for an engine's response headers, which vLLM, SGLang and llama.cpp send "
        "once the request is tokenized, before the prefill. A worker that sent no headers is not generating: the "
        "request moves to another worker and the timeout counts toward the worker's outlier ejection",
    )
    prefill_first_byte: float | None = Field(
        default=None, gt=0,
        description="PD pools: seconds a prefill worker may take to answer its leg (the prompt's KV cache and one "
        "token; its headers come with that answer) for a short prompt, plus `first_byte_per_1k_tokens` per 1,000 "
        "prompt tokens, whether the client streams or not. A prefill worker that has not answered by then fails "
        "the attempt against it (it counts toward outlier ejection) and the request goes to another prefill "
        "worker or pool. None: `first_byte_base`, a stream's first-content budget",
    )
    generation: float = Field(
        default=60.0, gt=0,
        description="non-streaming: fixed time for the answer beyond the first-byte budget, before the per-token "
        "allowance (the engine's headers come with its whole answer)",
    )
    generation_per_token: float = Field(
        default=0.1, ge=0,
        description="non-streaming: seconds of budget per requested output token (max_completion_tokens, else "
        "max_tokens, else the pool's default_output_tokens); 0.1 s is a slow engine under a full batch",
    )
    hold_headers: float | None = Field(
        default=20.0, gt=0,
        description="streaming: seconds the gateway may hold the client's response headers while the engine has "
        "sent no content (prefill), so that it can still fail over to another worker; then it commits (200 and the "
        "chunks held so far) and sends keep-alives. Keep it below the idle timeout of the load balancer in front "
        "(60 s for AWS ALB). None: hold until the first content",
    )
    keepalive_interval: float | None = Field(
        default=15.0, gt=0,
        description="streaming: once the response is committed and the engine is still prefilling, seconds "
        "between SSE comments (`: keep-alive`) that keep idle proxies from cutting the stream (the OpenAI SDKs "
        "ignore them). None: no keep-alives",
    )
    body_idle: float = Field(
        default=30.0, gt=0, description="longest gap while the client uploads its request body (408 after it)"
    )
    body_deadline: float = Field(
        default=10.0, gt=0,
        description="seconds any request body may take, plus one per `body_min_rate` bytes received (408 after), "
        "so a body trickled a byte at a time cannot hold a connection for minutes",
    )
    body_min_rate: float = Field(
        default=64 * 1024, gt=0, description="bytes/s of request body that earn one more second (`body_deadline`)"
    )
    header: float = Field(
        default=10.0, gt=0, description="time for a client's request line and headers to arrive (408 after it)"
    )
    send_stall: float = Field(
        default=30.0, gt=0,
        description="seconds a response may make no progress toward a client that stopped reading (its socket "
        "buffers full) before the gateway closes the connection and aborts the engine request",
    )
    keep_alive: float = Field(
        default=65.0, gt=0, description="seconds an idle client connection stays open between requests; keep "
        "it above the idle timeout of the load balancer in front (60 s for AWS ALB) so it never reuses a "
        "connection the gateway is closing",
    )
    total: float | None = Field(
        default=None, gt=0,
        description="optional overall cap, arrival to last byte: a request still waiting gets 504 "
        "`request_timeout`; a stream already flowing gets one SSE error event and no `[DONE]`; the upstream "
        "request is aborted either way. Off by default: a 1M-token answer can legitimately take many minutes",
    )


class TextRates(_Strict):
    """Tokens per character of each script class (`gateway/routing/tokens.py: script_counts`), before
    `safety_margin`. They depend on the model's tokenizer. The defaults are measured with Qwen's
    151K-token BPE vocabulary (the `qwen.tiktoken` file shipped in the `dashscope` wheel, read by
    `tiktoken`; `python -m loadtest.estimate_calibration`), rounded up: README "Prompt-token estimate"."""

    latin: float = Field(default=0.24, ge=0, description="tokens per ASCII letter")
    digit: float = Field(default=1.0, ge=0, description="tokens per ASCII digit")
    whitespace: float = Field(default=0.29, ge=0, description="tokens per ASCII space, tab or newline")
    punctuation: float = Field(default=0.49, ge=0, description="tokens per other ASCII character (code symbols)")
    han: float = Field(default=0.76, ge=0, description="tokens per CJK ideograph")
    kana: float = Field(default=0.81, ge=0, description="tokens per hiragana or katakana character")
    hangul: float = Field(default=0.97, ge=0, description="tokens per hangul syllable")
    cjk_punctuation: float = Field(default=1.0, ge=0, description="tokens per CJK or fullwidth punctuation mark")


class EstimationConfig(_Strict):
    """How prompt tokens are estimated before routing (design §4). Errs on the high side."""

    text_rates: TextRates = Field(default_factory=TextRates, description="tokens per character, by script")
    bytes_per_token: float = Field(
        default=2.7, gt=0, description="UTF-8 bytes per token of characters without a `text_rates` class "
        "(accented Latin, Cyrillic, Arabic, emoji...)")
    safety_margin: float = Field(default=1.05, ge=1.0, description="multiplier on the text estimate")
    tokens_per_message: int = Field(default=8, ge=0, description="chat-template overhead per message")
    tokens_per_request: int = Field(
        default=32, ge=0, description="fixed chat overhead: assistant header, a default system prompt"
    )
    image_tokens_default: int = Field(
        default=1280, ge=0, description="cost of an image whose size cannot be read (e.g. an http URL)"
    )
    image_pixels_per_token: int = Field(
        default=28 * 28, gt=0, description="pixels per vision token: 14 px patches merged 2x2 (MoonViT)"
    )
    image_tokens_min: int = Field(default=64, ge=0)
    image_tokens_max: int = Field(default=16384, ge=1)
    audio_tokens_per_second: float = Field(
        default=25.0, ge=0, description="tokens per second of audio (Whisper-style encoders: 50 frames/s "
        "pooled 2x; Kimi-Audio's tokenizer runs at 12.5 Hz), applied to the duration read from its header")
    audio_bytes_per_second: float = Field(
        default=2000.0, gt=0, description="for audio whose header cannot be read: its size in bytes over this "
        "gives a duration that errs long (2,000 B/s is 16 kbit/s, below voice codecs' usual rates)")
    audio_tokens_default: int = Field(
        default=750, ge=0, description="cost of an audio clip given by URL (30 s at 25 tokens/s)")
    video_tokens_default: int = Field(
        default=8192, ge=0, description="cost of a video part (its frames are not read)")

    @model_validator(mode="after")
    def _image_bounds(self) -> EstimationConfig:
        if self.image_tokens_min > self.image_tokens_max:
            raise ValueError(f"image_tokens_min ({self.image_tokens_min}) must not exceed image_tokens_max "
                             f"({self.image_tokens_max})")
        return self


class HealthConfig(_Strict):
    """Active health probes of every worker."""

    interval: float = Field(default=5.0, gt=0, description="seconds between probes of one worker")
    timeout: float = Field(
        default=2.0, gt=0, description="seconds for a whole probe (connect, headers, body); slower is a failure"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="a probe answer with a longer body is a failure (bytes; 1 MiB)"
    )
    unhealthy_after: int = Field(default=1, ge=1, description="consecutive failed probes before unhealthy")
    passive_failures: int = Field(
        default=3, ge=1, description="consecutive upstream failures (5xx, timeouts, broken replies) to eject"
    )
    ejection_base: float = Field(default=5.0, gt=0, description="seconds of the first ejection; doubles each time")
    ejection_max: float = Field(default=300.0, gt=0, description="longest ejection, seconds")
    verify_models: bool = Field(
        default=True, description="read each worker's /v1/models (vLLM, SGLang, vllm-ascend) when it starts or "
        "recovers and every `models_refresh` s; a worker lacking the served model name or reporting another "
        "max_model_len than the pool's max_context_tokens is `misconfigured` and gets no traffic",
    )
    models_refresh: float = Field(
        default=60.0, gt=0, description="seconds between /v1/models checks of a healthy, well-configured worker "
        "(a misconfigured one is checked at every probe)",
    )

    @model_validator(mode="after")
    def _ejection_order(self) -> HealthConfig:
        if self.ejection_base > self.ejection_max:
            raise ValueError(f"ejection_base ({self.ejection_base}) must not exceed ejection_max ({self.ejection_max})")
        return self


class AffinityConfig(_Strict):
    """Prefix-cache affinity (design §5): block hashing, the store, its time and size bounds."""

    enabled: bool = True
    block_bytes: int = Field(default=512, ge=64, description="canonical prompt bytes per block (~150 tokens)")
    dense_blocks: int = Field(default=32, ge=1, description="leading blocks that are all sampled")
    blocks_per_octave: int = Field(
        default=8, ge=1, description="sampled blocks per doubling of the position after the dense ones"
    )
    ttl_seconds: float = Field(
        default=600, ge=0.001, description="seconds a block -> worker entry lives (Redis keeps it to the millisecond)"
    )
    lookup_timeout: float = Field(default=0.02, gt=0, description="seconds; a slower lookup routes without it")
    retry_after: float = Field(default=1.0, gt=0, description="seconds to skip Redis after an error")
    key_prefix: str = Field(default="kgw:aff", pattern=r"^[A-Za-z0-9:_.-]{1,64}$")
    write_queue: int = Field(default=10000, ge=1, description="pending writes before new ones are dropped")
    memory_max_entries: int = Field(
        default=200_000, ge=1, description="in-process store size bound (~250 bytes an entry: ~50 MB)"
    )


class ResponsesConfig(_Strict):
    """Stored-response affinity for the Responses API (gateway/affinity/response_store.py): which
    worker holds each stored response, so follow-ups (`previous_response_id`, GET/DELETE/cancel by
    id) reach it. In Redis when `redis_url` is set (shared by replicas), else in this process."""

    store_ttl: float = Field(
        default=86_400, ge=1,
        description="seconds a response id -> worker record lives (the engine keeps the response until it restarts)",
    )
    key_prefix: str = Field(default="kgw:resp", pattern=r"^[A-Za-z0-9:_.-]{1,64}$")
    lookup_timeout: float = Field(default=0.05, gt=0,
                                  description="seconds; a slower Redis lookup answers 503 response_store_unavailable")
    retry_after: float = Field(default=1.0, gt=0,
                               description="seconds to skip Redis after an error (lookups answer 503 at once)")
    write_queue: int = Field(default=10000, ge=1, description="pending writes before new ones are dropped")
    memory_max_entries: int = Field(default=200_000, ge=1, description="in-process store size bound")


class LoadConfig(_Strict):
    """Scraping each engine's own /metrics for load (running, waiting, KV usage)."""

    enabled: bool = True
    interval: float = Field(default=1.0, gt=0, description="seconds between scrapes of one worker")
    timeout: float = Field(
        default=1.0, gt=0, description="seconds for a whole scrape (connect, headers, body); slower fails it"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="a /metrics body longer than this fails the scrape (bytes; 1 MiB)"
    )


class ShutdownConfig(_Strict):
    """Graceful shutdown on SIGTERM/SIGINT: drain readiness first, then let in-flight requests finish.

    Order: `/ready` answers 503 (`"draining": true`) for `drain_delay` seconds while the listener
    stays open and new requests are still served (the load balancer has not noticed yet); then the
    listener closes and in-flight requests may run for `grace_period` seconds more; whatever is
    still running then is cancelled, which closes its upstream request so the engine aborts it.
    """

    drain_delay: float = Field(
        default=5.0, ge=0, description="seconds /ready answers 503 before the listener closes (LB notice time)"
    )
    grace_period: float = Field(
        default=30.0, ge=0, description="seconds in-flight requests may still run after the listener closed"
    )


class ReadinessConfig(_Strict):
    """What `GET /ready` answers 200 for: which pools must have a usable worker (a healthy, correctly
    configured, undrained, non-ejected one; of each role in a PD pool) for this replica to be in rotation.

    `pools: any` (the default): at least one pool serves, so one pool's restart (minutes for a large
    rack) leaves the replica in the load balancer's rotation and the other pools' traffic flows;
    requests only the down pool could serve spill over (`spillover`) or get 503 with `Retry-After`.
    `all`: every pool must serve (the strictest: one pool down takes every replica out).
    A list of pool names: each of those must serve. A draining replica (shutdown began) is never ready.
    """

    pools: Literal["any", "all"] | list[Annotated[str, Field(min_length=1)]] = Field(
        default="any", description="any | all | [pool names]: the pools that must serve for /ready to answer 200")

    def is_ready(self, names: list[str], unready: list[str]) -> bool:
        """Whether pools `names` (the running config's, in order), of which `unready` have no usable
        worker, make this replica ready (shutdown aside)."""
        down = set(unready)
        if self.pools == "any":
            return any(name not in down for name in names)
        if self.pools == "all":
            return not down
        return not down.intersection(self.pools)


DEFAULT_COUNT_TOKENS_PER_MINUTE = 100
"""count_tokens requests per minute of a key that has a request or token limit but sets none for them."""


class ApiKeyConfig(_Strict):
    """One client API key: its name (logs, metric labels, Redis keys), the key's SHA-256, scopes, limits.

    The key itself is never in the config: `sha256` is the hex SHA-256 of its UTF-8 bytes
    (`kimi-gateway hash-key KEY`) and may come from the environment (`sha256: ${ALICE_KEY_SHA256}`).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    sha256: str
    scopes: list[Literal["user", "admin"]] = Field(
        default_factory=lambda: ["user"], min_length=1, description="user: /v1/*; admin: admin routes"
    )
    requests_per_minute: int | None = Field(default=None, ge=1, description="None: no request limit")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="estimated prompt + requested output tokens; None: no token limit"
    )
    count_tokens_per_minute: int | None = Field(
        default=None, ge=1, description="POST /v1/messages/count_tokens requests (they cost no tokens); None: "
        f"{DEFAULT_COUNT_TOKENS_PER_MINUTE} for a key with another limit, no limit for a key without any",
    )

    @property
    def count_tokens_limit(self) -> int | None:
        """The key's count_tokens requests per minute, the default filled in (`count_tokens_per_minute`)."""
        if self.count_tokens_per_minute is not None:
            return self.count_tokens_per_minute
        limited = self.requests_per_minute is not None or self.tokens_per_minute is not None
        return DEFAULT_COUNT_TOKENS_PER_MINUTE if limited else None

    @field_validator("sha256", mode="before")
    @classmethod
    def _hex_digest(cls, value: Any) -> str:
        digest = value.strip().lower() if isinstance(value, str) else ""
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError("must be the key's SHA-256 as 64 hex digits (`kimi-gateway hash-key KEY`), not the key")
        return digest

    @field_validator("scopes")
    @classmethod
    def _unique_scopes(cls, scopes: list[str]) -> list[str]:
        return sorted(set(scopes))


class AuthConfig(_Strict):
    """Client API keys, scopes and per-key rate limits (gateway/auth/, README "Authentication")."""

    enabled: bool = Field(default=False, description="require `Authorization: Bearer KEY` on /v1/*")
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    fail_mode: Literal["open", "closed"] = Field(
        default="open", description="when Redis cannot answer a rate-limit check: open serves, closed answers 503"
    )
    redis_timeout: float = Field(default=0.05, gt=0, description="seconds; a slower rate-limit check is a failure")
    redis_retry_after: float = Field(default=1.0, gt=0, description="seconds to skip Redis after a failure")
    key_prefix: str = Field(default="kgw:rl", pattern=r"^[A-Za-z0-9:_.-]{1,64}$")
    metric_key_names: bool = Field(
        default=False, description="label per-key metrics on the open /metrics with the key's name; off: with its "
        "id, the first 12 hex digits of its sha256, which does not reveal who holds it",
    )

    @model_validator(mode="after")
    def _check_keys(self) -> AuthConfig:
        if self.enabled and not self.keys:
            raise ValueError("auth.enabled needs at least one key in auth.keys")
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"key names must be unique, got {names}")
        if len({k.sha256 for k in self.keys}) != len(self.keys):
            raise ValueError("two keys have the same sha256")
        return self


class CorsConfig(_Strict):
    """CORS for browser clients (Starlette's CORSMiddleware): preflights answered, headers added."""

    enabled: bool = False
    allow_origins: list[str] = Field(
        default_factory=list, description='"*" or exact origins such as "https://chat.example.com"'
    )
    max_age: int = Field(default=600, ge=0, description="seconds a browser may cache a preflight answer")

    @field_validator("allow_origins")
    @classmethod
    def _check_origins(cls, origins: list[str]) -> list[str]:
        cleaned = [o.rstrip("/") for o in origins]
        for origin in cleaned:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f'an origin is "*" or scheme://host[:port] with no path, got {origin!r}')
        return cleaned

    @model_validator(mode="after")
    def _origins_when_enabled(self) -> CorsConfig:
        if self.enabled and not self.allow_origins:
            raise ValueError("cors.enabled needs allow_origins")
        return self


class ImageFetchConfig(_Strict):
    """Opt-in fetching of client `http(s)://` image URLs to measure their pixel size (README "Image URLs").

    The fetch only measures: the URL is forwarded unchanged and the engine fetches it itself. A
    fetch that fails, times out or is refused costs `estimation.image_tokens_default`, as with the
    fetch off; it never fails the request. Addresses are checked after DNS resolution, on every
    redirect hop, and the connection goes to the checked address (gateway/routing/address_policy.py).
    """

    enabled: bool = Field(default=False, description="fetch http(s) image URLs to measure them")
    timeout: float = Field(default=2.0, gt=0, description="seconds for one image: DNS, connect, redirects, body")
    request_budget: float = Field(default=3.0, gt=0, description="seconds for all the fetches of one request")
    max_bytes: int = Field(
        default=256 * 1024, ge=1024,
        description="bytes read per image at most; reading stops as soon as the size header has arrived",
    )
    max_redirects: int = Field(default=3, ge=0, le=10, description="redirects followed, each hop checked again")
    max_images: int = Field(default=16, ge=1, description="distinct URLs fetched per request; others cost the default")
    concurrency: int = Field(default=4, ge=1, description="fetches of one request at once")
    max_in_flight: int = Field(default=64, ge=1, description="fetches of this replica at once")
    allowed_schemes: list[Literal["http", "https"]] = Field(default_factory=lambda: ["http", "https"], min_length=1)
    allow_networks: list[IPvAnyNetwork] = Field(
        default_factory=list,
        description="networks fetched from although not public (loopback, private, link-local...), "
        'e.g. ["10.20.0.0/16"] for an internal image host; empty: public addresses only',
    )
    cache_entries: int = Field(default=4096, ge=0, description="measured sizes kept, by URL (0: none)")
    cache_ttl: float = Field(default=600.0, gt=0, description="seconds a measured size is reused")


class TracingConfig(_Strict):
    """Optional OpenTelemetry traces (gateway/tracing.py); off while `otlp_endpoint` is unset.

    Needs the `tracing` extra (`pip install 'kimi-gateway[tracing]'`)."""

    otlp_endpoint: str | None = Field(
        default=None, pattern=r"^https?://",
        description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces",
    )
    service_name: str = "kimi-gateway"
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0, description="share of requests traced")
    export_delay: float = Field(default=2.0, gt=0, description="seconds between batch exports")


class DiscoveryConfig(_Strict):
    """How pools with `discover:` are resolved: the DNS servers asked, how often, how long to wait."""

    nameservers: list[str] = Field(
        default_factory=list, description="IP addresses of the DNS servers; empty: the system's (/etc/resolv.conf)")
    port: int = Field(default=53, ge=1, le=65535, description="UDP/TCP port of `nameservers`")
    interval: float = Field(default=5.0, gt=0, description="seconds between resolutions of one pool's name")
    timeout: float = Field(default=2.0, gt=0, description="seconds for one resolution; slower keeps the last set")

    @field_validator("nameservers")
    @classmethod
    def _addresses(cls, servers: list[str]) -> list[str]:
        for server in servers:
            try:
                ipaddress.ip_address(server)
            except ValueError:
                raise ValueError(f"a nameserver is an IP address, got {server!r}") from None
        return servers


class RedisSentinelConfig(_Strict):
    """Redis behind Sentinel: the gateway asks these sentinels where the primary of `service_name` is
    and follows it across failovers (gateway/redis_client.py). Rendered to a `redis+sentinel://` URL."""

    sentinels: list[Annotated[str, Field(pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^\s:,/\[\]@]+)(:\d{1,5})?$")]] = Field(
        min_length=1, description="sentinel addresses, `host[:port]` (port 26379 when left out)")
    service_name: str = Field(min_length=1, description="the primary's name the sentinels monitor (`mymaster`)")
    db: int = Field(default=0, ge=0, description="database number on the primary")
    username: str | None = Field(default=None, description="the primary's ACL user")
    password: SecretStr | None = Field(default=None, description="the primary's password")
    sentinel_password: SecretStr | None = Field(default=None, description="the sentinels' password, if any")

    def url(self) -> str:
        """This block as a `redis+sentinel://` URL."""
        from gateway.redis_client import SentinelTarget, sentinel_address  # late: config stays free of redis-py

        def secret(value: SecretStr | None) -> str | None:
            return value.get_secret_value() if value is not None else None

        return SentinelTarget(tuple(sentinel_address(s) for s in self.sentinels), self.service_name, self.db,
                              self.username, secret(self.password), secret(self.sentinel_password)).url()


class MigrationConfig(_Strict):
    """Mid-stream migration (README "Migration"): a stream whose worker fails after content reached
    the client goes on on another worker, from the text generated so far."""

    max_per_request: int = Field(
        default=1, ge=0, le=10,
        description="continuations per streamed request at most; 0 disables migration (a mid-stream failure "
        "then ends the stream with one SSE error event)",
    )


class GatewayConfig(_Strict):
    """The whole gateway configuration. Unknown keys are errors (`extra="forbid"`).

    A plain pydantic model: it reads no environment itself (`parse_config` applies the overrides).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    admin_origins: list[str] = Field(
        default_factory=list,
        description="origins (scheme://host[:port]) whose pages may change admin state (drain) besides the "
        "listening address, `host` and localhost: the status page's URL when it is reached by a DNS name or "
        "through a proxy. The browser's `Origin` is compared with these, never with `Host` (DNS rebinding)",
    )
    processes: int = Field(
        default=1, ge=1, le=64,
        description="serving processes sharing the port (gateway/supervisor.py); each keeps its own health "
        "view and in-flight counts, so use Redis for affinity and limits when > 1",
    )
    replicas: int = Field(
        default=1, ge=1,
        description="gateway replicas deployed with this config (compose, Kubernetes); check-config warns "
        "when more than one would keep affinity, limits and drains per replica (no shared Redis)",
    )
    hung_process_timeout: float = Field(
        default=10.0, gt=0, le=3600,
        description="seconds a serving process's event loop may miss its heartbeat before the supervisor kills "
        "and replaces it (processes > 1; uvicorn's supervisor pings its workers the same way)",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    pools: list[PoolConfig] = Field(
        min_length=1, description="in cost order; an entry `{plan: plans/plan-a.yaml}` takes the pool from a plan "
        "file (gateway/plans/), relative to the config file",
    )
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    estimation: EstimationConfig = Field(default_factory=EstimationConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    cors: CorsConfig = Field(default_factory=CorsConfig)
    image_fetch: ImageFetchConfig = Field(default_factory=ImageFetchConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    readiness: ReadinessConfig = Field(default_factory=ReadinessConfig)
    max_attempts: int = Field(default=3, ge=1, le=10, description="upstream attempts per request")
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0, description="request body limit, bytes; also the "
                                "largest non-streamed answer and the longest SSE event relayed")
    max_decoded_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024,
        description="the most bytes one engine answer compressed although the gateway asked for identity (gzip, "
        "deflate) may decode to; past it the answer is an engine failure (a non-streaming one also stops at "
        "max_body_bytes)",
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="request line + headers limit, bytes (431 above it)"
    )
    max_messages: int = Field(default=20_000, ge=1, description="chat messages per request")
    max_content_parts: int = Field(default=50_000, ge=1, description="content parts per request, all messages")
    max_prompt_ids: int = Field(default=4 * 1024 * 1024, ge=1, description="token ids per completions request")
    parse_offload_bytes: int = Field(
        default=256 * 1024, ge=0,
        description="bodies larger than this (bytes) are parsed in a parse process, not on the event loop")
    parse_offload_items: int = Field(
        default=1_000, ge=0,
        description="bodies with more messages + content parts (or prompt elements) are parsed in a parse process")
    parse_processes: int = Field(default=2, ge=1, le=64,
                                 description="parse processes per serving process, started on first use")
    redis_url: str | None = Field(
        default=None, description="redis://, rediss:// or unix:// URL (redis-py's schemes), or "
        "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?sentinel_password=...], "
        "or a Redis Cluster: redis+cluster://[[user]:password@]host[:port][,host[:port]...] "
        "(rediss+cluster:// for TLS)",
    )
    redis: RedisSentinelConfig | None = Field(
        default=None, description="Redis behind Sentinel, as a block (instead of a redis+sentinel:// redis_url)"
    )
    allow_plaintext: list[Literal["redis", "engines"]] = Field(
        default_factory=list,
        description="unencrypted links beyond loopback that are deliberate (a private network, a NetworkPolicy, "
        "a service mesh's mTLS): `redis` for redis://, redis+sentinel:// or redis+cluster://, `engines` for "
        "http:// workers; the production checks (check-config, serve) warn about the others",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("admin_origins")
    @classmethod
    def _check_admin_origins(cls, origins: list[str]) -> list[str]:
        cleaned = [o.rstrip("/").lower() for o in origins]
        for origin in cleaned:
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"an origin is scheme://host[:port] with no path, got {origin!r}")
        return cleaned

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is None:
            return url
        if url.lower().startswith("redis+sentinel:"):
            from gateway.redis_client import parse_sentinel_url

            parse_sentinel_url(url)  # ValueError says what is wrong (never echoes the password)
            return url
        if re.match(r"^rediss?\+cluster:", url, re.IGNORECASE):
            from gateway.redis_cluster import parse_cluster_url

            parse_cluster_url(url)  # ValueError says what is wrong (never echoes the password)
            return url
        if not re.match(r"^(redis|rediss|unix):\S+$", url, re.IGNORECASE):
            raise ValueError("must be a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL, "
                             f"got {url[:80]!r}")
        return url

    @model_validator(mode="after")
    def _check_pools(self) -> GatewayConfig:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        model_names = {name.lower() for name in self.model.names()}
        for p in self.pools:
            if len(set(p.lora_adapters)) != len(p.lora_adapters):
                raise ValueError(f"pool {p.name}: lora_adapters must be distinct, got {p.lora_adapters}")
            clash = [a for a in [*p.lora_adapters, *(m.name for m in p.lora_on_demand)] if a.lower() in model_names]
            if clash:  # as an alias the engine would get the base model's name: the adapter silently unused
                raise ValueError(f"pool {p.name}: LoRA adapter {clash[0]!r} is also the model's name or an alias; "
                                 "drop it from model.aliases (a request naming it goes to the adapter)")
        required = self.readiness.pools
        if isinstance(required, list):
            unknown = [name for name in required if name not in names]
            if unknown or not required:
                raise ValueError(f"readiness.pools names no configured pool: {unknown or '[]'} (pools: {names})")
        return self

    @model_validator(mode="after")
    def _redis_block_to_url(self) -> GatewayConfig:
        if self.redis is not None:
            if self.redis_url is not None:
                raise ValueError("give Redis either as redis_url or as the redis: block, not both")
            object.__setattr__(self, "redis_url", self.redis.url())  # every store reads redis_url
        return self

    def pool(self, name: str) -> PoolConfig:
        """The pool called `name`; KeyError if there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


class ConfigError(ValueError):
    """A config file that cannot be loaded; the message names the offending path."""


def interpolate_env(value: Any, environ: Mapping[str, str]) -> Any:
    """Replace `${NAME}` / `${NAME:-default}` in every string of a parsed YAML tree.

    Raises ConfigError naming every referenced variable that is unset and has no default, each
    with its config path (`pools.0.api_key: ${VLLM_KEY}`).
    """
    missing: list[str] = []
    result = _interpolate(value, environ, "", missing)
    if missing:
        raise ConfigError("environment variables not set (and no ${NAME:-default}): " + "; ".join(missing))
    return result


def _interpolate(value: Any, environ: Mapping[str, str], path: str, missing: list[str]) -> Any:
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            missing.append(f"{path or '(top level)'}: {match.group(0)}")
            return ""

        return _ENV_REF.sub(sub, value)
    if isinstance(value, list):
        return [_interpolate(v, environ, f"{path}.{i}" if path else str(i), missing) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _interpolate(v, environ, f"{path}.{k}" if path else str(k), missing) for k, v in value.items()}
    return value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The top-level fields `environ` overrides: `KIMI_GATEWAY_<FIELD>` (any case) → value.

    Scalars are taken as strings (pydantic converts them); sections and lists (`KIMI_GATEWAY_AUTH`,
    `KIMI_GATEWAY_POOLS`) are JSON. Variables naming no field are ignored. Raises ConfigError for
    JSON that does not parse.
    """
    given = {name.upper(): value for name, value in environ.items() if name.upper().startswith(ENV_PREFIX)}
    overrides: dict[str, Any] = {}
    for field, info in GatewayConfig.model_fields.items():
        variable = ENV_PREFIX + field.upper()
        if variable not in given:
            continue
        if not _is_complex(info.annotation):
            overrides[field] = given[variable]
            continue
        try:
            overrides[field] = json.loads(given[variable])
        except ValueError as exc:
            raise ConfigError(f"{variable} is not valid JSON ({exc}); complex {ENV_PREFIX}* overrides are JSON") \
                from exc
    return overrides


def _is_complex(annotation: Any) -> bool:
    """A section, list or mapping (also inside `X | None`): given as JSON in the environment."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    if get_origin(annotation) in (list, dict):
        return True
    return get_origin(annotation) in (Union, UnionType) and any(_is_complex(a) for a in get_args(annotation))


def _deep_update(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        old = merged.get(key)
        merged[key] = _deep_update(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


def parse_config(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Validate a config mapping (as read from YAML).

    `environ` is the only source of environment values: of the `${NAME}` references and of the
    `KIMI_GATEWAY_*` overrides (which win over the file's values; a section given as JSON is merged
    into the file's). None (the default) is an empty environment, never `os.environ`: the command
    line passes that itself. Raises ConfigError (unset `${NAME}`, bad override JSON) or
    pydantic.ValidationError.
    """
    environ = {} if environ is None else environ
    merged = _deep_update(interpolate_env(dict(data), environ), env_overrides(environ))
    return GatewayConfig(**merged)


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read and validate a YAML config file; `environ` as for `parse_config`.

    Raises ConfigError for an unreadable file or bad YAML, pydantic.ValidationError for bad values.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    from gateway.plans.models import PlanError, expand_plan_refs  # late: plans stay off the request path

    try:
        data = expand_plan_refs(data, Path(path).parent)
    except PlanError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return parse_config(data, environ)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key (PyYAML lets the last one win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def explain_validation_error(exc: Exception) -> str:
    """Render a pydantic ValidationError as one `path.to.field: message` line per problem."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    lines = []
    for err in errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
        lines.append(f"{loc}: {err.get('msg')}")
    return "\n".join(lines)
