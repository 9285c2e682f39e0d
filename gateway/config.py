"""The gateway's configuration: `GatewayConfig`, composed of the sections each package owns, and
loading it from YAML.

Each package owns its sections in a pydantic-only params module (gateway/*/params.py; a pool:
gateway/backends/pool_params.py; a routing policy's `policy_params`: its module in
gateway/routing/policies/). String values may say `${NAME}` or `${NAME:-default}`, top-level fields
may be overridden with `KIMI_GATEWAY_<FIELD>` (gateway/config_env.py). Both read one explicit
mapping, the `environ` argument of `parse_config`/`load_config`: the command line passes
`os.environ`, tests pass their own, and nothing here reads the process environment behind it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from gateway.affinity.params import AffinityConfig, ResponsesConfig
from gateway.api.params import CorsConfig, ModelConfig
from gateway.auth.params import AuthConfig
from gateway.backends.params import DiscoveryConfig, HealthConfig, LoadConfig
from gateway.backends.pool_params import PoolConfig
from gateway.config_base import ConfigError, Section
from gateway.config_env import deep_update, env_overrides, interpolate_env
from gateway.dispatch.params import MigrationConfig, TimeoutConfig
from gateway.flow.params import FlowControlConfig
from gateway.plans.models import PlanError, expand_plan_refs
from gateway.process_params import ReadinessConfig, RedisSentinelConfig, TracingConfig
from gateway.routing.params import EstimationConfig, ImageFetchConfig
from gateway.serving.params import ShutdownConfig

__all__ = ["ConfigError", "GatewayConfig", "load_config", "parse_config"]


class GatewayConfig(Section):
    """The whole gateway configuration. Unknown keys are errors (`extra="forbid"`).

    A plain pydantic model: it reads no environment itself (`parse_config` applies the overrides).
    """

    host: str = Field(default="127.0.0.1", description="address the gateway listens on (0.0.0.0: every interface)")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port it listens on (0: one the OS picks)")
    admin_origins: list[str] = Field(
        default_factory=list,
        description="origins (scheme://host[:port]) whose pages may change admin state (drain) besides the "
        "listening address, `host` and localhost: the status page's URL when it is reached by a DNS name or "
        "through a proxy. The browser's `Origin` is compared with these, never with `Host` (DNS rebinding)",
    )
    processes: int = Field(
        default=1, ge=1, le=64,
        description="serving processes sharing the port (gateway/process/supervisor.py); each keeps its own health "
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
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="the one model of a one-model config (served by every pool); "
        "give `models:` instead to serve several")
    models: list[ModelConfig] | None = Field(
        default=None, min_length=1, description="the models served, each with its aliases (none unless given) and "
        "its own pool chain (`pools`, required when there are several); instead of `model:`")
    pools: list[PoolConfig] = Field(
        min_length=1, description="in cost order; an entry `{plan: plans/plan-a.yaml}` takes the pool from a plan "
        "file (gateway/plans/), relative to the config file",
    )
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    flow_control: FlowControlConfig = Field(
        default_factory=FlowControlConfig, description="flows, bands and queue bounds of the pools with "
        "flow_control.enabled (docs/flow-control.md)")
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
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="the gateway's log level (the access log is at info)")

    @field_validator("models", mode="before")
    @classmethod
    def _no_default_aliases(cls, models: Any) -> Any:
        """A `models:` entry has no aliases unless it gives some (the default K3 aliases are the
        one-model form's: on every entry they would clash)."""
        if isinstance(models, list):
            return [{"aliases": [], **m} if isinstance(m, Mapping) else m for m in models]
        return models

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
        self.check_pools()
        return self

    def check_pools(self) -> None:
        """The pools against each other and the models: names unique, every model's pools exist and
        every pool serves a model (`_check_models`), LoRA adapters distinct and none also a model's
        name or alias, `readiness.pools` configured. Run at validation and by a reload on the
        running models with the new pools (`gateway/serving/reload.py`). Raises ValueError."""
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        self._check_models(names)
        model_names = {name.lower() for model in self.served_models() for name in model.names()}
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

    @model_validator(mode="after")
    def _redis_block_to_url(self) -> GatewayConfig:
        if self.redis is not None:
            if self.redis_url is not None:
                raise ValueError("give Redis either as redis_url or as the redis: block, not both")
            object.__setattr__(self, "redis_url", self.redis.url())  # every store reads redis_url
        return self

    def _check_models(self, pool_names: list[str]) -> None:
        """`models:` instead of `model:`, names (and aliases) distinct across models ignoring case (as
        requests are matched); every pool a model names exists and every pool serves a model; a pool
        serving several models has no `served_model_name` of its own (which model's would it be?)."""
        if self.models is None:
            return
        if "model" in self.model_fields_set:
            raise ValueError("give either `model:` (one model) or `models:` (several), not both")
        seen: dict[str, str] = {}
        for model in self.models:
            for name in model.names():
                other = seen.setdefault(name.lower(), model.name)
                if other != model.name:
                    raise ValueError(f"model name or alias {name!r} is used twice (by {other!r} and {model.name!r})")
            if model.pools is None and len(self.models) > 1:
                raise ValueError(f"model {model.name!r}: with several models each names its `pools`")
            unknown = [p for p in model.pools or () if p not in pool_names]
            if unknown:
                raise ValueError(f"model {model.name!r}: pools {unknown} are not configured (pools: {pool_names})")
            if model.pools is not None and len(set(model.pools)) != len(model.pools):
                raise ValueError(f"model {model.name!r}: pools must be distinct, got {model.pools}")
        for pool in self.pools:
            serving = [m.name for m in self.models if m.pools is None or pool.name in m.pools]
            if not serving:
                raise ValueError(f"pool {pool.name} serves no model: name it in a model's `pools`")
            if pool.served_model_name is not None and len(serving) > 1:
                raise ValueError(f"pool {pool.name} serves {serving}: set `served_model_name` on those models, "
                                 "not on the pool")

    def served_models(self) -> list[ModelConfig]:
        """Every model served, in config order: `models`, else the one `model`."""
        return self.models if self.models is not None else [self.model]

    def model_named(self, name: str) -> ModelConfig:
        """The served model whose canonical name is `name` (not an alias); KeyError if none is."""
        for model in self.served_models():
            if model.name == name:
                return model
        raise KeyError(name)

    def model_pools(self, name: str) -> list[PoolConfig]:
        """The pools serving the model called `name` (canonical), in its cost order: its `pools`, or
        (None) every pool in config order. KeyError for no such model."""
        model = self.model_named(name)
        if model.pools is None:
            return list(self.pools)
        return [next(p for p in self.pools if p.name == pool) for pool in model.pools]

    def served_name(self, pool: PoolConfig, name: str) -> str:
        """The `model` the engines of `pool` get for the model called `name` (canonical): the pool's
        `served_model_name` (allowed only on a pool serving one model), else the model's
        `served_model_name`, else `name`. KeyError for no such model."""
        return pool.served_model_name or self.model_named(name).served_model_name or name

    def pool_served_names(self) -> dict[str, tuple[str, ...]]:
        """Pool name -> the names its engines must list in /v1/models, one per model the pool serves."""
        return {pool.name: tuple(self.served_name(pool, m.name) for m in self.served_models()
                                 if m.pools is None or pool.name in m.pools) for pool in self.pools}

    def pool_reserved_names(self) -> dict[str, frozenset[str]]:
        """Pool name -> the names (lower case, as requests are matched) a LoRA adapter its engines
        list may not take: every model's canonical name, and every name and alias of the models the
        pool does not serve. An adapter wins only over an alias of one of the pool's own models (the
        field case: configured as an alias it reached the engine as the base model); named like
        another model it would take that model's requests to this pool."""
        canonical = {m.name.lower() for m in self.served_models()}
        return {pool.name: frozenset(canonical | {name.lower() for m in self.served_models()
                                                  if m.pools is not None and pool.name not in m.pools
                                                  for name in m.names()}) for pool in self.pools}

    def pool(self, name: str) -> PoolConfig:
        """The pool called `name`; KeyError if there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def parse_config(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Validate a config mapping (as read from YAML).

    `environ` is the only source of environment values: of the `${NAME}` references and of the
    `KIMI_GATEWAY_*` overrides (which win over the file's values; a section given as JSON is merged
    into the file's). None (the default) is an empty environment, never `os.environ`: the command
    line passes that itself. Raises ConfigError (unset `${NAME}`, bad override JSON) or
    pydantic.ValidationError.
    """
    environ = {} if environ is None else environ
    merged = deep_update(interpolate_env(dict(data), environ), env_overrides(environ, GatewayConfig))
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
