"""The simulator's engine request ids, formed as vLLM forms them, and its refusal of an id that is
already running.

How vLLM's OpenAI server names a request (`vllm/entrypoints/openai/serving_engine.py`
`_base_request_id`: the `X-Request-Id` header, else the body's `request_id`, else a random uuid):
chat `chatcmpl-{base}` (`serving_chat.py`, the Messages API's too, which it serves as chat),
completions `cmpl-{base}` (`serving_completion.py`). The Responses API takes the body's
`request_id` as it is (`ResponsesRequest.request_id` in `protocol.py`, default `resp_` + a uuid):
that is also the id of the response it answers and stores (`serving_responses.py`:
`ResponsesResponse.from_request`, `msg_store[request.request_id]`), so the simulator's Responses
API uses it as the response id (`responses_api.py`).

vLLM's engine refuses a request whose id is running already: `OutputProcessor.add_request` raises
`ValueError(f"Request id {request_id} already running.")` (`vllm/v1/engine/output_processor.py`),
which the OpenAI server answers as a 400 `BadRequestError` (`create_error_response(str(e))`), or,
once a chat / completions stream has started, as one `data: {"error": ...}` event and `[DONE]`.
vLLM versions that append a random suffix to every id before the engine sees it
(`InputProcessor.assign_request_id`) no longer collide; the simulator plays the versions that keep
the id as given, which a gateway in front of them must survive. SGLang workers are not checked.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.sim.dialects import ErrorReply

VLLM_FAMILY = ("vllm", "ascend")


def engine_request_id(kind: str, headers: dict[str, str], body: dict[str, Any]) -> str:
    """The id vLLM gives a request of `kind` ("chat", "text" or "responses") with these (lower-cased)
    headers and this body."""
    given = body.get("request_id")
    if kind == "responses":
        return given if isinstance(given, str) and given else f"resp_{uuid.uuid4().hex}"
    base = headers.get("x-request-id") or (given if isinstance(given, str) and given else uuid.uuid4().hex)
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}"


class RunningIds:
    """The ids of the requests an engine runs now (vLLM's `OutputProcessor.request_states` keys)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def claim(self, request_id: str) -> bool:
        """Start running `request_id`: False (nothing changed) when it is running already."""
        if request_id in self._ids:
            return False
        self._ids.add(request_id)
        return True

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted)."""
        self._ids.discard(request_id)


def already_running(dialect_error: Any, request_id: str, stream: bool) -> ErrorReply:
    """vLLM's answer to a duplicate running id: the 400 (`dialect_error` is the engine dialect's
    `error`), in-band for a started chat / completions stream (`stream`)."""
    reply: ErrorReply = dialect_error(f"Request id {request_id} already running.", "BadRequestError", 400)
    if not stream:
        return reply
    return ErrorReply(200, reply.body, in_band_stream=True, stream_event=b"data: " + reply.body + b"\n\n")
