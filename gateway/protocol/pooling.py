"""Wire models of the pooling APIs the gateway routes: OpenAI's embeddings, vLLM's rerank and score
(imports pydantic only).

They validate what routing reads (`model`, and the inputs it counts) and no more: every other
field (`encoding_format`, `dimensions`, `top_n`, `truncate_prompt_tokens`, `use_activation`, ...)
is forwarded untouched for the engine to judge, so the gateway is never stricter than the engines.
Shapes, as the engines accept them:

- Embeddings, `POST /v1/embeddings`: vLLM's `EmbeddingRequest` union
  (`vllm/entrypoints/pooling/embed/protocol.py`, before 0.11 in `vllm/entrypoints/openai/protocol.py`:
  `EmbeddingCompletionRequest` with `input` a string, strings, token ids or lists of token ids;
  `EmbeddingChatRequest` / `EmbeddingBatchChatRequest` with chat `messages`, one conversation or a
  batch of them, also accepted in `input`); SGLang's `EmbeddingRequest`
  (`python/sglang/srt/entrypoints/openai/protocol.py`: the same `input` shapes plus multimodal
  objects `{"text": ..., "image": ...}`); llama.cpp's server the `input` shapes.
- Rerank, `POST /v1/rerank`: vLLM's `RerankRequest` (`vllm/entrypoints/pooling/score/protocol.py`,
  now `pooling/scoring/protocol.py`): `query` a string or `{"content": [parts]}`, `documents` one
  or a list of them, `top_n`; SGLang's `V1RerankReqInput` (`query`, `documents` strings) and
  llama.cpp's `/v1/rerank` (`query`, `documents`) are the same shape.
- Score, `POST /v1/score`: vLLM's `ScoreRequest` union (same files): the two sides named
  `text_1`/`text_2`, `queries`/`documents`, `queries`/`items` or `data_1`/`data_2`, each a string,
  `{"content": [parts]}` or a list of them; SGLang's `ScoringRequest` names them `query`/`items`
  (token ids allowed there).

`model` is required, as on the gateway's other APIs: the gateway routes by it (the engines default
to their one served model when it is left out).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.protocol.openai import TokenId


class _Open(BaseModel):
    """Extra fields are accepted (and forwarded by the gateway untouched)."""

    model_config = ConfigDict(extra="allow", frozen=True)


Objects = list[dict[str, Any]]
"""Chat messages (`{"role": ..., "content": ...}`) or SGLang's multimodal inputs (`{"text", "image"}`)."""

_INPUT_SHAPES: dict[str, TypeAdapter[Any]] = {
    "ids": TypeAdapter(list[TokenId]), "batch": TypeAdapter(list[list[TokenId]]),
    "texts": TypeAdapter(list[StrictStr]), "objects": TypeAdapter(Objects), "conversations": TypeAdapter(list[Objects]),
}


def _shape_of(value: list[Any]) -> str:
    """The shape of a list `input`, by its first element (a plain union would try every branch on
    every element of a list of millions of token ids)."""
    head = value[0]
    if type(head) in (int, float):
        return "ids"
    if isinstance(head, dict):
        return "objects"
    if isinstance(head, list):
        return "conversations" if head and isinstance(head[0], dict) else "batch"
    return "texts"


def _whole(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


def _input_by_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if isinstance(value, list) and value:
        shape = _shape_of(value)
        try:
            return _INPUT_SHAPES[shape].validate_python(value)
        except ValidationError:
            if shape == "ids":  # JSON's 5.0 is the integer 5 (as `gateway.protocol.openai.WHOLE` reads it)
                return _INPUT_SHAPES[shape].validate_python([_whole(v) for v in value])
            if shape == "batch":
                return _INPUT_SHAPES[shape].validate_python(
                    [[_whole(v) for v in ids] if isinstance(ids, list) else ids for ids in value])
            raise
    return handler(value)


_OBJECTS_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "object"}}
_IDS_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_LIST_SHAPES_SCHEMA: list[dict[str, Any]] = [
    {"type": "array", "items": {"type": "string"}}, _IDS_SCHEMA, {"type": "array", "items": _IDS_SCHEMA},
    _OBJECTS_SCHEMA, {"type": "array", "items": _OBJECTS_SCHEMA}]
"""What `_input_by_shape` accepts, for /openapi.json (its wrap validator has no schema of its own)."""

EmbeddingInput = Annotated[StrictStr | list[Any], WrapValidator(_input_by_shape),
                           WithJsonSchema({"anyOf": [{"type": "string"}, *_LIST_SHAPES_SCHEMA]})]
"""A string, strings, token ids, lists of token ids, chat messages or multimodal objects, or
conversations (lists of chat messages); an empty list too (the engine judges it)."""


def _present(*names: str) -> dict[str, Any]:
    """JSON Schema: the members `names` are present and not null (what a model validator requires)."""
    return {"required": list(names), "properties": {name: {"not": {"type": "null"}} for name in names}}


class EmbeddingsRequest(_Open):
    """`POST /v1/embeddings` body (the fields routing reads): `input`, or chat `messages` (vLLM's
    `EmbeddingChatRequest`, one conversation or a batch of them). `encoding_format` ("float",
    "base64"), `dimensions` and the engines' own fields are forwarded as sent."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [_present("input"), _present("messages")]})

    model: StrictStr = Field(min_length=1)
    input: EmbeddingInput | None = None
    messages: Annotated[list[Any], WrapValidator(_input_by_shape),
                        WithJsonSchema({"anyOf": [_OBJECTS_SCHEMA, {"type": "array", "items": _OBJECTS_SCHEMA}]})] \
        | None = None

    @model_validator(mode="after")
    def _something_to_embed(self) -> EmbeddingsRequest:
        if self.input is None and self.messages is None:
            raise PydanticCustomError("missing", "Field required: 'input' (or chat 'messages')")
        return self


ScoreInputs = StrictStr | dict[str, Any] | list[Any]
"""One side of a rerank or score request: a string, `{"content": [parts]}` (vLLM's
`ScoreMultiModalParam`), token ids (SGLang), or a list of those."""


class RerankRequest(_Open):
    """`POST /v1/rerank` body (the fields routing reads): `query` and `documents`; `top_n`,
    `return_documents` and the engines' own fields are forwarded as sent."""

    model: StrictStr = Field(min_length=1)
    query: StrictStr | dict[str, Any] | list[Any]
    documents: ScoreInputs


SCORE_SIDES: tuple[tuple[str, str], ...] = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                            ("data_1", "data_2"), ("query", "items"))
"""The names of a score request's two sides, in the order vLLM's `ScoreRequest` union tries them
(its last, `text_1`/`text_2`, is the oldest and comes first here), then SGLang's `query`/`items`."""


class ScoreRequest(_Open):
    """`POST /v1/score` body (the fields routing reads): one pair of sides (`SCORE_SIDES`), read by
    `sides`; the engine's own fields are forwarded as sent."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [_present(*pair) for pair in SCORE_SIDES]})

    model: StrictStr = Field(min_length=1)
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    query: ScoreInputs | None = None

    @model_validator(mode="after")
    def _two_sides(self) -> ScoreRequest:
        if self.sides() is None:
            raise PydanticCustomError("missing", "Field required: 'text_1' and 'text_2' (or 'queries' and "
                                                 "'documents', 'queries' and 'items', 'data_1' and 'data_2')")
        return self

    def sides(self) -> tuple[ScoreInputs, ScoreInputs] | None:
        """The two sides to score against each other, by the first pair of names present; None without one."""
        for first, second in SCORE_SIDES:
            one, two = getattr(self, first), getattr(self, second)
            if one is not None and two is not None:
                return one, two
        return None
