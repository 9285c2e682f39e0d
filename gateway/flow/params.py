"""Flow control's config sections (pydantic only): `flow_control:` at the top level (flows, bands,
queue bounds) and `flow_control:` on a pool (whether it holds requests, and when its workers are
saturated). docs/flow-control.md explains the model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.config_base import Section

MIN_BAND = -10
"""The lowest priority band (the most sheddable traffic)."""
MAX_BAND = 10
"""The highest priority band. Bands are integers, higher first; 0 is every key's default."""

FairBy = Literal["tokens", "requests"]
"""What fairness across flows counts: each request's estimated tokens (prompt + output reservation,
the count a key's token limit charges) or each request as one."""


class PoolFlowConfig(Section):
    """A pool's flow control: off by default (every request goes to an engine at once, as without it).

    On, a worker is **saturated** when its engine's KV cache usage is at least `max_kv_usage`, or
    its waiting queue (the engine's scraped waiting requests plus this replica's requests sent there
    since that scrape that have not started: no first byte yet) holds at least `max_waiting`
    requests, or this replica's requests still to prefill there (streams without a first token,
    non-streamed requests sent since the scrape) hold at least `max_prefill_tokens` estimated
    uncached prompt tokens (gateway/flow/saturation.py). While every in-service worker of the pool
    is saturated, new requests wait at the gateway (`FlowControlConfig`); each worker's room
    (`max_waiting` less its waiting queue) lets that many go. `engine_priority` says the pool's
    engines run priority scheduling, so the gateway sets their `priority` field from the request's
    band (gateway/flow/priority.py)."""

    enabled: bool = Field(default=False, description="hold new requests at the gateway while every worker is "
                          "saturated; off: every request goes to an engine at once")
    max_waiting: int = Field(
        default=2, ge=1, description="requests queued on one worker (its engine's waiting requests at the last "
        "load scrape + this replica's requests sent since that have not started) at which it is saturated")
    max_kv_usage: float = Field(default=0.95, gt=0.0, le=1.0,
                                description="KV cache usage (0..1, scraped) at which a worker is saturated")
    max_prefill_tokens: int | None = Field(
        default=8192, ge=1, description="estimated uncached prompt tokens of this replica's requests still to "
        "prefill on one worker at which it is saturated: about one prefill step (vLLM max_num_batched_tokens, "
        "SGLang chunked_prefill_size; 8,192 by default on large GPUs); None: not counted")
    engine_priority: bool = Field(
        default=False, description="the pool's engines run priority scheduling (vLLM `--scheduling-policy "
        "priority`, SGLang `--enable-priority-scheduling`): the gateway sets each request's engine `priority` "
        "from its band. Off: no `priority` reaches them but a key's with `client_priority`")


class FlowControlConfig(Section):
    """Flows, bands and the bounds of the gateway's queues (for the pools with `flow_control.enabled`).

    A request's **flow** is its tenant (the API key's `flow`, else its name; `anonymous` with auth
    off) and, with `flow_header`, that header's value as a sub-flow within the tenant. Its **band**
    is its key's `priority` (0 by default), or the `priority_header` the client sends, at most its
    key's `max_priority`. Held requests leave highest band first; within a band, fairly across
    tenants, then across a tenant's sub-flows (start-time fair queuing counting `fair_by`); first
    come first served within a sub-flow.
    """

    fair_by: FairBy = Field(
        default="tokens", description="tokens: each request weighs its estimated prompt + output tokens (a "
        "tenant of long prompts gets no more engine work than one of short ones); requests: each weighs one")
    flow_header: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$",
        description="a request header naming a sub-flow within the tenant (a key shared by several end users); "
        "None: one flow per tenant")
    priority_header: str | None = Field(
        default="x-kimi-priority", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$",
        description="a request header asking for a band (an integer), at most the key's max_priority; None: "
        "bands from the keys only")
    queue_timeout: float = Field(default=30.0, gt=0.0,
                                 description="seconds a request may wait at the gateway; then 503 with Retry-After")
    max_queued: int = Field(default=4096, ge=1, description="requests waiting at the gateway, all flows and pools")
    max_queued_per_flow: int = Field(
        default=1024, ge=1, description="requests of one tenant waiting at the gateway; more get 429 with Retry-After")
    max_queued_bytes: int = Field(default=1 << 30, ge=1,
                                  description="request body bytes waiting at the gateway, all flows and pools")
    max_queued_bytes_per_flow: int = Field(default=256 << 20, ge=1,
                                           description="request body bytes of one tenant waiting at the gateway")
    recheck_interval: float = Field(
        default=0.05, gt=0.0, le=5.0, description="seconds between looks at a pool's room while requests wait "
        "there (besides every request end and first token, which look at once): the engines' scraped load "
        "changes at `load.interval`")

    @field_validator("flow_header", "priority_header")
    @classmethod
    def _lower(cls, name: str | None) -> str | None:
        return None if name is None else name.lower()
