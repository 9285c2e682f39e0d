"""The dispatch package's config sections (pydantic only): request timeouts and mid-stream migration."""

from __future__ import annotations

from pydantic import Field

from gateway.config_base import Section


class TimeoutConfig(Section):
    """Timeouts, in seconds: upstream ones, the client's upload (`body_idle`) and the overall cap."""

    connect: float = Field(default=5.0, gt=0, description="seconds to connect to a worker")
    read: float = Field(default=120.0, gt=0, description="longest allowed gap between upstream bytes")
    write: float = Field(default=30.0, gt=0, description="seconds one write of a request body to a worker may take")
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
        description="non-streaming: seconds of budget per output token the engine may generate (max_completion_tokens, "
        "else max_tokens, at most what the context leaves; without a limit the engine's default: the rest of the "
        "context, 16 on completions); 0.1 s is a slow engine under a full batch",
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
        description="streaming: seconds of silence in a committed stream (a prefill past `hold_headers`, a slow "
        "tool call or reasoning step between two events) after which the client gets a heartbeat, and again every "
        "interval while it lasts, so idle proxies do not cut the stream: an SSE comment (`: keep-alive`) on the "
        "OpenAI APIs, Anthropic's `event: ping` on Messages; both are skipped by those APIs' SDKs. Sent only "
        "between whole events, never counted as usage. Keep it below the idle timeout of the load balancer in "
        "front (60 s for AWS ALB). None: no heartbeats",
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


class MigrationConfig(Section):
    """Mid-stream migration (README "Migration"): a stream whose worker fails after content reached
    the client goes on on another worker, from the text generated so far."""

    max_per_request: int = Field(
        default=1, ge=0, le=10,
        description="continuations per streamed request at most; 0 disables migration (a mid-stream failure "
        "then ends the stream with one SSE error event)",
    )
