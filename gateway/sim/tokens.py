"""Token accounting of the simulator: a deterministic stand-in for a tokenizer.

Prompt tokens = ceil(UTF-8 bytes of all prompt text / bytes_per_token) + image_tokens per image
part + message_overhead_tokens per chat message (+ the JSON text of a chat request's `tools`:
`tools_tokens`). Output text is one word per token, drawn in order
from `OUTPUT_WORDS`, which mixes ASCII with 2-, 3- and 4-byte UTF-8 characters so that relays get
multi-byte characters to split.

For the prefix cache a prompt also gets a byte stand-in for its token sequence (`prompt_keys`):
chat messages become canonical bytes (per message: role, a separator, the text of each part, an
image as an 8-byte digest of its URL, a separator), cut into blocks of `kv_block_tokens` x
`bytes_per_token` bytes; a completion prompt is its UTF-8 text, or its token ids as 8-byte
integers (blocks of exactly `kv_block_tokens` ids).
"""

from __future__ import annotations

import json
import math
import re
import sys
from array import array
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from gateway.sim.config import SimConfig
from gateway.sim.kvcache import PromptKey, block_hashes, short_digest

ROLE_SEP = b"\x1e"
MESSAGE_SEP = b"\x1f"
PART_TAG = b"\x1d"

OUTPUT_WORDS: tuple[str, ...] = (
    "Kimi", "café", "naïve", "東京", "routes", "Zürich", "tokens", "🚀", "façade", "über",
    "prefix", "日本語", "cache", "señor", "blocks", "Ωmega",
)


class PromptError(ValueError):
    """The request's prompt is malformed (the caller answers 400)."""


class FieldValidationError(PromptError):
    """A field the engine's pydantic request model refuses, answered as the engines' app-wide
    FastAPI `RequestValidationError` handler answers it (`EngineDialect.validation_error`): 400, type
    "Bad Request", on every route in the engine's OpenAI error shape (also `/v1/messages`, whose body
    FastAPI validates first). `errors` are pydantic's dicts with `loc` ("body", field).

    `str()` is the older engines' message (SGLang `srt/entrypoints/http_server.py`, vLLM <= 0.9):
    `f"{str(exc)} {str(exc.errors())}"`, where `str(exc)` is FastAPI's "N validation error(s):" and one
    line per error (without the endpoint's source file and line, which recent FastAPI appends); vLLM
    0.32 words its own (`dialects.vllm_validation_message`)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        count = len(errors)
        head = f"{count} validation error{'s' if count != 1 else ''}:\n" + "".join(f"  {e}\n" for e in errors)
        super().__init__(f"{head.rstrip()} {errors}")


class _EngineInts(BaseModel):
    """The integer fields the simulator reads, typed as vLLM's and SGLang's request models type
    them: plain `int` in pydantic's default (lax) mode, so the JSON number 5.0 is 5, while 5.5 fails
    (`int_from_float`), as do "5.5" and lists; "5" and `true` pass as 5 and 1 (lax mode).
    vLLM `entrypoints/openai/chat_completion/protocol.py`: `max_tokens: int | None`,
    `max_completion_tokens: int | None`, `n: int | None = 1`; SGLang
    `srt/entrypoints/openai/protocol.py`: `Optional[int]` for both limits, `n: int = 1`."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None


class _MessagesMaxTokens(BaseModel):
    """`AnthropicMessagesRequest.max_tokens` of vLLM (`entrypoints/anthropic/protocol.py`) and SGLang
    (`srt/entrypoints/anthropic/protocol.py`): a required `int` with a validator refusing <= 0."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_tokens must be positive")
        return value


class _ResponsesLimit(BaseModel):
    """`ResponsesRequest.max_output_tokens` of vLLM and SGLang: `int | None`, lax (5.0 is 5)."""

    model_config = ConfigDict(extra="ignore")

    max_output_tokens: int | None = None


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n")


def _engine_errors(exc: ValidationError) -> FieldValidationError:
    """pydantic's errors as FastAPI reports them for a request body: `loc` starts with "body"."""
    return FieldValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])


def engine_ints(body: dict[str, Any], chat: bool = True) -> dict[str, int | None]:
    """`max_tokens`, `max_completion_tokens` and `n` of a request as the engines read them (count of
    tokens, count of choices; None when absent or null). Raises FieldValidationError for a value
    their pydantic models refuse (5.5, "x", a list). JSON integers take the fast path. With `chat`
    False (`CompletionRequest`, which has no `max_completion_tokens`) that field is not read."""
    values = {name: body.get(name) if chat or name != "max_completion_tokens" else None for name in _INT_FIELDS}
    if all(v is None or type(v) is int for v in values.values()):
        return values
    try:
        model = _EngineInts.model_validate(values)
    except ValidationError as exc:
        raise _engine_errors(exc) from None
    return {name: getattr(model, name) for name in _INT_FIELDS}


def responses_output_limit(body: dict[str, Any]) -> int | None:
    """A Responses request's `max_output_tokens` (tokens; None when absent) as the engines'
    `ResponsesRequest` reads it. Raises FieldValidationError for a value that model refuses (5.5, "x")."""
    value = body.get("max_output_tokens")
    if value is None or type(value) is int:
        return value
    try:
        return _ResponsesLimit.model_validate({"max_output_tokens": value}).max_output_tokens
    except ValidationError as exc:
        raise _engine_errors(exc) from None


def messages_max_tokens(body: dict[str, Any]) -> int:
    """A Messages request's `max_tokens` (tokens) as vLLM's and SGLang's `AnthropicMessagesRequest`
    reads it: required, lax `int` (5.0 is 5), positive. Raises FieldValidationError otherwise
    (missing: pydantic's "Field required" with the body as input, as FastAPI reports it)."""
    value = body.get("max_tokens", _MISSING)
    if type(value) is int and value > 0:
        return value
    try:
        return _MessagesMaxTokens.model_validate(body if value is _MISSING else {"max_tokens": value}).max_tokens
    except ValidationError as exc:
        raise _engine_errors(exc) from None


_MISSING = object()


def text_tokens(byte_count: int, bytes_per_token: float) -> int:
    """Tokens for `byte_count` UTF-8 bytes of text."""
    return math.ceil(byte_count / bytes_per_token) if byte_count > 0 else 0


def _content_parts(content: Any) -> Iterator[tuple[str, str]]:
    """(kind, text) for each part of a message's content: kind is "text", "image" or "other"."""
    if content is None:
        return
    if isinstance(content, str):
        yield "text", content
        return
    if not isinstance(content, list):
        raise PromptError("message content must be a string or a list of content parts")
    for part in content:
        if isinstance(part, str):
            yield "text", part
        elif isinstance(part, dict):
            kind = part.get("type")
            if kind == "text":
                yield "text", str(part.get("text") or "")
            elif kind == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                yield "image", url if isinstance(url, str) else ""
            else:
                yield "other", str(kind)
        else:
            raise PromptError("content parts must be objects")


def chat_prompt_tokens(messages: Any, config: SimConfig) -> int:
    """Prompt tokens of a chat request's `messages` under the simulator's accounting."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    text_bytes = 0
    images = 0
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object")
        for kind, text in _content_parts(message.get("content")):
            if kind == "text":
                text_bytes += len(text.encode("utf-8"))
            elif kind == "image":
                images += 1
    return (text_tokens(text_bytes, config.bytes_per_token) + images * config.image_tokens
            + len(messages) * config.message_overhead_tokens)


def pretokenized_chat_prompt(body: dict[str, Any], engine: str) -> int | None:
    """Prompt tokens of a chat request whose body carries the token ids the engine prefills instead
    of rendering its messages; None when it renders them. Raises PromptError (400) for ids the
    engine refuses.

    - SGLang 0.5.23 (`ChatCompletionRequest.input_ids: Optional[List[int]]` in
      python/sglang/srt/entrypoints/openai/protocol.py; `OpenAIServingChat._process_messages` in
      serving_chat.py skips the chat template and takes these ids as the prompt).
    - vLLM 0.32 (`_reused_prompt_token_ids` in vllm/renderers/online_renderer.py):
      `kv_transfer_params.prompt_token_ids`, a non-empty list of non-negative integers, else 400
      "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.";
      ignored when `echo` is set or a message holds non-text content (then rendered)."""
    if engine == "sglang":
        ids = body.get("input_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or any(type(x) is not int for x in ids):
            raise PromptError("input_ids must be a list of integers")
        return len(ids)
    kv = body.get("kv_transfer_params")
    ids = kv.get("prompt_token_ids") if isinstance(kv, dict) else None
    if ids is None or body.get("echo") is True or _has_media(body.get("messages")):
        return None
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise PromptError("`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative "
                          "integers.")
    return len(ids)


def _has_media(messages: Any) -> bool:
    """Whether chat `messages` hold a content part that is not text (vLLM's `has_non_text_content`)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            return True
    return False


def tools_tokens(tools: Any, config: SimConfig) -> int:
    """Prompt tokens of a chat request's `tools`: their JSON text, as a chat template that renders the
    tool definitions into the prompt adds them (vLLM renders the chat request with its tools,
    vllm/renderers/online_renderer.py; so does `count_tokens`, vllm/entrypoints/anthropic/serving.py).
    0 without tools."""
    if not isinstance(tools, list) or not tools:
        return 0
    return text_tokens(len(json.dumps(tools).encode("utf-8")), config.bytes_per_token)


def completion_prompt_tokens(prompt: Any, config: SimConfig) -> list[int]:
    """Prompt tokens of each prompt of a `/v1/completions` request (str, [str], [int] or [[int]])."""
    if isinstance(prompt, str):
        return [text_tokens(len(prompt.encode("utf-8")), config.bytes_per_token)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [text_tokens(len(p.encode("utf-8")), config.bytes_per_token) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [len(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt]
    raise PromptError("prompt must be a string, a list of strings or a list of token ids")


def chat_prompt_bytes(messages: list[Any]) -> bytes:
    """Canonical bytes of validated chat `messages` (the byte stand-in of their tokens)."""
    pieces: list[bytes] = []
    for message in messages:
        pieces.append(str(message.get("role", "")).encode("utf-8"))
        pieces.append(ROLE_SEP)
        for kind, text in _content_parts(message.get("content")):
            if kind == "text":
                pieces.append(text.encode("utf-8"))
            elif kind == "image":
                pieces.append(PART_TAG + b"image:" + short_digest(text.encode("utf-8")))
            else:
                pieces.append(PART_TAG + text.encode("utf-8"))
        pieces.append(MESSAGE_SEP)
    return b"".join(pieces)


def prompt_keys(kind: str, body: dict[str, Any], prompt_tokens: list[int], config: SimConfig,
                seed: int = 0) -> list[PromptKey]:
    """The prefix-cache key of each prompt of a validated request (chat: one; text: one per prompt).

    `prompt_tokens` are the counts already computed for the same prompts; each key hashes at most
    `tokens // kv_block_tokens` blocks, so cached tokens never exceed the prompt.
    """
    block_tokens = config.kv_block_tokens
    text_block_bytes = max(1, round(block_tokens * config.bytes_per_token))
    if kind == "chat":
        data = [(chat_prompt_bytes(body["messages"]), text_block_bytes)]
    else:
        data = _completion_prompt_bytes(body["prompt"], text_block_bytes, block_tokens)
    return [PromptKey(tokens, tuple(block_hashes(raw, block_bytes, seed, tokens // block_tokens)))
            for (raw, block_bytes), tokens in zip(data, prompt_tokens, strict=True)]


def _completion_prompt_bytes(prompt: Any, text_block_bytes: int, block_tokens: int) -> list[tuple[bytes, int]]:
    """(bytes, block size in bytes) of each prompt of a validated `/v1/completions` request."""
    if isinstance(prompt, str):
        return [(prompt.encode("utf-8"), text_block_bytes)]
    if all(isinstance(p, str) for p in prompt):
        return [(p.encode("utf-8"), text_block_bytes) for p in prompt]
    ids_block_bytes = 8 * block_tokens
    sequences = [prompt] if all(isinstance(p, int) for p in prompt) else prompt
    return [(_ids_bytes(ids), ids_block_bytes) for ids in sequences]


def _ids_bytes(ids: list[int]) -> bytes:
    """Token ids as 8-byte signed integers (ids out of that range make the prompt uncacheable)."""
    try:
        return array("q", ids).tobytes()
    except OverflowError:
        return b""


def requested_output_tokens(body: dict[str, Any], chat: bool = True) -> int | None:
    """`max_completion_tokens`, else `max_tokens`, or None when the request gives neither.

    With `chat` False (`/v1/completions`) only `max_tokens` counts: vLLM's and SGLang's
    `CompletionRequest` have no `max_completion_tokens` and ignore it. An integral float (5.0) is
    that integer and a non-integral one a FieldValidationError, as the engines' pydantic models
    read them (`engine_ints`)."""
    values = engine_ints(body, chat)
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = values[name]
        if value is not None:
            if value < 0:
                raise PromptError(f"{name} must be a non-negative integer")
            return value
    return None


def requested_output_field(body: dict[str, Any], chat: bool = True) -> str:
    """The body field `requested_output_tokens` read (`max_completion_tokens` on chat when set, else
    `max_tokens`): the engines name it in their errors."""
    return "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"


def generated_count(body: dict[str, Any], requested: int | None, natural: int | None, room: int,
                    eos_after: int | None = None) -> tuple[int, str]:
    """(output tokens, finish reason) of one completion as vLLM's `SamplingParams` and SGLang's
    sampling params decide them (`vllm/sampling_params.py`; SGLang `srt/sampling/sampling_params.py`).
    The limit is `requested` (`max_tokens`) shortened to the `room` left in the context, else that
    room: vLLM 0.32 clamps both to max_model_len - prompt (`get_max_tokens` in
    vllm/entrypoints/serve/utils/api_utils.py), SGLang's scheduler to its context less the prompt
    (`Scheduler.init_req_max_new_tokens`; its tokenizer manager refused a limit that does not fit).
    The simulated model ends by itself after `natural` tokens when no limit is given
    (`default_output_tokens`; None: it never does, so it runs to the end of the context as a model
    that emits no end-of-sequence does on vLLM) and, with `eos_after` set, after that many under
    any limit; otherwise it runs to an explicit limit. `min_tokens` holds its end back until that many
    are out, `ignore_eos` lets it run to the limit. Raises PromptError for `min_tokens` over
    `max_tokens` (vLLM's `_verify_args`: "min_tokens must be less than or equal to max_tokens")."""
    least = body.get("min_tokens")
    least = least if type(least) is int and least > 0 else 0
    room = max(room, 0)
    limit = room if requested is None else min(requested, room)
    if requested is not None and least > limit:
        raise PromptError(f"min_tokens must be less than or equal to max_tokens={limit}, got {least}.")
    if body.get("ignore_eos") is True:
        return limit, "length"
    end = eos_after if eos_after is not None else natural if requested is None else None
    if end is None:  # the simulator's model runs to its limit
        return limit, "length"
    count = max(end, least)
    return (count, "stop") if count < limit else (limit, "length")


def output_token(index: int) -> str:
    """The text of output token `index` (0-based, counted from the start of the assistant turn, a
    prefilled part included): a word, space-separated after the first. A function of the position
    alone, as a temperature-0 model's next token is a function of what precedes it: so a generation
    continued from the first k tokens of an answer (`continued_tokens`) goes on with exactly the
    tokens k, k+1, ... an uninterrupted one would have produced."""
    word = OUTPUT_WORDS[index % len(OUTPUT_WORDS)]
    return word if index == 0 else " " + word


def output_text(count: int, start: int = 0) -> str:
    """The output of `count` tokens from token `start` on."""
    return "".join(output_token(i) for i in range(start, start + count))


_OUTPUT_PIECE = re.compile(r" ?[^ ]+| +")


def output_token_count(text: str) -> int:
    """Tokens of `text` under the simulated model's word tokenizer (a word with its leading space is
    one token, as `output_token` writes them): `output_token_count(output_text(k)) == k`."""
    return len(_OUTPUT_PIECE.findall(text))


def own_output_tokens(text: str) -> int | None:
    """k when `text` is exactly the simulated model's first k output tokens (`output_text(k)`), else
    None: the model's own answer tokenizes back to the tokens that generated it, as the real tiny
    model's greedy text does (`tests/real_vllm/make_models.py` trains it so)."""
    count = output_token_count(text)
    return count if count and output_text(count) == text else None


def _message_text(message: Any) -> str:
    """The text of a chat message's content (its text parts joined)."""
    if not isinstance(message, dict):
        return ""
    return "".join(text for kind, text in _content_parts(message.get("content")) if kind == "text")


def continued_tokens(body: dict[str, Any], engine: str) -> int | None:
    """How many tokens of the assistant's turn a chat request already holds, for an engine that
    continues it: None when it starts a new turn. Raises FieldValidationError and PromptError as the
    engines refuse the flags.

    - vLLM (`vllm/entrypoints/openai/chat_completion/protocol.py`, `ChatCompletionRequest`:
      `add_generation_prompt: bool = True`, `continue_final_message: bool = False`; its
      `check_generation_prompt` model validator, mode "before", refuses both set to true in the
      body: "Cannot set both `continue_final_message` and `add_generation_prompt` to True.").
      With `continue_final_message` and `add_generation_prompt` left at its default (true), the
      chat template's renderer refuses the pair (transformers' `apply_chat_template`:
      "continue_final_message and add_generation_prompt are not compatible. ..."; a 400). With
      `continue_final_message` the template is rendered without the final message's end of turn,
      so the model goes on with that message: an assistant message's text is the start of its
      answer. (Any final message is continued; only an assistant one is the model's own turn.)
    - SGLang (`python/sglang/srt/entrypoints/openai/protocol.py`: `continue_final_message: bool =
      False`; `serving_chat.py`, `_handle_last_assistant_message`: a final assistant message whose
      `content` is a string is taken off the messages and that string appended after the prompt
      rendered with `add_generation_prompt=True`, so the answer continues it; its `reasoning_content`
      is not rendered; a list content is left alone, so the template starts a new turn after it).
      No `add_generation_prompt` field there: the gateway's `false` is an extra field it ignores.
    """
    if body.get("continue_final_message") is not True:
        return None
    if engine != "sglang":
        if body.get("add_generation_prompt") is True:
            raise FieldValidationError([{"type": "value_error", "loc": ("body",), "input": body,
                                         "msg": "Value error, Cannot set both `continue_final_message` and "
                                                "`add_generation_prompt` to True."}])
        if body.get("add_generation_prompt") is not False:
            raise PromptError("continue_final_message and add_generation_prompt are not compatible. Use "
                              "continue_final_message when you want the model to continue the final message, "
                              "and add_generation_prompt when you want to add a header that will prompt it to "
                              "start a new assistant message instead.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "assistant":
        return None
    if engine == "sglang" and not isinstance(last.get("content"), str):
        return None
    return output_token_count(_message_text(last))


def completion_continued_tokens(prompt: Any) -> int:
    """How many tokens of the simulated model's own answer a completion prompt ends with: k when the
    prompt's text ends with `output_text(k)` (its longest such tail; 0 when none). A completion
    prompt has no turns: a real model at temperature 0 given a prompt followed by the start of its
    own answer goes on with the rest of that answer, which this stands in for."""
    if not isinstance(prompt, str):
        return 0
    first = OUTPUT_WORDS[0]
    at = prompt.find(first)
    while at >= 0:
        tail = prompt[at:]
        count = output_token_count(tail)
        if output_text(count) == tail:
            return count
        at = prompt.find(first, at + 1)
    return 0


VOCAB_SIZE = 163_840
"""Size of the simulated vocabulary (Kimi K2's tokenizer has 163,840 ids); token ids are below it."""


def prompt_token_ids(kind: str, body: dict[str, Any], prompt_tokens: list[int], config: SimConfig) -> list[list[int]]:
    """The token ids of each prompt of a validated request: exactly `prompt_tokens[i]` ids each.

    Id i of a text or chat prompt is the little-endian integer of bytes
    [floor(i x bytes_per_token), floor((i+1) x bytes_per_token)) of the same bytes the prefix
    cache hashes (`chat_prompt_bytes` / the UTF-8 prompt), modulo `VOCAB_SIZE`; ids past the end
    of those bytes (chat's per-message overhead and images) are filled from their position and the
    byte length. So prompts that share their first k prefix-cache blocks share their first
    k x `kv_block_tokens` ids, and equal pieces of text get equal ids, as with a real tokenizer.
    A token-id prompt is its own ids.
    """
    if kind == "chat":
        sources: list[bytes | list[int]] = [chat_prompt_bytes(body["messages"])]
    else:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            sources = [prompt.encode("utf-8")]
        elif all(isinstance(p, str) for p in prompt):
            sources = [p.encode("utf-8") for p in prompt]
        else:
            sources = [prompt] if all(isinstance(p, int) for p in prompt) else list(prompt)
    return [list(src) if isinstance(src, list) else _byte_ids(src, count, config.bytes_per_token)
            for src, count in zip(sources, prompt_tokens, strict=True)]


def _byte_ids(raw: bytes, count: int, bytes_per_token: float) -> list[int]:
    """`count` ids cut from `raw` in windows of `bytes_per_token` bytes (see `prompt_token_ids`).

    Whole windows of a whole number of bytes are read in bulk (4 bytes: one `array` of 32-bit
    integers): vllm-router renders every request on every worker, so this runs N times a request."""
    size = len(raw)
    width = int(bytes_per_token)
    if width == bytes_per_token:
        whole = min(count, size // width)
        if width == 4 and _U32.itemsize == 4:
            words = array("I")
            words.frombytes(raw[:whole * 4])
            if sys.byteorder == "big":
                words.byteswap()
            ids = [w % VOCAB_SIZE for w in words]
        else:
            ids = [int.from_bytes(raw[i:i + width], "little") % VOCAB_SIZE for i in range(0, whole * width, width)]
    else:
        ids = []
    for i in range(len(ids), count):
        start = math.floor(i * bytes_per_token)
        if start < size:
            end = max(start + 1, math.floor((i + 1) * bytes_per_token))
            ids.append(int.from_bytes(raw[start:end], "little") % VOCAB_SIZE)
        else:
            ids.append((i * 2_654_435_761 + size) % VOCAB_SIZE)
    return ids


_U32 = array("I")
"""Probe of the platform's `array("I")` item size (4 bytes on every platform CPython supports today)."""
