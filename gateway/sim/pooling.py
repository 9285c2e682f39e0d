"""The pooling APIs in the simulator: `POST /v1/embeddings`, `/v1/rerank` (also `/rerank`, `/v2/rerank`)
and `/v1/score` (also `/score`), served by a worker with `SimConfig.pooling` (vLLM registers these
routes only for a pooling model: `vllm/entrypoints/pooling/__init__.py`, the routers in
`vllm/entrypoints/pooling/embed/api_router.py` and `pooling/score/api_router.py`); without it they
are not found, as on a generative model's server.

Answers in vLLM's shapes (`vllm/entrypoints/pooling/embed/protocol.py` `EmbeddingResponse`,
`pooling/score/protocol.py` `RerankResponse` and `ScoreResponse`, with `UsageInfo` from
`vllm/entrypoints/openai/protocol.py`), for every simulated engine kind (SGLang's own rerank and score
shapes are not simulated):

- embeddings: `{"id": "embd-…", "object": "list", "created", "model", "data": [{"index", "object":
  "embedding", "embedding"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0,
  "prompt_tokens_details": null}}`. Each vector is deterministic per model and input (seeded from a
  BLAKE2b hash of them), `SimConfig.embedding_dimensions` long, or its first `dimensions` values
  (vLLM's matryoshka truncation), L2-normalised as vLLM's pooler does by default. With
  `encoding_format: "base64"` it is the base64 of its float32 values, little-endian (vLLM's default
  `embed_dtype` float32 and `endianness` native on x86; what the OpenAI SDK decodes).
- rerank: `{"id": "rerank-…", "model", "usage": {"prompt_tokens", "total_tokens"}, "results":
  [{"index", "document": {"text", "multi_modal"}, "relevance_score"}]}`, best first, the first
  `top_n` when 0 < `top_n` < the documents.
- score: `{"id": "score-…", "object": "list", "created", "model", "data": [{"index", "object":
  "score", "score"}], "usage": …}`, one score per pair (one side of one input is paired with
  each input of the other, two lists item by item).

A relevance score is (1 + the cosine of the two inputs' vectors) / 2: 1.0 for identical inputs.
Tokens are the simulator's (`gateway.sim.tokens`): a pair is its two inputs' tokens, plus
`SimConfig.pooling_special_tokens` for each sequence tokenized from text (an embeddings text, a pair),
as vLLM's tokenizer call adds the model's special tokens (`vllm/entrypoints/pooling/scoring/io_processor.py`,
`tokenizer(text=..., text_pair=...)`; `pooling/base/protocol.py`, `add_special_tokens` on by default). Errors are the
engine's: its validation error for a field its pydantic model refuses (`encoding_format` other than
float or base64, which the simulator does not serve as `bytes`; `top_n` < 0; no `input`),
"Dimensions must be greater than 0" (`vllm/pooling_params.py`), "Input lengths must be either 1:1,
1:N or N:N" and "At least one text(_pair) element must be given" (`_validate_score_input_lens`,
`vllm/entrypoints/pooling/score/utils.py`), its context error for an input longer than the model's
context.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.sim.dialects import ErrorReply
from gateway.sim.tokens import (
    FieldValidationError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    text_tokens,
)
from gateway.sim.worker_state import SimWorkerState

EMBEDDINGS_PATH = "/v1/embeddings"
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS = ("/score", "/v1/score")

Input = tuple[bytes, int]
"""One input as the simulator sees it: its canonical bytes (what seeds its vector) and its tokens."""


class _Lax(BaseModel):
    """Lax pydantic, as vLLM's `OpenAIBaseModel`: "5" is 5, other fields ignored here."""

    model_config = ConfigDict(extra="ignore")


class _EmbeddingFields(_Lax):
    """The fields of vLLM's `EmbeddingCompletionRequest` / `EmbeddingChatRequest` the simulator reads."""

    input: list[int] | list[list[int]] | str | list[str] | list[dict[str, Any]] | list[list[dict[str, Any]]] | None \
        = None
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


ScoreInput = str | dict[str, Any]


class _RerankFields(_Lax):
    """vLLM's `RerankRequest`: `query`, `documents`, `top_n` (>= 0)."""

    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: int = Field(default=0, ge=0)


class _ScoreFields(_Lax):
    """vLLM's `ScoreRequest` (`text_1` / `text_2`; its newer names are read as these)."""

    text_1: ScoreInput | list[ScoreInput]
    text_2: ScoreInput | list[ScoreInput]


_SCORE_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
"""vLLM's newer names of a score request's sides, in its union's order (`pooling/scoring/protocol.py`)."""


def _fields(model: type[_Lax], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # FastAPI's report: `loc` from "body"
        raise FieldValidationError([{**e, "loc": ("body", *e["loc"])}
                                    for e in exc.errors(include_url=False)]) from None


def embedding_vector(model: str, seed: bytes, size: int) -> list[float]:
    """The deterministic unit vector of `size` values for `seed` (an input's canonical bytes) on `model`."""
    digest = hashlib.blake2b(model.encode() + b"\x00" + seed, digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    values = [rng.gauss(0.0, 1.0) for _ in range(size)]
    return normalised(values)


def normalised(values: list[float]) -> list[float]:
    """`values` scaled to length 1 (vLLM's pooler normalises embeddings by default)."""
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def base64_float32(values: list[float]) -> str:
    """`values` as vLLM's `encoding_format: base64` writes them: float32, little-endian, base64."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _content_input(value: dict[str, Any], engine: SimWorkerState) -> Input:
    """A `{"content": [parts]}` input (vLLM's `ScoreMultiModalParam`) or one chat message."""
    if "role" in value:
        return orjson.dumps(value), chat_prompt_tokens([value], engine.config)
    content = value.get("content")
    tokens = chat_prompt_tokens([{"role": "user", "content": content}], engine.config) \
        - engine.config.message_overhead_tokens
    return orjson.dumps(content), tokens


def _text_input(text: str, engine: SimWorkerState) -> Input:
    raw = text.encode("utf-8")
    return raw, text_tokens(len(raw), engine.config.bytes_per_token)


def _with_special(tokens: int, engine: SimWorkerState) -> int:
    """A sequence tokenized from text, with the special tokens the model's tokenizer adds to it
    (`SimConfig.pooling_special_tokens`)."""
    return tokens + engine.config.pooling_special_tokens


def embedding_inputs(fields: _EmbeddingFields, engine: SimWorkerState) -> list[Input]:
    """The inputs of an embeddings request: each string, token-id list or conversation; one for
    a string, token ids alone or one conversation."""
    value: Any = fields.input if fields.input is not None else fields.messages
    if value is None:
        raise FieldValidationError([{"type": "missing", "loc": ("body", "input"), "msg": "Field required",
                                     "input": None}])
    if isinstance(value, str):
        raw, tokens = _text_input(value, engine)
        return [(raw, _with_special(tokens, engine))]
    if not value:
        return []
    head = value[0]
    if isinstance(head, int):
        return [(orjson.dumps(value), completion_prompt_tokens(value, engine.config)[0])]
    if isinstance(head, dict):  # one conversation
        return [(orjson.dumps(value), chat_prompt_tokens(value, engine.config))]
    if isinstance(head, str):
        return [(raw, _with_special(tokens, engine)) for raw, tokens in (_text_input(t, engine) for t in value)]
    if head and isinstance(head[0], dict):  # conversations
        return [(orjson.dumps(c), chat_prompt_tokens(c, engine.config)) for c in value]
    return [(orjson.dumps(ids), len(ids)) for ids in value]


def _model(body: dict[str, Any], engine: SimWorkerState) -> str:
    """The `model` an answer names: the request's, else the first served name (vLLM's `_get_model_name`)."""
    model = body.get("model")
    return model if isinstance(model, str) and model else engine.config.model_name


def _check_context(inputs: list[Input], engine: SimWorkerState) -> ErrorReply | None:
    for _, tokens in inputs:
        error = engine.dialect.check_context(tokens, None, engine.config.max_context_tokens, False, generate=False)
        if error is not None:
            return error
    return None


def _usage(tokens: int, generation_style: bool = True) -> dict[str, Any]:
    """vLLM's `UsageInfo` as `model_dump` writes it (`RerankUsage`: the first two only)."""
    if not generation_style:
        return {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def embeddings_answer(engine: SimWorkerState, body: dict[str, Any]) -> tuple[ErrorReply, int]:
    """`POST /v1/embeddings` (module docstring). Raises FieldValidationError."""
    fields: _EmbeddingFields = _fields(_EmbeddingFields, body)
    inputs = embedding_inputs(fields, engine)
    tokens = sum(t for _, t in inputs)
    if fields.dimensions is not None and fields.dimensions < 1:
        return engine.dialect.bad_request("Dimensions must be greater than 0"), tokens
    if (error := _check_context(inputs, engine)) is not None:
        return error, tokens
    size = engine.config.embedding_dimensions
    if fields.dimensions is not None:
        size = min(size, fields.dimensions)
    model = _model(body, engine)
    data = []
    for index, (seed, _) in enumerate(inputs):
        vector = normalised(embedding_vector(engine.config.model_name, seed, engine.config.embedding_dimensions)[:size])
        data.append({"index": index, "object": "embedding",
                     "embedding": base64_float32(vector) if fields.encoding_format == "base64" else vector})
    answer = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
              "data": data, "usage": _usage(tokens)}
    return ErrorReply(200, orjson.dumps(answer)), tokens


def _side(value: ScoreInput | list[ScoreInput]) -> list[ScoreInput]:
    return list(value) if isinstance(value, list) else [value]


def _score_input(value: ScoreInput, engine: SimWorkerState) -> Input:
    return _text_input(value, engine) if isinstance(value, str) else _content_input(value, engine)


def relevance(engine: SimWorkerState, first: bytes, second: bytes) -> float:
    """(1 + cosine of the two inputs' vectors) / 2, in [0, 1]; 1.0 for the same input."""
    size, model = engine.config.embedding_dimensions, engine.config.model_name
    one, two = embedding_vector(model, first, size), embedding_vector(model, second, size)
    return max(0.0, min(1.0, (1.0 + sum(a * b for a, b in zip(one, two, strict=True))) / 2.0))


def _pairs(engine: SimWorkerState, first: list[ScoreInput],
           second: list[ScoreInput]) -> list[tuple[Input, Input]] | ErrorReply:
    """The pairs vLLM scores (`_validate_score_input_lens`), or its 400."""
    if len(first) > 1 and len(first) != len(second):
        return engine.dialect.bad_request("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        return engine.dialect.bad_request("At least one text element must be given")
    if not second:
        return engine.dialect.bad_request("At least one text_pair element must be given")
    ones = [_score_input(value, engine) for value in first]
    twos = [_score_input(value, engine) for value in second]
    return [(ones[min(i, len(ones) - 1)], two) for i, two in enumerate(twos)]


def _scored(engine: SimWorkerState, pairs: list[tuple[Input, Input]]) -> tuple[list[float], int, ErrorReply | None]:
    joined = [(a[0] + b[0], _with_special(a[1] + b[1], engine)) for a, b in pairs]
    tokens = sum(t for _, t in joined)
    return [relevance(engine, a[0], b[0]) for a, b in pairs], tokens, _check_context(joined, engine)


def rerank_answer(engine: SimWorkerState, body: dict[str, Any]) -> tuple[ErrorReply, int]:
    """`POST /v1/rerank` (module docstring). Raises FieldValidationError, PromptError."""
    fields: _RerankFields = _fields(_RerankFields, body)
    documents = _side(fields.documents)
    pairs = _pairs(engine, [fields.query], documents)
    if isinstance(pairs, ErrorReply):
        return pairs, 0
    scores, tokens, error = _scored(engine, pairs)
    if error is not None:
        return error, tokens
    results = [{"index": i, "document": {"text": doc if isinstance(doc, str) else None,
                                         "multi_modal": None if isinstance(doc, str) else doc.get("content")},
                "relevance_score": score} for i, (doc, score) in enumerate(zip(documents, scores, strict=True))]
    results.sort(key=lambda result: -result["relevance_score"])  # type: ignore[operator]
    if 0 < fields.top_n < len(results):
        results = results[:fields.top_n]
    answer = {"id": f"rerank-{uuid.uuid4().hex}", "model": _model(body, engine), "usage": _usage(tokens, False),
              "results": results}
    return ErrorReply(200, orjson.dumps(answer)), tokens


def score_answer(engine: SimWorkerState, body: dict[str, Any]) -> tuple[ErrorReply, int]:
    """`POST /v1/score` (module docstring). Raises FieldValidationError, PromptError."""
    named = body
    if "text_1" not in body:  # vLLM's newer names
        for first, second in _SCORE_NAMES:
            if first in body and second in body:
                named = {**body, "text_1": body[first], "text_2": body[second]}
                break
    fields: _ScoreFields = _fields(_ScoreFields, named)
    pairs = _pairs(engine, _side(fields.text_1), _side(fields.text_2))
    if isinstance(pairs, ErrorReply):
        return pairs, 0
    scores, tokens, error = _scored(engine, pairs)
    if error is not None:
        return error, tokens
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    answer = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
              "model": _model(body, engine), "data": data, "usage": _usage(tokens)}
    return ErrorReply(200, orjson.dumps(answer)), tokens

