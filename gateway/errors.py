"""Gateway errors and their OpenAI error objects, in one place.

Every error leaves the gateway as `{"error": {"message", "type", "param", "code"}}` with an HTTP
status, the shape OpenAI's API uses (https://platform.openai.com/docs/guides/error-codes). Types
follow OpenAI's: `invalid_request_error` (400/404/413, and 401 with code `invalid_api_key`),
`permission_error` (403), `requests` / `tokens` for 429 `rate_limit_exceeded` (the limit hit, as
OpenAI's rate-limit errors say), `server_error` (5xx).

An answer retrying cannot change (`FINAL_STATUSES`: a wrong key, a missing scope, an unknown
model or path, a malformed or too long request) carries `x-should-retry: false`: the OpenAI and
Anthropic SDKs read that header before the status (`_should_retry` in `openai/_base_client.py` and
`anthropic/_base_client.py`: "If the server explicitly says whether or not to retry, obey"), and so
do agents with retry loops of their own (Claude Code retried a wrong key's 401 for minutes without
it). 408, 429 and 5xx answers carry none of it (a later try may pass), except where the gateway
knows better (a request larger than its key's whole token limit, `auth/guard.py`).
"""

from __future__ import annotations

from typing import Any

import orjson

NO_RETRY = "x-should-retry"
"""The response header the OpenAI and Anthropic SDKs obey before the status (`"false"`: never resent)."""

FINAL_STATUSES = frozenset({400, 401, 403, 404, 405, 409, 413, 415, 422})
"""Statuses of the gateway's own answers that a retry of the same request cannot change; 409 is
`Conflict` (the gateway's configuration forbids the call), which the SDKs would retry as a lock
timeout. Their answers carry `x-should-retry: false` (module docstring)."""


class GatewayError(Exception):
    """Base error: an HTTP status and an OpenAI error object.

    `headers` are extra response headers (e.g. `Retry-After`), `x-should-retry: false` among them
    for a status in `FINAL_STATUSES` (unless the caller set it).
    """

    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers) if headers else {}
        if self.status in FINAL_STATUSES:
            self.headers.setdefault(NO_RETRY, "false")

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.body())


class InvalidRequest(GatewayError):
    """400: the request is malformed or asks for something no pool can do."""

    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """400 `context_length_exceeded`: prompt + output tokens exceed the largest pool's context."""

    code = "context_length_exceeded"


class ModelNotFound(GatewayError):
    """404 `model_not_found`, worded as OpenAI words it."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class ModelNotPermitted(ModelNotFound):
    """404 `model_not_found` for a model the caller's key may not use: in status, body and headers
    exactly the answer of a model that does not exist (`ModelNotFound`, naming the model as the
    client sent it), raised where that one is, before any estimate or upstream work. `model`: the
    resolved name (`RoutingRequest.model`), for the gateway's own accounting, never in the answer."""

    def __init__(self, message: str, *, model: str = "", param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.model = model


class NotFound(GatewayError):
    """404 for an unknown path."""

    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ApiNotServed(GatewayError):
    """404: no pool's engines serve the request's API (e.g. Anthropic's Messages on MindIE pools)."""

    status = 404
    error_type = "invalid_request_error"
    code = "api_not_served"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(GatewayError):
    """409: the request is valid but the gateway's current state forbids it (RFC 9110 15.5.10), e.g.
    `POST /admin/reload` on a gateway not started from a config file."""

    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(GatewayError):
    """413: the request body is over `max_body_bytes`."""

    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class NoCapacity(GatewayError):
    """503: no healthy worker could take the request (all down, ejected or tried)."""

    status = 503
    error_type = "server_error"
    code = "no_healthy_upstream"


class UpstreamError(GatewayError):
    """502: the engine failed after accepting the request, or answered garbage."""

    status = 502
    error_type = "server_error"
    code = "upstream_error"


class UpstreamTimeout(GatewayError):
    """504: the engine did not answer in time."""

    status = 504
    error_type = "server_error"
    code = "upstream_timeout"


class RequestTimeout(GatewayError):
    """504 `request_timeout`: the request ran past the gateway's overall cap (`timeouts.total`)."""

    status = 504
    error_type = "server_error"
    code = "request_timeout"


class RequestBodyTimeout(InvalidRequest):
    """408 `request_timeout`: the client's body stalled (`timeouts.body_idle`) or was still uploading
    when the overall cap (`timeouts.total`) passed."""

    status = 408
    code = "request_timeout"


class InvalidApiKey(GatewayError):
    """401 `invalid_api_key`: no, a malformed or an unknown `Authorization: Bearer` key."""

    status = 401
    error_type = "invalid_request_error"  # what OpenAI sends with code invalid_api_key
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    """403: the key is valid but lacks the scope the route needs (e.g. `admin`)."""

    status = 403
    error_type = "permission_error"
    code = "insufficient_permissions"


class RateLimited(GatewayError):
    """429 `rate_limit_exceeded` for a per-key limit. `type` is the limit that refused the request,
    `requests` or `tokens`, as OpenAI sends it (`{"type": "tokens", "code": "rate_limit_exceeded"}`)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, limit: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)
        self.error_type = limit


class RateLimitUnavailable(GatewayError):
    """503: the rate limiter's Redis cannot answer and `auth.fail_mode` is `closed`."""

    status = 503
    error_type = "server_error"
    code = "rate_limit_unavailable"


class RateLimitBusy(RateLimitUnavailable):
    """503 `rate_limit_unavailable` whatever `auth.fail_mode` says: the gateway itself was too busy to
    get this request's rate-limit decision in time (every Redis connection taken for the wait
    deadline, or its event loop held through the call). Redis is fine, so the limits are not off:
    passing the request would let a burst through its key's limit (issue 25 §1)."""


def error_bytes_from_upstream(status: int, body: bytes, code: str | None = None, param: str | None = None) -> bytes:
    """An engine's 4xx answer as exactly an OpenAI error object `{"error": {message, type, param, code}}`
    (`upstream_error_object`)."""
    return orjson.dumps({"error": upstream_error_object(status, body, code, param)})


def upstream_error_object(status: int, body: bytes, code: str | None = None,
                          param: str | None = None) -> dict[str, Any]:
    """An engine's 4xx answer as the inside of an OpenAI error object: `{message, type, param, code}`.

    vLLM and SGLang answer `{"object": "error", "message", "type", "param", "code"}` (flat, older) or
    `{"error": {...}}`; llama.cpp answers `{"error": {"code", "message", "type", ...}}`; FastAPI's own
    answers (a route or method the engine does not serve: `{"detail": "Method Not Allowed"}`, which
    vLLM's `HTTPException` handler does not catch, as it is registered for FastAPI's subclass, not
    Starlette's: `vllm/entrypoints/serve/exception_handling/register.py`) have their `detail` string
    as the message. The message is kept; `type` follows the status; `param` and `code` are kept only
    when they are strings (`code` and `param` may be given, e.g. `context_length_exceeded` and `messages`: they win);
    anything else an engine adds is dropped.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    inner = data.get("error") if isinstance(data, dict) else None
    source = inner if isinstance(inner, dict) else data if isinstance(data, dict) else {}
    message = source.get("message")
    if (not isinstance(message, str) or not message) and isinstance(data, dict):
        message = data.get("detail")
    if not isinstance(message, str) or not message:
        message = body[:2000].decode("utf-8", "replace") or f"The inference server answered HTTP {status}."
    param = param or source.get("param")
    engine_code = source.get("code")
    return {
        "message": message,
        "type": "invalid_request_error" if status < 500 else "server_error",
        "param": param if isinstance(param, str) else None,
        "code": code or (engine_code if isinstance(engine_code, str) else None),
    }
