"""The pooling APIs: OpenAI's embeddings (`POST /v1/embeddings`), vLLM's rerank (`POST /v1/rerank`)
and score (`POST /v1/score`). Non-streaming JSON answers; nothing is generated.

Each input is its own sequence on the engine: an embeddings batch embeds every input apart, a
rerank or score request runs one sequence per (query, document) pair (a cross-encoder reads them
joined; vLLM's `ServingScores` for cross-encoders, `vllm/entrypoints/pooling/score/serving.py`). So
the context a pool must hold is the longest sequence (`RoutingRequest.prompt_tokens`) and the key's
token quota is charged all of them (`batch_prompt_tokens`); the output reservation is 0. Text is
counted by the gateway's estimator (`routing/tokens.py`), token ids one each, chat messages as chat
counts them (the template's tokens per message), images at their default cost. A sequence the engine
tokenizes from text also gets the special tokens its tokenizer adds (`estimation.pooling_special_tokens`,
4): vLLM tokenizes an embeddings input with `add_special_tokens` on by default
(`vllm/entrypoints/pooling/base/protocol.py`, `CompletionRequestMixin`) and a cross-encoder's pair as
`tokenizer(text=query, text_pair=document)` with them (`vllm/entrypoints/pooling/scoring/io_processor.py`;
`scoring/utils.py` `get_num_special_tokens_for_pair`: BERT's `[CLS] q [SEP] d [SEP]` 3, XLM-RoBERTa's
`<s> q </s></s> d </s>` 4), so a rerank of many short documents costs several times its text's
tokens; token ids are taken as they are, a chat-template sequence has its template's count. No prefix hashes:
an embedding request leaves no KV cache to route to (`prefix` None, so the dispatch neither looks
prefixes up nor records them). Usage (`prompt_tokens`, `total_tokens`; vLLM's older rerank answers
only `total_tokens`) settles the quota; errors are OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from gateway.affinity.hashing import PrefixHasher
from gateway.dialects.base import Dialect, SizeChecker
from gateway.dialects.chat import chat_counts
from gateway.dialects.names import EMBEDDINGS, RERANK, SCORE, Api
from gateway.errors import InvalidRequest
from gateway.protocol.pooling import SCORE_SIDES, EmbeddingsRequest, RerankRequest, ScoreRequest
from gateway.routing.features import RoutingRequest, session_hint
from gateway.routing.tokens import TokenEstimator

W = TypeVar("W", EmbeddingsRequest, RerankRequest, ScoreRequest)

Sequence = tuple[bytes, int, int, int]
"""One sequence as counted: (its text, UTF-8; token ids; chat messages (template tokens); images)."""

_EMPTY: Sequence = (b"", 0, 0, 0)

BINARY_ENCODINGS = frozenset({"bytes", "bytes_only"})
"""vLLM's binary `encoding_format`s (`vllm/utils/serial_utils.py` `EncodingFormat`: "float", "base64",
"bytes"; "bytes_only" is refused too, being no JSON either way, or else no format vLLM knows): the answer is
`application/octet-stream` with the usage and shapes in a `metadata` header
(`vllm/entrypoints/pooling/embed/api_router.py`), which the gateway does not relay (it relays JSON
answers only, and would take the engine's octet stream for a broken worker), so it refuses them
up front: the one thing a vLLM engine accepts that the gateway does not."""


def _text(value: object) -> bytes:
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else b""


def _objects(objects: list[Any]) -> Sequence:
    """Chat messages (`role`, `content`: a string or parts) or multimodal objects (SGLang's
    `{"text", "image"}`, vLLM's `{"content": [parts]}`) as one sequence."""
    texts: list[bytes] = []
    images = messages = 0
    for item in objects:
        if not isinstance(item, dict):
            continue
        messages += "role" in item
        content = item.get("content")
        if isinstance(content, str):
            texts.append(_text(content))
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    texts.append(_text(part.get("text")))
                elif isinstance(kind, str) and kind.startswith("image"):
                    images += 1
        texts.append(_text(item.get("text")))
        images += item.get("image") is not None
    return b"\n".join(t for t in texts if t), 0, messages, images


def _one(value: object) -> Sequence:
    """One input: a string, token ids (SGLang's score sides), or an object (`_objects`)."""
    if isinstance(value, str):
        return _text(value), 0, 0, 0
    if isinstance(value, dict):
        return _objects([value])
    if isinstance(value, list):
        if value and isinstance(value[0], dict):
            return _objects(value)
        return b"", len(value), 0, 0
    return _EMPTY


def embedding_sequences(wire: EmbeddingsRequest) -> list[Sequence]:
    """The sequences an embeddings request asks for: one per string, token-id list or conversation
    (chat messages, in `input` or `messages`), one per SGLang multimodal object; token ids alone one."""
    value = wire.input if wire.input is not None else wire.messages
    if isinstance(value, str):
        return [_one(value)]
    if not value:
        return [_EMPTY]
    head = value[0]
    if type(head) is int:
        return [(b"", len(value), 0, 0)]
    if isinstance(head, dict):  # one conversation, or SGLang's multimodal inputs (each its own)
        return [_objects(value)] if "role" in head else [_objects([item]) for item in value]
    return [_one(item) for item in value]


def _side(value: object) -> list[Sequence]:
    """One side of a rerank or score request as its inputs: a list of them (but a token-id list,
    one input), else the one input."""
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return [_one(item) for item in value]
    return [_one(value)]


def _joined(first: Sequence, second: Sequence) -> Sequence:
    return first[0] + b"\n" + second[0], first[1] + second[1], first[2] + second[2], first[3] + second[3]


def rerank_sequences(wire: RerankRequest) -> list[Sequence]:
    """One sequence per document: the query joined with it."""
    query = _one(wire.query)
    return [_joined(query, document) for document in _side(wire.documents)]


def score_sequences(wire: ScoreRequest) -> list[Sequence]:
    """One sequence per pair: a side of one input is paired with every input of the other, two
    lists item by item (vLLM's `ServingScores`; lists of different lengths are the engine's to
    refuse, counted here over the longer)."""
    sides = wire.sides()
    assert sides is not None  # the wire model requires a pair
    first, second = _side(sides[0]), _side(sides[1])
    pairs = max(len(first), len(second))
    return [_joined(first[min(i, len(first) - 1)], second[min(i, len(second) - 1)]) for i in range(pairs)]


def pooling_features(api: Api, sequences: list[Sequence], model: str, estimator: TokenEstimator,
                     session: str | None) -> RoutingRequest:
    """Features of a pooling request made of `sequences`: the longest one's tokens as its context, all
    of them as its quota charge, no output, no stream, no prefix (module docstring)."""
    config = estimator.config
    counts: list[int] = []
    for text, ids, messages, images in sequences:
        tokens = ids + images * config.image_tokens_default
        if messages:
            tokens += config.tokens_per_request + config.tokens_per_message * messages
        elif text or images:  # tokenized by the engine, which adds its special tokens (module docstring)
            tokens += config.pooling_special_tokens
        counts.append(tokens + (estimator.utf8_tokens(text) if text else 0))
    has_text = any(s[0] for s in sequences) or not any(s[1] for s in sequences)
    images = any(s[3] for s in sequences)
    method = ("bytes" if has_text else "token_ids") + ("+default" if images else "")
    return RoutingRequest(
        api=api, model=model, prompt_tokens=max(counts), output_tokens=0, stream=False,
        modalities=frozenset({"text", "image"} if images else {"text"}), estimate_method=method,
        session_key=session, include_usage=True, batch_prompt_tokens=sum(counts))


def pooling_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """An engine's pooling usage in the chat names the gateway accounts by: `prompt_tokens` (else
    `total_tokens`, all vLLM's older rerank answer gives), `completion_tokens` 0 when absent (OpenAI's
    embeddings usage has none), `total_tokens`. Values that are not integers are left out."""
    prompt = usage.get("prompt_tokens")
    total = usage.get("total_tokens")
    if type(prompt) is not int:
        prompt = total
    completion = usage.get("completion_tokens")
    normal: dict[str, Any] = {}
    if type(prompt) is int:
        normal["prompt_tokens"] = prompt
        normal["completion_tokens"] = completion if type(completion) is int else 0
    if type(total) is int:
        normal["total_tokens"] = total
    return normal


def _chars(value: object) -> int:
    """Characters of text in one decoded input (before validation; anything else counts 0)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        content = value.get("content")
        return _chars(value.get("text")) + (len(content) if isinstance(content, str) else
                                            chat_counts([value])[0] if isinstance(content, list) else 0)
    return 0


def _side_chars(value: object) -> list[int]:
    if isinstance(value, list):
        return [_chars(item) for item in value] or [0]
    return [_chars(value)]


class _Pooling(Dialect[W]):
    """What the pooling APIs share: a JSON answer, no output limit, usage in their own names."""

    output_limit_field = None

    def answer_usage(self, usage: dict[str, Any], cache_in_input: bool) -> dict[str, Any]:
        """`pooling_usage`."""
        return pooling_usage(usage)


class EmbeddingsDialect(_Pooling[EmbeddingsRequest]):
    """OpenAI's embeddings API (vLLM's and SGLang's `/v1/embeddings`, llama.cpp's)."""

    api = EMBEDDINGS
    path = "/v1/embeddings"
    wire_model = EmbeddingsRequest
    prompt_param = "input"

    def features(self, wire: EmbeddingsRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`pooling_features` of `embedding_sequences`. Raises InvalidRequest for a binary
        `encoding_format` (`BINARY_ENCODINGS`)."""
        encoding = (wire.model_extra or {}).get("encoding_format")
        if encoding in BINARY_ENCODINGS:
            raise InvalidRequest(f"encoding_format '{encoding}' is not relayed by this gateway (its answer is not "
                                 "JSON); use 'float' or 'base64'.", param="encoding_format", code="unsupported_value")
        session = session_hint(session_key, (wire.model_extra or {}).get("user"))
        return pooling_features(EMBEDDINGS, embedding_sequences(wire), model, estimator, session)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """The token-id limit (`max_prompt_ids`, texts one each), the message limit (`max_messages`)
        for conversations, then the lower bound of the longest input's tokens; the input's size in
        items (token ids, texts, messages)."""
        config = checker.config
        value = payload.get("input")
        param = "input"
        if value is None:
            value, param = payload.get("messages"), "messages"
        if isinstance(value, str):
            checker.check_floor(payload, param, len(value), 0, 0, None, None)
            return 1
        if not isinstance(value, list) or not value:
            return 0
        head = value[0]
        if type(head) in (int, float):
            ids, longest, chars = len(value), len(value), 0
        elif isinstance(head, list) and not (head and isinstance(head[0], dict)):
            sizes = [len(item) if isinstance(item, list) else 1 for item in value]
            ids, longest, chars = sum(max(size, 1) for size in sizes), max(sizes), 0
        elif isinstance(head, (dict, list)):  # a conversation, conversations, or multimodal objects
            conversations = [item for item in value if isinstance(item, list)] or [value]
            messages = sum(len(c) for c in conversations)
            if messages > config.max_messages:
                raise InvalidRequest(f"Too many messages: {messages}; the limit is {config.max_messages}.",
                                     param=param, code="too_many_messages")
            chars = max(sum(_chars(m) for m in c) for c in conversations)
            checker.check_floor(payload, param, chars, 0, 0, None, None)
            return messages
        else:
            ids, longest, chars = len(value), 0, max(_chars(item) for item in value)
        if ids > config.max_prompt_ids:
            raise InvalidRequest(f"The input has {ids} token ids or texts; the limit is {config.max_prompt_ids}.",
                                 param=param, code="context_length_exceeded")
        checker.check_floor(payload, param, chars, 0, longest, None, None)
        return ids


class _Pairs(_Pooling[W]):
    """Rerank and score: one sequence per pair of inputs."""

    def _check_pairs(self, checker: SizeChecker, payload: dict[str, Any], first: object, second: object) -> int:
        """The pair limit (`max_prompt_ids`, one a pair), then the lower bound of the longest pair's
        tokens; the number of inputs."""
        one, two = _side_chars(first), _side_chars(second)
        items = len(one) + len(two)
        if items > checker.config.max_prompt_ids:
            raise InvalidRequest(f"The request has {items} inputs; the limit is {checker.config.max_prompt_ids}.",
                                 param=self.prompt_param, code="context_length_exceeded")
        checker.check_floor(payload, self.prompt_param, max(one) + max(two), 0, 0, None, None)
        return items


class RerankDialect(_Pairs[RerankRequest]):
    """vLLM's rerank API (Jina's and Cohere's shape; SGLang's and llama.cpp's `/v1/rerank`)."""

    api = RERANK
    path = "/v1/rerank"
    wire_model = RerankRequest
    prompt_param = "documents"

    def features(self, wire: RerankRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`pooling_features` of `rerank_sequences`."""
        session = session_hint(session_key, (wire.model_extra or {}).get("user"))
        return pooling_features(RERANK, rerank_sequences(wire), model, estimator, session)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """`_Pairs._check_pairs` of `query` and `documents`."""
        return self._check_pairs(checker, payload, payload.get("query"), payload.get("documents"))


class ScoreDialect(_Pairs[ScoreRequest]):
    """vLLM's score API (`text_1`/`text_2` and its other pair names; SGLang's `query`/`items`)."""

    api = SCORE
    path = "/v1/score"
    wire_model = ScoreRequest
    prompt_param = "text_2"

    def features(self, wire: ScoreRequest, model: str, estimator: TokenEstimator,
                 hasher: PrefixHasher | None, session_key: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """`pooling_features` of `score_sequences`."""
        session = session_hint(session_key, (wire.model_extra or {}).get("user"))
        return pooling_features(SCORE, score_sequences(wire), model, estimator, session)

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """`_Pairs._check_pairs` of the first pair of sides present (`SCORE_SIDES`)."""
        for first, second in SCORE_SIDES:
            if payload.get(first) is not None and payload.get(second) is not None:
                return self._check_pairs(checker, payload, payload[first], payload[second])
        return 0
