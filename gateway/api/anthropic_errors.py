"""Anthropic's Messages endpoints (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the proxy
endpoint, with every error it answers in Anthropic's shape.

The request path is the chat one (`ProxyEndpoint`, `ProxyService`); only the errors differ. They
are made in OpenAI's shape along that path (the gateway's own and the engines' 4xx, which
`errors.error_bytes_from_upstream` already normalised) and rewritten here as the response starts:
`{"type": "error", "error": {"type", "message"}, "request_id"}` with Anthropic's type for the
status (https://docs.claude.com/en/api/errors). A 503 (no worker can take the request now) is
answered as Anthropic's 529 `overloaded_error`, which the Anthropic SDKs and coding agents treat
as "busy, retry"; its `Retry-After` stays. Errors mid-stream are Anthropic `event: error` events
(`protocol.sse.sse_error_event`). Each answer also carries Anthropic's `request-id` header (the
gateway's request id), which the SDKs expose as `_request_id`.
"""

from __future__ import annotations

import orjson

from gateway.api.proxy import Message, ProxyEndpoint, Receive, Scope, Send
from gateway.auth.guard import MISSING_KEY
from gateway.protocol.anthropic import error_body

OVERLOADED_STATUS = 529
MISSING_ANTHROPIC_KEY = ("You didn't provide an API key. Send it in an x-api-key header "
                         "(or as Authorization: Bearer YOUR_KEY).")


def anthropic_error(status: int, body: bytes, request_id: str | None) -> tuple[int, bytes]:
    """The Anthropic status and error body for an OpenAI-shaped error answer (`body`); a body that
    is not one (an encoded engine answer) keeps its bytes but is wrapped with its text as message."""
    try:
        data = orjson.loads(body)
        message = data["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body[:2000].decode("utf-8", "replace") or f"HTTP {status}"
    if not isinstance(message, str):
        message = str(message)
    if message == MISSING_KEY:  # OpenAI's wording names only its own header
        message = MISSING_ANTHROPIC_KEY
    if status == 503:
        status = OVERLOADED_STATUS
    return status, error_body(status, message, request_id)


class AnthropicEndpoint(ProxyEndpoint):
    """`ProxyEndpoint` for the Anthropic APIs (`messages`, `count_tokens`): the same request path,
    errors in Anthropic's shape (module docstring)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pending: Message | None = None  # an error answer's start, sent with its rewritten body

        async def anthropic_send(message: Message) -> None:
            nonlocal pending
            kind = message["type"]
            if kind == "http.response.start":
                headers = list(message.get("headers", ()))
                request_id = next((v for k, v in headers if k == b"x-request-id"), None)
                if request_id is not None:
                    headers.append((b"request-id", request_id))
                message = {**message, "headers": headers}
                if message["status"] >= 400:
                    pending = message
                    return
            elif kind == "http.response.body" and pending is not None:
                start, pending = pending, None
                headers = start["headers"]
                request_id = next((v.decode("latin-1") for k, v in headers if k == b"request-id"), None)
                status, body = anthropic_error(start["status"], message.get("body", b""), request_id)
                headers = [(k, v) for k, v in headers if k not in (b"content-length", b"content-type",
                                                                   b"content-encoding")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({**start, "status": status, "headers": headers})
                message = {"type": "http.response.body", "body": body, "more_body": False}
            await send(message)

        await super().__call__(scope, receive, anthropic_send)
