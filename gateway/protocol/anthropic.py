"""Anthropic Messages API wire models, and the chat request a Messages request is routed as
(imports pydantic only).

Shapes follow https://docs.claude.com/en/api/messages (`POST /v1/messages`) and
/messages-count-tokens (`POST /v1/messages/count_tokens`): `model`, `messages` of `user` /
`assistant` turns whose `content` is a string or content blocks (`text`, `image` with a `base64` or
`url` source, `tool_use`, `tool_result`, `thinking`, `redacted_thinking`, `document`...), an optional
top-level `system` (a string or text blocks), `max_tokens` (required on `/v1/messages`, absent on
count_tokens), `stream`, `tools`. Validation is as strict as the OpenAI models (`"5"` is not an
integer); unknown fields and block types are kept and forwarded to the engine unchanged, but
for `search_result` and plain-text `document` blocks, which `portable_blocks` turns into text.

`to_chat(request)` is the canonical conversation routing reads: the chat messages the engines build
from a Messages request (vLLM's `entrypoints/anthropic/serving.py` and SGLang's
`srt/entrypoints/anthropic/serving.py` translate it into their chat request, read 2026-11):
`system` first as one system message (its text blocks joined by a newline, as SGLang joins them;
vLLM joins them with nothing), then each turn in order (a `system` turn among them stays a system
message in its place, as llama.cpp renders it and vLLM and SGLang do when the chat template can
place it: prefix hashes then change only at the end of a growing conversation, which is why vLLM
keeps it there rather than hoisting it into the leading system prompt); a user turn's `tool_result` blocks become
`tool` messages (in place, before the rest of that turn's blocks; text blocks joined by newlines,
with images as parts), an assistant turn's `tool_use` blocks become its `tool_calls` (arguments
as Python's `json.dumps` writes them, as both engines do), images become `image_url` parts (a
base64 source as a `data:` URI), one text block a plain string turn; `thinking` text is kept as
`reasoning_content` (chat templates drop it from earlier turns, so it is neither hashed nor
counted); Claude Code's attribution blocks are left out, as vLLM leaves them out of the prompt
(`ATTRIBUTION_PREFIX`; `attribution_text` is what the estimate still counts). A conversation that
alternates between Messages and Chat therefore hashes the same prefix blocks wherever the engine
sees the same prompt.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from gateway.protocol.openai import WHOLE

MAX_TOKENS_LIMIT = 2**31 - 1


class _Open(BaseModel):
    """Extra fields are accepted (and forwarded by the gateway untouched)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class TextBlock(_Open):
    type: Literal["text"]
    text: StrictStr


class Base64Source(_Open):
    type: Literal["base64"]
    media_type: StrictStr
    data: StrictStr


class URLSource(_Open):
    type: Literal["url"]
    url: StrictStr = Field(min_length=1)


class OtherSource(_Open):
    """A source the gateway does not model (`file`, `text`, `content`): forwarded, not measured."""

    type: StrictStr


def _source_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in ("base64", "url") else "other"


ImageSource = Annotated[
    Annotated[Base64Source, Tag("base64")] | Annotated[URLSource, Tag("url")] | Annotated[OtherSource, Tag("other")],
    Discriminator(_source_tag, custom_error_type="invalid_source",
                  custom_error_message="an image source must be an object with a string 'type'"),
]


class ImageBlock(_Open):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]




class ThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class OtherBlock(_Open):
    """A block type the gateway does not model (`redacted_thinking`, `document`, `search_result`...):
    forwarded unchanged, the engine decides; its tokens are not counted."""

    type: StrictStr


_MODELLED_BLOCKS = {"text", "image", "tool_use", "tool_result", "thinking"}


def _block_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in _MODELLED_BLOCKS else "other"


class ToolResultBlock(_Open):
    """A tool's result: text, or blocks (text and images: a computer-use screenshot is counted)."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ContentBlock] | None = None
    is_error: StrictBool | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")] | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag, custom_error_type="invalid_block",
                  custom_error_message="a content block must be an object with a string 'type'"),
]


class Message(_Open):
    """One turn of `messages`. Besides `user` and `assistant`, a `system` turn anywhere in the list:
    Claude Code 2.1 sends one mid-conversation (a system reminder). vLLM (0.33.0
    `entrypoints/anthropic/protocol.py` types the role user/assistant/system; its `serving.py` keeps
    the turn in place when the chat template renders a late system message, else merges it into the
    leading system prompt; its main branch's `inline_system.py` folds it into the neighbouring user
    turn instead), SGLang (0.5.23 `srt/entrypoints/anthropic/protocol.py` and `serving.py`: the same
    role type, kept in place or merged by the same template test) and llama.cpp's server
    (`tools/server/server-chat.cpp`, `server_chat_convert_anthropic_to_oai`: every role passed on as it
    is) accept it, so the gateway forwards it unchanged and lets the engine place it for its
    template. Any other non-empty role is forwarded too (llama.cpp passes it to its template; vLLM
    and SGLang answer their own 400), never refused here."""

    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[ContentBlock]


class Tool(_Open):
    """A client tool (`name`, `description`, `input_schema`); server tools (`type`: `web_search_...`)
    pass as they are."""

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None


class Metadata(_Open):
    user_id: StrictStr | None = None


class CountTokensRequest(_Open):
    """`POST /v1/messages/count_tokens` body (the fields routing reads).

    The gateway forwards it rather than answering from its own estimate: the engine counts with
    the model's tokenizer and chat template, exactly what the client asks ("will this fit, what
    will it cost"), while the gateway's estimate deliberately over-counts (it routes by it). It is
    routed like the Messages request it counts (so to a pool whose engines serve count_tokens:
    vLLM, SGLang and llama.cpp all do), with no output reserved and no tokens charged."""

    model: StrictStr = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` body (the fields routing reads): `max_tokens` is required (Anthropic's
    API refuses a request without it) and is the request's output reservation."""

    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT), WHOLE]
    stream: StrictBool | None = False
    metadata: Metadata | None = None


def _tool_content(content: str | list[Any] | None) -> str | list[dict[str, Any]]:
    """A tool result's content as the tool message's: a string, its text blocks joined by newlines,
    or (with an image among them) text and image parts, so the images are counted."""
    if content is None or isinstance(content, str):
        return content or ""
    if not any(isinstance(block, ImageBlock) for block in content):
        return "\n".join(block.text for block in content if isinstance(block, TextBlock))
    return [{"type": "text", "text": block.text} if isinstance(block, TextBlock) else _image_part(block)
            for block in content if isinstance(block, (TextBlock, ImageBlock))]


def _image_part(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    if isinstance(source, Base64Source):
        url = f"data:{source.media_type};base64,{source.data}"
    elif isinstance(source, URLSource):
        url = source.url
    else:  # a file id or other source: counted at the configured image cost, hashed by its JSON
        url = "anthropic-source:" + orjson.dumps(source.model_dump()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


ATTRIBUTION_PREFIX = "x-anthropic-billing-header"
"""How Claude Code's attribution line begins: the first `system` text block of each of its requests,
`x-anthropic-billing-header: cc_version=<version>.<fingerprint>; cc_entrypoint=<entrypoint>;` and
more fields towards Anthropic's own API, where the fingerprint is 3 hex digits of a SHA-256 over
characters of the session's first user message (so it differs between sessions, and towards
Anthropic a `cch=` field per request). vLLM leaves every system text block that starts with it out
of the prompt, in the top-level `system` and in `system` turns (`_convert_system_message` and
`_extract_system_text` in `vllm/entrypoints/anthropic/serving.py`, 0.32.0), so its prefix cache
serves one Claude Code session's system prompt and tools to the next; SGLang keeps it
(`python/sglang/srt/entrypoints/anthropic/request_conversion.py` joins every system text block) and
llama.cpp keeps it with `cch` overwritten (`normalize_anthropic_billing_header` in
`tools/server/server-chat.cpp`)."""


def is_attribution(text: str) -> bool:
    """Whether a system text is Claude Code's attribution line (`ATTRIBUTION_PREFIX`), which vLLM's
    prompt leaves out."""
    return text.startswith(ATTRIBUTION_PREFIX)


def _system_message(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    """The leading system message: a string as it is (vLLM keeps even an attribution string), text
    blocks joined by newlines but the attribution blocks, which vLLM leaves out (`is_attribution`)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(
        block.text for block in system if not is_attribution(block.text))
    return [{"role": "system", "content": text}] if text else []


def attribution_text(request: CountTokensRequest) -> str:
    """The attribution blocks (`is_attribution`) of a request's top-level `system` and `system`
    turns, joined by newlines: what `to_chat` leaves out of the canonical conversation, as vLLM
    leaves it out of the prompt, but SGLang and llama.cpp prefill (so it is still counted)."""
    texts: list[str] = []
    if isinstance(request.system, list):
        texts.extend(block.text for block in request.system if is_attribution(block.text))
    for turn in request.messages:
        if turn.role != "system":
            continue
        if isinstance(turn.content, str):
            texts.extend([turn.content] if is_attribution(turn.content) else [])
        else:
            texts.extend(b.text for b in turn.content if isinstance(b, TextBlock) and is_attribution(b.text))
    return "\n".join(texts)


# Roles read as themselves in the canonical conversation; another role (forwarded unchanged) is read
# as a user turn there: its text is still counted and hashed.
_CANONICAL_ROLES = frozenset({"user", "assistant", "system"})


def to_chat(request: CountTokensRequest) -> dict[str, Any]:
    """The chat request (`messages`, `tools`, and for a `MessagesRequest` `max_tokens`, `stream`,
    `user`) a Messages request stands for; see the module docstring for the canonical form. The
    result validates as the gateway's `ChatCompletionRequest`."""
    messages = _system_message(request.system)
    for turn in request.messages:
        content = turn.content
        role = turn.role if turn.role in _CANONICAL_ROLES else "user"
        if role == "system":  # vLLM leaves attribution text out of system turns too
            if isinstance(content, str) and is_attribution(content):
                continue
            if isinstance(content, list):
                content = [b for b in content if not (isinstance(b, TextBlock) and is_attribution(b.text))]
                if not content:
                    continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        results = 0
        for block in content:
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(_image_part(block))
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": _tool_content(block.content)})
                results += 1
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
        if results and not parts and not calls and not reasoning:
            continue  # a user turn of tool results only
        # A turn of unmodelled blocks only (a PDF `document`) stays, empty: the engine reads it.
        message: dict[str, Any] = {"role": role, "content": parts or (None if role == "assistant" else "")}
        if len(parts) == 1 and parts[0]["type"] == "text":
            message["content"] = parts[0]["text"]  # one text block renders as a plain string turn
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        messages.append(message)
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
            for tool in request.tools]
    if isinstance(request, MessagesRequest):
        chat["max_tokens"] = request.max_tokens
        chat["stream"] = bool(request.stream)
        if request.metadata is not None and request.metadata.user_id is not None:
            chat["user"] = request.metadata.user_id
    return chat


def _search_result_text(block: dict[str, Any]) -> str:
    """A `search_result` block as SGLang renders it (0.5.23 `srt/entrypoints/anthropic/serving.py`,
    `_text_from_search_result`): `Title: …`, `Source: …` (a URL, or the source's text), `Content: …`
    (its text blocks, newline-joined), each line only when present."""
    lines: list[str] = []
    if title := block.get("title"):
        lines.append(f"Title: {title}")
    source = block.get("source")
    if isinstance(source, dict):
        if named := source.get("url") or source.get("text"):
            lines.append(f"Source: {named}")
    elif source:
        lines.append(f"Source: {source}")
    content = block.get("content")
    texts = [content] if isinstance(content, str) else [
        part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"
        and isinstance(part.get("text"), str) and part["text"]] if isinstance(content, list) else []
    if texts:
        lines.append("Content: " + "\n".join(texts))
    return "\n".join(lines)


def _document_text(block: dict[str, Any]) -> str | None:
    """A text document's words (a `text` source's `data`, or a `content` source of text blocks only),
    after its `Title: …` and `context` lines; None for any other document (a PDF, a file id, images)."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), list) and all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in source["content"]):
        body = "\n".join(b["text"] for b in source["content"])
    else:
        return None
    head = [f"Title: {block['title']}"] if isinstance(block.get("title"), str) and block["title"] else []
    if isinstance(block.get("context"), str) and block["context"]:
        head.append(block["context"])
    return "\n".join([*head, body])


def _as_text(block: dict[str, Any], text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "text", "text": text}
    if "cache_control" in block:
        out["cache_control"] = block["cache_control"]
    return out


def portable_blocks(payload: dict[str, Any]) -> int:
    """Rewrite, in place, the content blocks that some engine kinds refuse or drop into the text an
    engine that reads them renders, so that every engine sees their words; returns how many.

    - `search_result` (a tool's cited search hit): SGLang renders it as text (see
      `_search_result_text`), vLLM 0.33.0 refuses the block type (400), llama.cpp's server drops it
      unread. As SGLang's text it means the same to SGLang and reaches the other two.
    - `document` of plain text (a `text` or text-only `content` source): vLLM and SGLang refuse the
      type, llama.cpp drops it; as a text block (title, context, then the text) all three read it.
      A PDF, file or image document is left as it is: no engine reads it, and its words cannot be
      had without a PDF reader (the engine's own 400, or llama.cpp's silence, says so).

    Both in a turn's `content` and inside a `tool_result`'s `content`; `cache_control` is kept.
    Anything malformed is left for the request's validation to refuse."""
    rewritten = 0

    def walk(blocks: list[Any]) -> None:
        nonlocal rewritten
        for i, block in enumerate(blocks):
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "tool_result" and isinstance(block.get("content"), list):
                walk(block["content"])
            elif kind == "search_result":
                blocks[i] = _as_text(block, _search_result_text(block))
                rewritten += 1
            elif kind == "document" and (text := _document_text(block)) is not None:
                blocks[i] = _as_text(block, text)
                rewritten += 1

    messages = payload.get("messages")
    for turn in messages if isinstance(messages, list) else []:
        if isinstance(turn, dict) and isinstance(turn.get("content"), list):
            walk(turn["content"])
    return rewritten


_PROMPT_SPLIT = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _count(usage: dict[str, Any], name: str) -> int | None:
    value = usage.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def merge_stream_usage(merged: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """The usage of a Messages stream so far (`merged`, Anthropic's names) with one more event's
    `usage` (`message_start`'s message's, `message_delta`'s, an earlier SGLang layer's
    `message_stop`'s): a new dict, for `openai_usage`.

    The prompt's counts (`input_tokens` and the cache fields) are one group: an event that carries a
    cache field states the whole split, so its group replaces the one before (vLLM 0.32,
    `vllm/entrypoints/anthropic/serving.py` `_build_anthropic_usage`: the whole prompt as
    `input_tokens` in `message_start`, whose chat chunk has no `prompt_tokens_details`, then in
    `message_delta` the uncached part as `input_tokens` beside `cache_read_input_tokens` and
    `cache_creation_input_tokens`, a zero `input_tokens` when those cover the prompt; SGLang: zeros
    and `cache_read_input_tokens: 0` at the start, the whole prompt and its cached part at the end).
    An event without cache fields keeps the larger `input_tokens` (llama.cpp and Anthropic send the
    prompt only at the start; a zero later never hides a count reported before), and raises a split
    only past its total. Any other count (`output_tokens`) keeps its largest: counts only grow."""
    out = dict(merged)
    if any(_count(usage, name) is not None for name in _PROMPT_SPLIT):
        for name in ("input_tokens", *_PROMPT_SPLIT):
            out[name] = _count(usage, name) or 0
        usage = {k: v for k, v in usage.items() if k != "input_tokens" and k not in _PROMPT_SPLIT}
    elif (prompt := _count(usage, "input_tokens")) is not None:
        usage = {k: v for k, v in usage.items() if k != "input_tokens"}
        if any(name in out for name in _PROMPT_SPLIT):
            if prompt > sum(_count(out, name) or 0 for name in ("input_tokens", *_PROMPT_SPLIT)):
                out = {k: v for k, v in out.items() if k not in _PROMPT_SPLIT}
                out["input_tokens"] = prompt
        else:
            out["input_tokens"] = max(prompt, _count(out, "input_tokens") or 0)
    for name, value in usage.items():
        if isinstance(value, int) and not isinstance(value, bool):
            old = _count(out, name)
            out[name] = value if old is None else max(value, old)
    return out


def openai_usage(usage: dict[str, Any], cache_in_input: bool = False) -> dict[str, Any]:
    """An engine's usage object in OpenAI's names, which the gateway accounts by (token limits,
    `kimi_gateway_tokens_total`): an Anthropic one (`input_tokens`, `output_tokens`,
    `cache_read_input_tokens`, `cache_creation_input_tokens`) becomes `prompt_tokens`,
    `completion_tokens` and `prompt_tokens_details.cached_tokens`; any other usage is returned as it is.

    Anthropic counts the cached parts apart from `input_tokens`, so by default the prompt is all
    three, as vLLM 0.32 splits it (`vllm/entrypoints/anthropic/serving.py` `_build_anthropic_usage`:
    `input_tokens` = `prompt_tokens` less `cache_read_input_tokens` and `cache_creation_input_tokens`,
    with `--enable-prompt-tokens-details`; without it only `input_tokens`, the whole prompt);
    llama.cpp sends no cache fields. With `cache_in_input` (`EngineSpec.messages_cache_in_input`:
    SGLang, whose `srt/entrypoints/anthropic/serving.py` sends its chat usage's `prompt_tokens` as
    `input_tokens` and the cached part of it again as `cache_read_input_tokens`) the prompt is
    `input_tokens`. A missing `input_tokens` counts 0 (`quota_used` then charges the prompt
    estimate). A stream's events are merged first (`merge_stream_usage`)."""
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return usage
    def count(name: str) -> int:
        return _count(usage, name) or 0
    cached = count("cache_read_input_tokens")
    prompt = count("input_tokens")
    if not cache_in_input:
        prompt += cached + count("cache_creation_input_tokens")
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": count("output_tokens")}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


# Anthropic's error type for each HTTP status (https://docs.claude.com/en/api/errors); another 4xx
# is an invalid_request_error, as Anthropic says it uses that type for unlisted 4xx codes.
ERROR_TYPES: dict[int, str] = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                               500: "api_error", 504: "timeout_error", 529: "overloaded_error"}

# The status an engine's Anthropic error type stands for (the reverse of ERROR_TYPES).
ERROR_STATUS: dict[str, int] = {kind: status for status, kind in ERROR_TYPES.items()}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status: the listed ones, other 4xx `invalid_request_error`,
    503 `overloaded_error`, other 5xx `api_error`."""
    if (kind := ERROR_TYPES.get(status)) is not None:
        return kind
    if status == 503:
        return "overloaded_error"
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str, request_id: str | None = None) -> bytes:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}, "request_id"}`."""
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return orjson.dumps(body)


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""A chat finish reason as Anthropic's stop reason, mapped as vLLM's and SGLang's Messages layers map
it (`vllm/entrypoints/anthropic/serving.py` `stop_reason_map`, SGLang's `STOP_REASON_MAP`)."""


def continuation_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages body (`POST /v1/messages`, as sent) stands for, with the sampling
    the engines' Messages layers pass on (vLLM's `_build_base_request`, SGLang's
    `_convert_to_chat_completion_request`: `temperature`, `top_p`, `top_k`, `stop_sequences` as
    `stop`): what a Messages answer is continued by on the engine's chat API. Raises pydantic's
    ValidationError for a body that is not a Messages request."""
    chat = to_chat(MessagesRequest.model_validate(body))
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    return chat


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def text_delta_event(index: int, text: str) -> bytes:
    """A `content_block_delta` event adding `text` to the text block at `index`."""
    return _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "text_delta", "text": text}})


def message_end_events(index: int, stop_reason: str | None, usage: dict[str, Any] | None) -> bytes:
    """The end of a message whose text block `index` is open: `content_block_stop`, `message_delta`
    (its stop reason and, from `usage` in OpenAI's names, `input_tokens` and `output_tokens`),
    `message_stop`."""
    delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None}}
    if isinstance(usage, dict):
        delta["usage"] = {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}
    return (_event("content_block_stop", {"type": "content_block_stop", "index": index})
            + _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"}))


def sse_error(message: str, status: int = 500) -> bytes:
    """One Anthropic SSE error event (`event: error`), what the Anthropic SDKs raise on mid-stream."""
    return b"event: error\ndata: " + error_body(status, message) + b"\n\n"


ToolResultBlock.model_rebuild()
Message.model_rebuild()
