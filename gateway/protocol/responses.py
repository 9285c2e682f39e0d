"""The OpenAI Responses API as the gateway reads it: the request model and the few facts the
relay observes in an engine's answer.

Sources: OpenAI's API reference (https://platform.openai.com/docs/api-reference/responses: the
request fields `input`, `instructions`, `max_output_tokens`, `previous_response_id`, `store`,
`background`, the input item types, the streaming events `response.created` ... `response.completed`
with their `sequence_number`, and the usage object `input_tokens` / `output_tokens`), and vLLM's
`entrypoints/openai/serving_responses.py` + its api router, which serve `POST /v1/responses`,
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` (no DELETE), write each event as
`event: <type>\\ndata: <json>\\n\\n`, and keep stored responses in a dict in their process memory
(SGLang's serving_responses is adapted from vLLM's and keeps them the same way).

The request model is permissive like the chat one: it validates what the gateway routes by and
lets every other field through to the engine unchanged (`extra="allow"`).
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from gateway.protocol.openai import WHOLE

RESPONSE_ID_MAX = 256
"""Longest response id the gateway looks up (vLLM's are `resp_` + 32 hex digits)."""


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (OpenAI's Responses API). Units: tokens for `max_output_tokens`.

    `input` is a string (one user message) or a list of items: messages (`{"role", "content"}`, the
    content a string or parts `input_text` / `input_image` / ...), `function_call`,
    `function_call_output`, `reasoning` and other typed items, all forwarded unchanged.
    `store` defaults to true in OpenAI's API and in vLLM's request model (vLLM only keeps the
    response with `VLLM_ENABLE_RESPONSES_API_STORE=1`); `background` requires `store`.
    """

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: StrictStr | Annotated[list[dict[str, Any]], Field(min_length=1)]  # [] is refused (size check first)
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=2**31 - 1), WHOLE] | None = None
    previous_response_id: StrictStr | None = Field(default=None, min_length=1, max_length=RESPONSE_ID_MAX)
    store: StrictBool | None = True
    background: StrictBool | None = False
    stream: StrictBool | None = False
    user: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None


def item_text_and_images(item: dict[str, Any]) -> tuple[list[bytes], list[str], int]:
    """The prompt text (UTF-8 pieces), image URLs and uncountable images (`file_id`) of one input
    item. A message contributes its content; a `function_call` its name and arguments; a
    `function_call_output` its output; any other item its JSON (the template renders it somehow)."""
    kind = item.get("type")
    texts: list[bytes] = []
    urls: list[str] = []
    others = 0
    if kind in (None, "message") and "role" in item:
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                ptype = part.get("type")
                if ptype in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
                    texts.append(part["text"].encode("utf-8", "surrogatepass"))
                elif ptype == "input_image":
                    url = part.get("image_url")
                    if isinstance(url, str) and url:
                        urls.append(url)
                    else:
                        others += 1
                elif ptype == "refusal" and isinstance(part.get("refusal"), str):
                    texts.append(part["refusal"].encode("utf-8", "surrogatepass"))
        return texts, urls, others
    if kind == "function_call":
        for key in ("name", "arguments"):
            if isinstance(item.get(key), str):
                texts.append(item[key].encode("utf-8", "surrogatepass"))
        return texts, urls, others
    value = item.get("output") if kind == "function_call_output" else item
    if isinstance(value, str):
        texts.append(value.encode("utf-8", "surrogatepass"))
    else:
        with contextlib.suppress(TypeError):  # nested deeper than orjson writes: the engine judges it
            texts.append(orjson.dumps(value))
    return texts, urls, others


# --- what the relay observes in an engine's answer ---------------------------------------------------------

PREAMBLE_EVENTS = frozenset({
    "response.created", "response.in_progress", "response.queued", "response.output_item.added",
    "response.content_part.added", "response.reasoning_part.added",
})
"""Events before the first generated token: like chat's role-only first chunk, they carry nothing
the client waits for, so the relay may hold them and fail over unseen (`streaming.classify_event`)."""

ERROR_EVENTS = frozenset({"error", "response.failed"})
"""An engine's failure reported inside the stream (OpenAI's `error` event, `response.failed`)."""

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The last event of a complete Responses stream (there is no `data: [DONE]` in this API)."""


def response_id_of(payload: Any) -> str | None:
    """The response id of a decoded JSON answer (`{"id": "resp_…", "object": "response"}`) or of a
    stream event that carries the response (`response.created`: `{"response": {"id": …}}`)."""
    if not isinstance(payload, dict):
        return None
    inner = payload.get("response")
    source = inner if isinstance(inner, dict) else payload
    rid = source.get("id")
    return rid if isinstance(rid, str) and 0 < len(rid) <= RESPONSE_ID_MAX else None


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses usage object (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`)
    with the chat names added (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details`), which
    the gateway's accounting (quotas, `kimi_gateway_tokens_total`) reads. Other usages are returned as is."""
    if "prompt_tokens" in usage or not isinstance(usage.get("input_tokens"), int):
        return usage
    chat = {**usage, "prompt_tokens": usage["input_tokens"], "completion_tokens": usage.get("output_tokens")}
    if isinstance(usage.get("input_tokens_details"), dict):
        chat["prompt_tokens_details"] = usage["input_tokens_details"]
    return chat
