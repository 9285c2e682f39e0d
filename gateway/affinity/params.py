"""The affinity package's config sections (pydantic only): prefix-cache affinity and the Responses
API's stored-response owners."""

from __future__ import annotations

from pydantic import Field

from gateway.config_base import Section


class AffinityConfig(Section):
    """Prefix-cache affinity (design §5): block hashing, the store, its time and size bounds."""

    enabled: bool = Field(default=True, description="route by prefix-cache affinity")
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
    key_prefix: str = Field(default="kgw:aff", pattern=r"^[A-Za-z0-9:_.-]{1,64}$",
                            description="prefix of its Redis keys")
    write_queue: int = Field(default=10000, ge=1, description="pending writes before new ones are dropped")
    memory_max_entries: int = Field(
        default=200_000, ge=1, description="in-process store size bound (~250 bytes an entry: ~50 MB)"
    )


class ResponsesConfig(Section):
    """Stored-response affinity for the Responses API (gateway/affinity/response_store.py): which
    worker holds each stored response, so follow-ups (`previous_response_id`, GET/DELETE/cancel by
    id) reach it. In Redis when `redis_url` is set (shared by replicas), else in this process."""

    store_ttl: float = Field(
        default=86_400, ge=1,
        description="seconds a response id -> worker record lives (the engine keeps the response until it restarts)",
    )
    key_prefix: str = Field(default="kgw:resp", pattern=r"^[A-Za-z0-9:_.-]{1,64}$",
                            description="prefix of its Redis keys")
    lookup_timeout: float = Field(default=0.05, gt=0,
                                  description="seconds; a slower Redis lookup answers 503 response_store_unavailable")
    retry_after: float = Field(default=1.0, gt=0,
                               description="seconds to skip Redis after an error (lookups answer 503 at once)")
    write_queue: int = Field(default=10000, ge=1, description="pending writes before new ones are dropped")
    memory_max_entries: int = Field(default=200_000, ge=1, description="in-process store size bound")
