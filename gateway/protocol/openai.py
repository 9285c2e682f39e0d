"""OpenAI wire models for the requests the gateway routes (imports pydantic only).

They validate what routing reads (model, messages and content parts, output limits, stream
flags) with OpenAI's types, strictly: `"5"` is not an integer. Unknown fields are allowed and
ignored here; the gateway forwards the client's JSON object itself, so they reach the engine
unchanged. Shapes follow https://platform.openai.com/docs/api-reference/chat/create and
/completions/create.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

MAX_TOKENS_LIMIT = 2**31 - 1


def _integral(value: Any) -> Any:
    """JSON has one number type: `5.0` is the integer 5 (JSON Schema's `integer` says so, and the
    engines' parsers read it so). Other floats, strings and booleans are left for StrictInt to refuse."""
    return int(value) if type(value) is float and value.is_integer() else value


WHOLE = BeforeValidator(_integral)
"""Last in an integer field's `Annotated[StrictInt, Field(...), WHOLE]`: a JSON integer or an integral
number (`5.0`), not `5.5`, `"5"` nor `true`. After the Field, so its bounds stay JSON Schema's
`minimum`/`maximum` in /openapi.json."""


class _Open(BaseModel):
    """Extra fields are accepted (and forwarded by the gateway untouched)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class TextPart(_Open):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Open):
    url: StrictStr = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudioPart(_Open):
    """OpenAI's audio input: `input_audio: {"data": <base64>, "format": "wav" | "mp3" | ...}`."""

    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class AudioURLPart(_Open):
    """vLLM's and SGLang's `audio_url` extension: `audio_url: {"url": <http(s) URL or data URI>}`."""

    type: Literal["audio_url"]
    audio_url: dict[str, Any]


class VideoPart(_Open):
    """vLLM's `video_url` extension."""

    type: Literal["video_url"]
    video_url: dict[str, Any]


class FilePart(_Open):
    type: Literal["file"]
    file: dict[str, Any]


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: StrictStr


class OtherPart(_Open):
    """A part type the gateway does not model (`image_embeds`, `audio_embeds`, a new engine's own...):
    forwarded unchanged, the engine decides; its tokens are not counted."""

    type: StrictStr


_MODELLED_PARTS = {"text": TextPart, "image_url": ImagePart, "input_audio": InputAudioPart,
                   "audio_url": AudioURLPart, "video_url": VideoPart, "file": FilePart, "refusal": RefusalPart}


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in _MODELLED_PARTS else "other"


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image_url")]
    | Annotated[InputAudioPart, Tag("input_audio")] | Annotated[AudioURLPart, Tag("audio_url")]
    | Annotated[VideoPart, Tag("video_url")] | Annotated[FilePart, Tag("file")]
    | Annotated[RefusalPart, Tag("refusal")] | Annotated[OtherPart, Tag("other")],
    Discriminator(_part_tag, custom_error_type="invalid_part",
                  custom_error_message="a content part must be an object with a string 'type'"),
]

# The modality a content part type needs from a pool (`PoolConfig.modalities`); a type not listed
# needs none beyond text: the engine decides.
PART_MODALITY: dict[str, str] = {
    "text": "text",
    "refusal": "text",
    "image_url": "image",
    "image_embeds": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "file": "file",
}


# Roles whose `content` OpenAI requires; an assistant turn may carry only tool calls, and a legacy
# `function` turn may carry null.
CONTENT_REQUIRED_ROLES = frozenset({"system", "developer", "user", "tool"})


def _content_required_schema(schema: dict[str, Any]) -> None:
    """JSON Schema of `_content_present` (for /openapi.json): these roles need a non-null `content`."""
    schema["if"] = {"properties": {"role": {"enum": sorted(CONTENT_REQUIRED_ROLES)}}, "required": ["role"]}
    schema["then"] = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}


class ChatMessage(_Open):
    model_config = ConfigDict(json_schema_extra=_content_required_schema)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: object, info: ValidationInfo) -> object:
        if content is None and info.data.get("role") in CONTENT_REQUIRED_ROLES:
            raise PydanticCustomError("missing", "Field required")
        return content


class StreamOptions(_Open):
    include_usage: StrictBool | None = None


OutputTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT), WHOLE]


class _Generation(_Open):
    model: StrictStr = Field(min_length=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: OutputTokens | None = None
    # OpenAI's newer name for the output limit; it wins over `max_tokens` (also on completions,
    # where the gateway translates it for engines that only read `max_tokens`).
    max_completion_tokens: OutputTokens | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128), WHOLE] | None = None
    user: StrictStr | None = None


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions` body (the fields routing reads)."""

    messages: list[ChatMessage] = Field(min_length=1)


def _ids_integral_on_retry(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Token ids strictly first (in pydantic-core: a prompt may hold millions); only a list that fails
    is retried with its integral floats made integers (`_integral`)."""
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list) or not any(type(item) is float for item in value):
            raise
        return handler([_integral(item) for item in value])


# A token id is an index into the model's vocabulary: non-negative, and the engines hold it as a
# 32-bit integer (vLLM refuses an id outside the vocabulary with a 400).
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1), WrapValidator(_ids_integral_on_retry)]

# One adapter per shape of a list prompt, picked by its first element: a plain union would try
# list[str] first and build one error per element of a 4M-id prompt (~1 s of event loop).
Texts = Annotated[list[StrictStr], Field(min_length=1)]
Batch = Annotated[list[TokenIds], Field(min_length=1)]
_PROMPT_LIST_SHAPES = {"ids": TypeAdapter(TokenIds), "batch": TypeAdapter(Batch), "texts": TypeAdapter(Texts)}


def _prompt_by_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if isinstance(value, list) and not value:
        raise PydanticCustomError("too_short", "it must not be empty")
    if isinstance(value, list):
        head = value[0]
        shape = "ids" if type(head) in (int, float) else "batch" if isinstance(head, list) else "texts"
        return _PROMPT_LIST_SHAPES[shape].validate_python(value)
    return handler(value)


class CompletionRequest(_Generation):
    """`POST /v1/completions` body: `prompt` is text, texts, token ids or lists of token ids (no
    list empty)."""

    prompt: Annotated[StrictStr | Texts | TokenIds | Batch, WrapValidator(_prompt_by_shape)]


_BRANCH_NAMES = frozenset({"str", "int", "bool", "float", "dict", "list", "none"})


def _param_path(loc: tuple[int | str, ...]) -> str:
    """OpenAI-style field path from a pydantic error location, without union branch and tag names."""
    param = ""
    skip_tag = False
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
            continue
        if skip_tag:  # a tagged union puts the tag value after the list index
            skip_tag = False
            continue
        if "[" in part or part in _BRANCH_NAMES:
            skip_tag = "tagged-union" in part
            continue
        param += f".{part}" if param else part
    return param


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """Turn the most specific pydantic error into (message, param) for an OpenAI error object.

    `param` is the field path in OpenAI's style, e.g. `messages[0].content[1].image_url.url`.
    """
    errors = exc.errors(include_url=False)
    if not errors:
        return "invalid request body", None
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param_path(tuple(err.get("loc", ())))
    message = err.get("msg", "invalid value")
    if param:
        message = f"Invalid value for '{param}': {message}"
    return message, param or None
