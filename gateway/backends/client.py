"""The one pooled httpx client to the engines, and the per-request timeout budget."""

from __future__ import annotations

import httpx

from gateway.config import TimeoutConfig


def build_upstream_client(timeouts: TimeoutConfig) -> httpx.AsyncClient:
    """A keep-alive connection pool with no connection cap (the engines' own queues bound load).

    Compression is refused (`accept-encoding: identity`) so raw bytes relay unchanged.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=30.0),
        headers={"accept-encoding": "identity"},
        follow_redirects=False,
        trust_env=False,
    )


def first_byte_budget(timeouts: TimeoutConfig, prompt_tokens: int) -> float:
    """Seconds to wait for an engine's first byte: a base plus a prefill allowance per 1K tokens."""
    return timeouts.first_byte_base + timeouts.first_byte_per_1k_tokens * prompt_tokens / 1000.0


def request_timeout(timeouts: TimeoutConfig, prompt_tokens: int, stream: bool) -> httpx.Timeout:
    """httpx timeout for one upstream request, in seconds.

    Streaming: each read may wait the first-byte budget (prefill) or the gap limit, whichever is
    longer. Non-streaming: the first byte comes with the whole answer, so the read may also take
    the generation allowance.
    """
    budget = first_byte_budget(timeouts, prompt_tokens)
    read = max(timeouts.read, budget) if stream else budget + timeouts.generation
    return httpx.Timeout(connect=timeouts.connect, read=read, write=timeouts.write, pool=None)
