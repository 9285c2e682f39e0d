"""A request a simulated engine has admitted (or, with the step scheduler, accepted for scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.sim.kvcache import CacheLease


@dataclass(eq=False)
class ActiveRequest:
    """A request admitted for processing (counts as running): its tokens occupy the KV cache.

    `cached_tokens` of its `prompt_tokens` were found in the prefix cache at admission; `leases`
    are its holds on the cache (one per prompt; empty without a prefix cache). `generated` counts
    output tokens (all its prompts together). `admitted_at` is when the engine first admitted it
    (`time.monotonic()` seconds: out of the wait queue, its prefill may start; None until then);
    `prefill_done` turns True when its prefill ends (per-request timing). Compared by identity.
    """

    prompt_tokens: int
    generated: int = 0
    cached_tokens: int = 0
    leases: list[CacheLease] = field(default_factory=list)
    admitted_at: float | None = None
    prefill_done: bool = False

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens to compute (not cached)."""
        return self.prompt_tokens - self.cached_tokens

    def created_cache_tokens(self, block_tokens: int) -> int:
        """Prompt tokens its prefill wrote to the prefix cache: the full blocks past the cached
        prefix (vLLM's `PrefillStats.num_cache_creation_tokens`, `vllm/v1/metrics/stats.py`); 0
        without a prefix cache."""
        return sum(max(0, len(lease.key.hashes) * block_tokens - lease.cached_tokens) for lease in self.leases)
