"""The backends' config sections (pydantic only): engine kinds, worker URLs, DNS discovery,
health probes and load scraping. The pool itself: gateway/backends/pool_params.py."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config_base import Section

EngineKind = Literal["vllm", "sglang", "ascend", "llamacpp"]


Modality = Literal["text", "image", "audio", "video", "file"]


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


class DiscoverConfig(Section):
    """A pool's workers found in DNS, e.g. a Kubernetes headless Service (gateway/backends/discovery.py).

    `record: a` asks for the name's A and AAAA records (one worker per address, on `port`);
    `record: srv` asks for SRV records (RFC 2782: target host and port per worker; each target's
    A/AAAA addresses), e.g. `_http._tcp.vllm.k3.svc.cluster.local` for a named Service port.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,253}$", description="DNS name to resolve")
    record: Literal["a", "srv"] = Field(default="a", description="a: A + AAAA records; srv: SRV records")
    port: int | None = Field(default=None, ge=1, le=65535, description="the engines' port (record: a)")
    scheme: Literal["http", "https"] = Field(default="http", description="the scheme of the discovered workers' URLs")

    @model_validator(mode="after")
    def _port_for_a(self) -> DiscoverConfig:
        if self.record == "a" and self.port is None:
            raise ValueError("record: a needs a port (SRV records carry their own)")
        if self.record == "srv" and self.port is not None:
            raise ValueError("record: srv takes the port from the SRV records; drop `port`")
        return self


class DiscoveryConfig(Section):
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


class LoraModule(Section):
    """A LoRA adapter a pool's workers load on demand: its name (the request's `model`) and the
    path the engine loads it from (vLLM's `lora_path`: a directory on the engine's host, or a
    Hugging Face repo id with a resolver)."""

    name: str = Field(min_length=1, max_length=256, description="the adapter's name: a request's `model`")
    path: str = Field(min_length=1, description="where the engine loads it from (a directory on the engine's host, "
                      "or a Hugging Face repo id with a resolver)")


class HealthConfig(Section):
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


class LoadConfig(Section):
    """Scraping each engine's own /metrics for load (running, waiting, KV usage)."""

    enabled: bool = Field(default=True, description="scrape each engine's /metrics for its load")
    interval: float = Field(default=1.0, gt=0, description="seconds between scrapes of one worker")
    timeout: float = Field(
        default=1.0, gt=0, description="seconds for a whole scrape (connect, headers, body); slower fails it"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="a /metrics body longer than this fails the scrape (bytes; 1 MiB)"
    )
