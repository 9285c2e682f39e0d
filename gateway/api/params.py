"""The client API's config sections (pydantic only): the served models' names and CORS."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from gateway.config_base import Section


class ModelConfig(Section):
    """A model the gateway serves (the top-level `model:`, or one entry of `models:`), the names
    clients may call it by and the pools that serve it."""

    name: str = Field(default="kimi-k3", min_length=1, description="the model's name: what clients send as `model`")
    aliases: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["Kimi-K3", "moonshotai/Kimi-K3"],
        description="other names clients may call it by (answers carry the name they sent)")
    owned_by: str = Field(default="moonshotai", description="`owned_by` of its `/v1/models` entry")
    pools: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, description="names of the pools that serve it, in cost order (its own chain: context-length "
        "routing, spillover and PD run over these only); a pool may serve several models. None: every pool "
        "(the one-model form, or a `models:` list of one)")
    served_model_name: str | None = Field(
        default=None, min_length=1, description="the name its engines serve it under (vLLM/SGLang "
        "`--served-model-name`); a pool's own `served_model_name` wins where the pool serves this model only. "
        "None: `name`")

    @model_validator(mode="after")
    def _distinct_names(self) -> ModelConfig:
        if len(set(self.names())) != len(self.names()):
            raise ValueError(f"model name and aliases must differ, got {self.names()}")
        return self

    def names(self) -> list[str]:
        """The canonical name first, then the aliases."""
        return [self.name, *self.aliases]


class CorsConfig(Section):
    """CORS for browser clients (Starlette's CORSMiddleware): preflights answered, headers added."""

    enabled: bool = Field(default=False, description="answer CORS preflights and add CORS headers")
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
