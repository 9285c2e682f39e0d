"""Pydantic models of what the gateway answers, for its OpenAPI contract (`GET /openapi.json`).

The endpoints render their JSON with orjson themselves (`responses.JSONResponse`), so these models
describe the answers without validating them per request; the contract test
(tests/integration/test_openapi_contract.py, Schemathesis) checks real answers against them.
Error objects follow OpenAI's shape (https://platform.openai.com/docs/guides/error-codes), as
`gateway.errors.GatewayError.body()` builds them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorObject(BaseModel):
    """OpenAI's error object: `type` is `invalid_request_error`, `permission_error`, `requests`,
    `tokens` or `server_error`; `code` a machine-readable reason (`model_not_found`, ...)."""

    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the gateway answers: `{"error": {"message", "type", "param", "code"}}`."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorObject


ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request (`invalid_request_error`; `context_length_exceeded`, `invalid_config`...).",
    401: "Missing or unknown API key (`invalid_api_key`); only when auth is enabled.",
    403: "The key lacks the scope (`permission_error`), or an admin change from another site's page.",
    404: "Unknown model (`model_not_found`), worker (`worker_not_found`) or path (`not_found`).",
    405: "Method not allowed on this path (`method_not_allowed`; the `Allow` header lists the methods).",
    408: "The request body arrived too slowly or stalled (`request_timeout`).",
    409: "The gateway's state forbids it (`no_config_file`: `POST /admin/reload` without a config file).",
    413: "The request body is over `max_body_bytes` (`request_too_large`).",
    415: "The body is not JSON, or has a content coding the gateway does not decode (`unsupported_media_type`).",
    429: "A rate limit or quota of the key was hit (`rate_limit_exceeded`; `Retry-After` says when to retry).",
    500: "A gateway bug (`server_error`).",
    502: "The engine failed after accepting the request (`upstream_error`).",
    503: "No healthy worker could take the request (`no_healthy_upstream`), or the gateway is shutting down.",
    504: "The engine did not answer in time (`upstream_timeout`), or the overall cap passed (`request_timeout`).",
    529: "Anthropic's `overloaded_error`: no healthy worker could take the request (the OpenAI APIs' 503).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries documenting `statuses` with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


class Health(BaseModel):
    """`GET /health`: the process is alive."""

    status: Literal["ok"]
    pid: int = Field(description="The serving process's id (tells processes behind one port apart).")


class WorkerSnapshot(BaseModel):
    """One worker's state (`Worker.snapshot()`): loads in requests, `kv_usage` a fraction 0..1,
    `*_for_s` seconds left; engine figures are null until the first scrape of its `/metrics`."""

    id: str = Field(description="`pool/index`, as in headers and metric labels.")
    pool: str
    index: int
    url: str
    engine: str
    state: Literal["healthy", "unhealthy", "misconfigured", "ejected", "draining"]
    retired: bool
    healthy: bool
    draining: bool
    in_flight: int
    load: float
    engine_running: float | None
    engine_waiting: float | None
    kv_usage: float | None
    ejections: int
    ejected: bool
    ejected_for_s: float
    busy_for_s: float
    consecutive_failures: int
    failed_probes: int
    last_error: str | None
    misconfigured: str | None


class FleetInFlight(BaseModel):
    """In-flight requests on a drained worker summed over every gateway process that reported in the
    last 3 s through Redis (gateway/backends/drains.py)."""

    in_flight: int
    reporters: int = Field(description="Serving processes (all replicas) whose report is that fresh.")


class WorkerDetail(WorkerSnapshot):
    """`GET /admin/workers/{pool}/{index}`: the snapshot, and for a drained worker with Redis the
    fleet's in-flight count on it (null without Redis; 0 reporters while no process reported)."""

    fleet_in_flight: FleetInFlight | None


class Ready(BaseModel):
    """`GET /ready`: 200 when the pools `readiness.pools` asks for (by default: any one) have a usable
    worker and no shutdown began, else 503. `unready_pools` lists every pool with no usable worker."""

    ready: bool
    draining: bool
    unready_pools: list[str] = Field(description="every pool with no usable worker, whether or not /ready is 200")
    pools: dict[str, list[WorkerSnapshot]] | None = Field(
        default=None, description="Per-pool worker snapshots; absent when auth is enabled.")


class Model(BaseModel):
    """OpenAI's model object (https://platform.openai.com/docs/api-reference/models/object)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = Field(default=None, description="a LoRA adapter's base model (as vLLM and SGLang list "
                               "adapters); absent for the model and its aliases")
    max_model_len: int = Field(description="tokens, prompt + output: the largest context of the pools serving it "
                               "(vLLM's and SGLang's model cards carry the same field)")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class PoolView(BaseModel):
    """A configured pool with its workers (`admin.pools_view`)."""

    name: str
    engine: str
    max_context_tokens: int
    policy: str
    ready: bool
    workers: list[WorkerSnapshot]
    retiring: list[WorkerSnapshot] = Field(description="Removed workers whose requests are still finishing.")
    discovery: dict[str, Any] | None = Field(description="DNS discovery status; null for a static pool.")


class WorkerList(BaseModel):
    pools: list[PoolView]


class DrainedWorker(WorkerSnapshot):
    """The worker after a drain/undrain; `shared`: every replica follows (Redis), not just this process;
    `store`: where it was kept (gateway/backends/drains.py, DrainStore)."""

    shared: bool
    store: Literal["redis", "redis_down", "local"]


class ReloadResult(BaseModel):
    reloaded: Literal[True]
    changes: list[str]
    restart_required: list[str] = Field(description="Config sections that changed but need a restart.")


class RecentTraffic(BaseModel):
    """`StatusWindow.recent`: traffic over the last `span_s` seconds, in total and per pool."""

    span_s: float
    total: dict[str, Any]
    pools: dict[str, dict[str, Any]]


class Status(BaseModel):
    """`GET /admin/status`: what the status page shows."""

    time_unix: float
    started_unix: float
    shutting_down: bool
    ready: bool
    pools: list[PoolView]
    recent: RecentTraffic


class _EngineCompletion(BaseModel):
    """The fields every OpenAI-compatible engine sends in a non-streamed completion (relayed unchanged)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ChatCompletion(_EngineCompletion):
    """A non-streamed chat completion as the engine answers it
    (https://platform.openai.com/docs/api-reference/chat/object)."""


class Completion(_EngineCompletion):
    """A non-streamed (legacy) completion as the engine answers it
    (https://platform.openai.com/docs/api-reference/completions/object)."""


class AnthropicErrorObject(BaseModel):
    """Anthropic's error: `type` is `invalid_request_error`, `authentication_error`, `permission_error`,
    `not_found_error`, `request_too_large`, `rate_limit_error`, `api_error` or `overloaded_error`
    (https://docs.anthropic.com/en/api/errors)."""

    model_config = ConfigDict(extra="forbid")
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error on `/v1/messages*`: `{"type": "error", "error": {"type", "message"}, "request_id"}`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["error"]
    error: AnthropicErrorObject
    request_id: str | None = None


class AnthropicMessage(BaseModel):
    """A non-streamed Messages answer as the engine sends it, relayed unchanged
    (https://docs.anthropic.com/en/api/messages)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    model: str


class AnthropicTokenCount(BaseModel):
    """`POST /v1/messages/count_tokens`'s answer, from the engine."""

    input_tokens: int


class ResponseObject(BaseModel):
    """A Responses API response object as the engine sends it, relayed unchanged (a deleted one is
    `{"id", "object": "response", "deleted": true}`; https://platform.openai.com/docs/api-reference/responses)."""

    id: str
    object: Literal["response"]


class EmbeddingList(BaseModel):
    """`POST /v1/embeddings`'s answer as the engine sends it, relayed unchanged: `data` holds one
    `{"index", "object": "embedding", "embedding"}` per input, the embedding a list of floats or, with
    `encoding_format: base64`, the base64 of its float32 values (https://platform.openai.com/docs/api-reference/embeddings;
    vLLM's `EmbeddingResponse`, `vllm/entrypoints/pooling/embed/protocol.py`)."""

    object: str
    data: list[dict[str, Any]]
    model: str | None = None
    usage: dict[str, Any] | None = None


class RerankResult(BaseModel):
    """`POST /v1/rerank`'s answer as the engine sends it, relayed unchanged: `results` holds
    `{"index", "document", "relevance_score"}` by relevance (vLLM's `RerankResponse`,
    `vllm/entrypoints/pooling/score/protocol.py`)."""

    id: str
    model: str
    results: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ScoreList(BaseModel):
    """`POST /v1/score`'s answer as the engine sends it, relayed unchanged: `data` holds one
    `{"index", "object": "score", "score"}` per pair (vLLM's `ScoreResponse`,
    `vllm/entrypoints/pooling/score/protocol.py`)."""

    id: str
    object: str
    model: str
    data: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
