"""The auth package's config section (pydantic only): client API keys, scopes and per-key limits."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config_base import Section
from gateway.flow.params import MAX_BAND, MIN_BAND

DEFAULT_COUNT_TOKENS_PER_MINUTE = 100
"""count_tokens requests per minute of a key that has a request or token limit but sets none for them."""


class ModelLimits(Section):
    """One key's limits on one model or LoRA adapter (`ApiKeyConfig.model_limits`), on top of the
    key's own: a request for that model must fit both. None: no such limit on that model."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="None: no per-model request limit")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="estimated prompt + requested output tokens; None: no per-model token limit"
    )
    count_tokens_per_minute: int | None = Field(
        default=None, ge=1, description="POST /v1/messages/count_tokens requests for this model; None: only the "
        "key's own count_tokens limit",
    )

    @property
    def limited(self) -> bool:
        """True when at least one of the limits is set."""
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                           self.count_tokens_per_minute))


class ApiKeyConfig(Section):
    """One client API key: its name (logs, metric labels, Redis keys), the key's SHA-256, scopes, limits.

    The key itself is never in the config: `sha256` is the hex SHA-256 of its UTF-8 bytes
    (`kimi-gateway hash-key KEY`) and may come from the environment (`sha256: ${ALICE_KEY_SHA256}`).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the key's name (logs, metric labels, Redis keys)")
    sha256: str = Field(description="hex SHA-256 of the key's UTF-8 bytes (`kimi-gateway hash-key KEY`)")
    scopes: list[Literal["user", "admin", "drain"]] = Field(
        default_factory=lambda: ["user"], min_length=1,
        description="user: /v1/*; admin: admin routes; drain: only listing, draining and undraining workers "
                    "(an engine pod's key for `kimi-gateway drain`)"
    )
    requests_per_minute: int | None = Field(default=None, ge=1, description="None: no request limit")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="estimated prompt + requested output tokens; None: no token limit"
    )
    count_tokens_per_minute: int | None = Field(
        default=None, ge=1, description="POST /v1/messages/count_tokens requests (they cost no tokens); None: "
        f"{DEFAULT_COUNT_TOKENS_PER_MINUTE} for a key with another limit, no limit for a key without any",
    )
    models: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, description="the models (canonical names or aliases, an alias standing for its model) and LoRA "
        "adapters the key may use; None: all. Another one gets 404 model_not_found, as OpenAI answers a model the "
        "key has no access to",
    )
    model_limits: dict[str, ModelLimits] = Field(
        default_factory=dict, description="per model or LoRA adapter (as in `models`): limits on top of the key's "
        "own; both apply",
    )
    cache_group: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="with `auth.cache_isolation: per_key`: keys "
        "naming the same group share one prefix-cache partition (one tenant's keys); None: the key's own",
    )

    flow: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="flow control: the tenant whose fair share "
        "this key's requests draw on (keys naming the same one share it); None: the key's own name")
    priority: int = Field(default=0, ge=MIN_BAND, le=MAX_BAND,
                          description="flow control: the band of this key's requests (higher leaves the queue first)")
    max_priority: int | None = Field(
        default=None, ge=MIN_BAND, le=MAX_BAND, description="flow control: the highest band a request of this key "
        "may ask for with the priority header; None: its `priority` (the header may only lower it)")
    client_priority: bool = Field(
        default=False, description="the engines get this key's own `priority` field as sent; off: the gateway "
        "strips it (and sets it from the band on pools with flow_control.engine_priority)")

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

    @field_validator("models")
    @classmethod
    def _distinct_models(cls, models: list[str] | None) -> list[str] | None:
        if models is not None and len(set(models)) != len(models):
            raise ValueError(f"models must be distinct, got {models}")
        return models

    @model_validator(mode="after")
    def _max_priority(self) -> ApiKeyConfig:
        if self.max_priority is not None and self.max_priority < self.priority:
            raise ValueError(f"max_priority ({self.max_priority}) is below priority ({self.priority})")
        return self

    @field_validator("scopes")
    @classmethod
    def _unique_scopes(cls, scopes: list[str]) -> list[str]:
        return sorted(set(scopes))


class AuthConfig(Section):
    """Client API keys, scopes and per-key rate limits (gateway/auth/, README "Authentication")."""

    enabled: bool = Field(default=False, description="require `Authorization: Bearer KEY` on /v1/*")
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    fail_mode: Literal["open", "closed"] = Field(
        default="open", description="when Redis cannot answer a rate-limit check: open serves, closed answers 503"
    )
    redis_timeout: float = Field(default=0.05, gt=0, description="seconds; a slower rate-limit check is a failure")
    redis_retry_after: float = Field(default=1.0, gt=0, description="seconds to skip Redis after a failure")
    key_prefix: str = Field(default="kgw:rl", pattern=r"^[A-Za-z0-9:_.-]{1,64}$",
                            description="prefix of the limits' Redis keys")
    metric_key_names: bool = Field(
        default=False, description="label per-key metrics on the open /metrics with the key's name; off: with its "
        "id, the first 12 hex digits of its sha256, which does not reveal who holds it",
    )
    cache_isolation: Literal["off", "per_key"] = Field(
        default="off", description="per_key: the gateway sets the engines' `cache_salt` per key (or `cache_group`), "
        "replacing a client's, so no key's requests reuse, or learn about, another's cached prompts "
        "(gateway/auth/cache_isolation.py); off: a client's own `cache_salt` is forwarded",
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
        if self.cache_isolation != "off" and not self.enabled:
            raise ValueError("auth.cache_isolation partitions the cache by API key: it needs auth.enabled")
        grouped = [k.name for k in self.keys if k.cache_group is not None]
        if grouped and self.cache_isolation == "off":
            raise ValueError(f"auth.keys {grouped} set cache_group, which only auth.cache_isolation: per_key uses")
        return self
