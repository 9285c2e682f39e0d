"""Request bodies parsed without holding the event loop (issue 15): decode, cheap bounds, validation,
routing features, and the body the engine gets.

Why processes: orjson and pydantic parse a body in one call into C/Rust that holds the GIL, so a
worker thread stalls the event loop just as much (measured on a busy 2-core machine: 363 ms for
one 64 MB string, 520 ms for 4M token ids, ~0.7 s validating 50,000 content parts). A body larger
than `parse_offload_bytes`, or one whose decoded JSON has more than `parse_offload_items` messages
+ content parts (chat) or prompt elements (completions), is parsed in a parse process
(`ParsePool`, `parse_processes` of them, spawned on first use); it sends back the `RoutingRequest`
and the engine's body, ready to send (`ForwardBody`), never the decoded object. The serving
process never holds such a body in one piece: its chunks (`ChunkedBody`, not joined) are written
by a thread to a file the parse process reads (one copy of 64 MB held the loop 0.1-0.3 s here).

Cheap bounds first (`BodyParser.check_size`): the count limits, then a lower bound of the request's
tokens (each message's template tokens, text at `CHARS_PER_TOKEN_MAX` characters a token, each
image at its least cost, the output limit when no pool's engine shortens it) against the largest pool: a
request that fits no pool is refused before its parts are validated, measured or hashed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import tempfile
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import orjson
from pydantic import ValidationError

from gateway.affinity.hashing import PrefixHasher
from gateway.auth.access import model_not_found_message
from gateway.auth.cache_isolation import SALT_FIELD
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.patches import ask_for_usage
from gateway.config import GatewayConfig
from gateway.dialects.base import usage_patch
from gateway.dialects.messages import AnthropicWire
from gateway.dialects.names import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RERANK, RESPONSES, SCORE, Api
from gateway.dialects.registry import DIALECTS, dialect_for
from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest, ModelNotFound, ModelNotPermitted
from gateway.protocol.adapter_fields import STRIPPED_ADAPTER_FIELDS, check_adapter_fields, engine_adapter_field
from gateway.protocol.body import (
    ENGINE_ID_FIELDS,
    KV_TRANSFER_FIELDS,
    SCHEDULING_FIELDS,
    XARGS_FIELD,
    decode_json_object,
    without_connector_args,
)
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest, describe_validation_error
from gateway.protocol.pooling import EmbeddingsRequest, RerankRequest, ScoreRequest
from gateway.protocol.responses import ResponsesRequest
from gateway.routing.features import ENGINE_OUTPUT_FIELD, RoutingRequest
from gateway.routing.pools import fitting_pools
from gateway.routing.tokens import TokenEstimator

T = TypeVar("T")
Wire = (ChatCompletionRequest | CompletionRequest | AnthropicWire | ResponsesRequest | EmbeddingsRequest
        | RerankRequest | ScoreRequest)
_WIRE_DIALECT = {ChatCompletionRequest: DIALECTS[CHAT], CompletionRequest: DIALECTS[COMPLETIONS],
                 AnthropicWire: DIALECTS[MESSAGES], ResponsesRequest: DIALECTS[RESPONSES],
                 EmbeddingsRequest: DIALECTS[EMBEDDINGS], RerankRequest: DIALECTS[RERANK],
                 ScoreRequest: DIALECTS[SCORE]}
"""The dialect whose features a validated wire model has (count_tokens' are Messages': `AnthropicWire.api`)."""

CHARS_PER_TOKEN_MAX = 8
"""No text estimate counts more characters a token than this (the estimator's least rate by default
is 0.25 tokens a character, ASCII letters), so the lower bound stays below any estimate (it is raised
to twice the characters a token of the least configured `text_rates` rate should that be larger)."""


def upstream_body(payload: dict[str, Any], served_model: str, ask_usage: bool = False,
                  output_as_max_tokens: bool = False, kv_transfer_fields: bool = False,
                  adapter_field: tuple[str, str] | None = None) -> bytes:
    """The client's JSON object as the engine gets it. The only edits: `model` becomes the pool's
    served name; top-level fields set to null are left out (null means "the default" in OpenAI's
    API, but some engine versions fail on it, e.g. `max_tokens: null` on vLLM's completions);
    the engine request ids (`ENGINE_ID_FIELDS`) are left out, and so are the engines' adapter-picking
    fields (`STRIPPED_ADAPTER_FIELDS`: the gateway chooses the adapter) and the KV connector's fields
    (`KV_TRANSFER_FIELDS`, also inside `vllm_xargs`) unless `kv_transfer_fields` (the pool's
    `allow_kv_transfer_fields`); `adapter_field` (name, adapter), the field through which the pool's
    engine takes the LoRA adapter the request was routed for (SGLang's `lora_path`,
    `protocol.adapter_fields.engine_adapter_field`), is written;
    the usage patch's `stream_options` when `ask_usage`; and with `output_as_max_tokens` (an
    engine that ignores `max_completion_tokens` on this API, `EngineSpec.max_completion_tokens_apis`)
    `max_completion_tokens` is sent as `max_tokens`, which it replaces, as OpenAI ranks them.
    Raises InvalidRequest for JSON nested deeper than orjson writes."""
    body = {name: value for name, value in payload.items() if value is not None}
    for name in _ALWAYS_STRIPPED if kv_transfer_fields else _STRIPPED:
        body.pop(name, None)
    if adapter_field is not None:
        body[adapter_field[0]] = adapter_field[1]
    if not kv_transfer_fields and XARGS_FIELD in body:
        body[XARGS_FIELD] = without_connector_args(body[XARGS_FIELD])
    if ask_usage:
        body = ask_for_usage(body)
    if output_as_max_tokens and "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    body["model"] = served_model
    return _dumps(body)


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError as exc:  # orjson writes at most 254 levels of nesting; it reads 1024
        raise InvalidRequest(f"The request body cannot be forwarded: {exc} (nested too deeply).",
                             code="invalid_json") from None


BodyKey = tuple[str, bool, bool, bool, tuple[str, str] | None]
"""(served model name, usage patch, `max_completion_tokens` sent as `max_tokens`, the KV connector's
fields kept, the engine's adapter field): what makes one pool's engine body differ from another's
(`upstream_body`'s arguments)."""

_ALWAYS_STRIPPED = ENGINE_ID_FIELDS + STRIPPED_ADAPTER_FIELDS
_STRIPPED = _ALWAYS_STRIPPED + KV_TRANSFER_FIELDS
_HEAD_FIELDS = ("model", "stream_options", "max_tokens", "max_completion_tokens", ENGINE_OUTPUT_FIELD, XARGS_FIELD,
                *KV_TRANSFER_FIELDS, *SCHEDULING_FIELDS)


@dataclass(frozen=True, slots=True)
class ForwardBody:
    """The engine's body of a request parsed in a parse process, encoded there for the first fitting
    pool: `first` is `upstream_body(payload, *first_key)`, written as the members that differ per
    pool (`model`, `stream_options`, the output limit), then the client's other non-null members
    from byte `members_at` on. Another pool's body splices a new head onto those bytes (one copy,
    no re-encoding)."""

    first: bytes
    first_key: BodyKey
    members_at: int
    head_fields: tuple[tuple[str, Any], ...] = ()  # the client's own non-null values of _HEAD_FIELDS, + `with_member`'s

    @classmethod
    def of(cls, payload: dict[str, Any], served_model: str, ask_usage: bool,
           output_as_max_tokens: bool = False, kv_transfer_fields: bool = False,
           adapter_field: tuple[str, str] | None = None) -> ForwardBody:
        """Encode `payload` for its first pool (the engine request ids and adapter-picking fields
        left out; the KV connector's fields and the engine's adapter field in the per-pool head).
        Raises InvalidRequest (nested too deeply)."""
        rest = {k: v for k, v in payload.items()
                if k not in _HEAD_FIELDS and k not in _ALWAYS_STRIPPED and v is not None}
        members = _dumps(rest)[1:-1]
        own = tuple((k, payload[k]) for k in _HEAD_FIELDS[1:] if payload.get(k) is not None)
        key: BodyKey = (served_model, ask_usage, output_as_max_tokens, kv_transfer_fields, adapter_field)
        head = cls(b"", key, 0, own)._head(key, bool(members))
        return cls(head + members + b"}", key, len(head), own)

    def _head(self, key: BodyKey, more: bool) -> bytes:
        head = upstream_body(dict(self.head_fields), *key)
        return head[:-1] + (b"," if more and len(head) > 2 else b"")

    def with_member(self, name: str, value: Any) -> ForwardBody:
        """This body with top-level member `name` set to `value` (one the client left out or set to
        null, so not among the encoded members): written into the head, as the client's own
        head fields are. Raises InvalidRequest as `of`."""
        own = (*((k, v) for k, v in self.head_fields if k != name), (name, value))
        members = self.first[self.members_at:-1]
        head = ForwardBody(b"", self.first_key, 0, own)._head(self.first_key, bool(members))
        return ForwardBody(head + members + b"}", self.first_key, len(head), own)

    def encode(self, served_model: str, ask_usage: bool, output_as_max_tokens: bool = False,
               kv_transfer_fields: bool = False, adapter_field: tuple[str, str] | None = None) -> bytes:
        """The engine's body for a pool serving `served_model`, with the usage patch or not, with
        `max_completion_tokens` as `max_tokens` or not, with the client's KV connector fields or not,
        with the engine's adapter field (`upstream_body`) or none."""
        key: BodyKey = (served_model, ask_usage, output_as_max_tokens, kv_transfer_fields, adapter_field)
        if key == self.first_key:
            return self.first
        members = memoryview(self.first)[self.members_at:-1]
        return b"".join((self._head(key, bool(members)), members, b"}"))


Payload = dict[str, Any] | ForwardBody


def encode_for(payload: Payload, served_model: str, ask_usage: bool, output_as_max_tokens: bool = False,
               kv_transfer_fields: bool = False, adapter_field: tuple[str, str] | None = None) -> bytes:
    """The engine's body from a decoded payload or a `ForwardBody`. Raises InvalidRequest."""
    if isinstance(payload, ForwardBody):
        return payload.encode(served_model, ask_usage, output_as_max_tokens, kv_transfer_fields, adapter_field)
    return upstream_body(payload, served_model, ask_usage, output_as_max_tokens, kv_transfer_fields, adapter_field)


LORA_PATH_APIS = frozenset({CHAT, COMPLETIONS, EMBEDDINGS})
"""The APIs whose SGLang request reads `lora_path` (its chat, completion and embedding requests,
python/sglang/srt/entrypoints/openai/protocol.py): there a client's value is checked
(`protocol.adapter_fields.check_adapter_fields`); elsewhere no engine reads it, so it is only dropped."""

OUTPUT_LIMIT_FIELD: dict[str, str] = {api: d.output_limit_field for api, d in DIALECTS.items()
                                      if d.output_limit_field is not None}
"""The output limit each API's body names (its dialect's `output_limit_field`: OpenAI's chat and
completions, Anthropic's Messages, OpenAI's Responses). On chat `max_completion_tokens` is sent as
`max_tokens` to an engine that ignores it there (`upstream_body`'s `output_as_max_tokens`)."""


def with_output_limit(payload: Payload, api: str, tokens: int) -> Payload:
    """`payload` with the API's output limit (`OUTPUT_LIMIT_FIELD`) set to `tokens`, for a request
    that set none: the engine then generates at most what the gateway reserved for it. A payload
    of an API without such a field (count_tokens) is returned as it is."""
    name = dialect_for(api).output_limit_field
    if name is None:
        return payload
    return _with_member(payload, name, tokens)


def with_engine_output_limit(payload: Payload, tokens: int) -> Payload:
    """`payload` with llama.cpp's `n_predict` (`ENGINE_OUTPUT_FIELD`, which that server ranks over
    `max_tokens`) set to `tokens`, the reserved output, when the client sent a number that is not
    a limit within it (-1, llama.cpp's "no limit", or any other below 1); else `payload` as it is
    (a client's own 1..`tokens` is kept; a non-number makes llama.cpp fall back to `max_tokens`)."""
    if isinstance(payload, ForwardBody):
        value = next((v for k, v in payload.head_fields if k == ENGINE_OUTPUT_FIELD), None)
    else:
        value = payload.get(ENGINE_OUTPUT_FIELD)
    if type(value) not in (int, float) or 1 <= cast(float, value) < tokens + 1:
        return payload
    return _with_member(payload, ENGINE_OUTPUT_FIELD, tokens)


def with_salt(payload: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """A decoded body with its `cache_salt` set to `salt`, replacing the client's (None: as it is):
    the gateway's per-key cache partition (gateway/auth/cache_isolation.py), set before validation
    so the routing features hash the prompt under it."""
    return payload if salt is None else {**payload, SALT_FIELD: salt}


def _with_member(payload: Payload, name: str, value: Any) -> Payload:
    if isinstance(payload, ForwardBody):
        return payload.with_member(name, value)
    return {**payload, name: value}


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a parse process sends back: the routing features and the engine's body, or (`request`
    None) the image URLs to measure before it can finish (`image_fetch`)."""

    request: RoutingRequest | None
    forward: ForwardBody | None
    urls: list[str]


class BodyParser:
    """The CPU part of `ProxyService.parse`, the same in the serving process and a parse process."""

    def __init__(self, config: GatewayConfig, estimator: TokenEstimator | None = None,
                 hasher: PrefixHasher | None = None) -> None:
        self.config = config
        self.estimator = estimator or TokenEstimator(config.estimation)
        self.hasher = hasher if hasher is not None or not config.affinity.enabled else PrefixHasher(config.affinity)
        served = config.served_models()
        self.models = {name.lower(): model.name for model in served for name in model.names()}
        self.chains = {model.name: config.model_pools(model.name) for model in served}
        """Canonical model name -> the pools serving it, in its cost order."""
        self.largest_context = max(p.max_context_tokens for p in config.pools)
        engines = [ENGINES[p.engine] for p in config.pools]
        self._floor_counts_output = not any(engine.clamps_output for engine in engines)
        """Whether the output limit adds to the lower bound: only when no pool's engine shortens it
        (`EngineSpec.accepts`; vLLM and llama.cpp serve a prompt that fits with a limit that does not)."""
        self._output_within_context = all(e.output_within_context or not e.clamps_output for e in engines)
        """Whether every pool's engine refuses an output limit over its whole context (vLLM, SGLang)."""
        estimation = config.estimation
        rates = estimation.text_rates
        least = estimation.safety_margin * min(  # tokens of the cheapest character (others: 1 byte or more)
            rates.latin, rates.digit, rates.whitespace, rates.punctuation, rates.han, rates.kana, rates.hangul,
            rates.cjk_punctuation, 1 / estimation.bytes_per_token)
        self._chars_per_token = max(CHARS_PER_TOKEN_MAX, math.ceil(2 / least)) if least > 0 else 2**62
        self._image_floor = min(estimation.image_tokens_min, estimation.image_tokens_default)

    def decode(self, api: Api, body: bytes) -> tuple[dict[str, Any], int]:
        """The body's JSON object after the cheap checks, and its size in items (messages + content
        parts, or prompt elements). Raises InvalidRequest, ContextLengthExceeded."""
        payload = decode_json_object(body)
        return payload, self.check_size(api, payload)

    def validate(self, api: Api, payload: dict[str, Any], adapters: Collection[str] = frozenset(),
                 allowed: Collection[str] | None = None) -> tuple[Wire, str, list[str]]:
        """The wire model, the model's canonical name (or, for a request naming one of `adapters`,
        the LoRA adapters the pools declare or their workers list, that adapter's name exactly as
        the engines list it, which an alias never shadows: it would send the engine the base
        model's name), and (chat, with image fetching on) the image URLs to measure. Raises
        InvalidRequest, ModelNotFound, and ModelNotPermitted for a model not in `allowed` (the
        caller's key's models, `Principal.models`; None: all): the same answer as for a name no
        model has, naming the model as the client sent it, at the same step (before any token
        estimate, image fetch or pool choice), so a key cannot tell the two apart."""
        dialect = dialect_for(api)
        try:
            wire: Wire = dialect.validate(payload)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            raise InvalidRequest(message, param=param) from None
        name = dialect.model_of(wire)
        model = name if name in adapters else self.models.get(name.lower())
        if model is None:
            raise ModelNotFound(model_not_found_message(name), param="model")
        if allowed is not None and model not in allowed:
            raise ModelNotPermitted(model_not_found_message(name), model=model, param="model")
        if api in LORA_PATH_APIS:
            check_adapter_fields(payload, None if model in self.chains else model)
        urls = dialect.image_urls(wire) if self.config.image_fetch.enabled else []
        return wire, model, urls

    def features(self, wire: Wire, model: str, session: str | None,
                 measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """The routing features of a validated request (its dialect's, known by its wire model)."""
        request = _WIRE_DIALECT[type(wire)].features(wire, model, self.estimator, self.hasher, session, measured)
        if model not in self.chains:  # a LoRA adapter (`validate`)
            return replace(request, adapter=model)
        return request

    def parse(self, api: Api, body: bytes, session: str | None,
              measured: Mapping[str, tuple[int, int]] | None, adapters: Collection[str] = frozenset(),
              allowed: Collection[str] | None = None, salt: str | None = None) -> Parsed:
        """All of it, for a parse process: with image fetching on and URLs not yet `measured`, it
        stops after validation and asks for them; `salt` is set as the body's `cache_salt`
        (`with_salt`). Raises what `decode`, `validate` (`allowed`: the key's models) and
        `fitting_pools` raise."""
        payload, _ = self.decode(api, body)
        payload = with_salt(payload, salt)
        wire, model, urls = self.validate(api, payload, adapters, allowed)
        if urls and measured is None:
            return Parsed(None, None, urls)
        request = self.features(wire, model, session, measured)
        pool = fitting_pools(request, self.config.pools if request.adapter else self.chains[request.model])[0]
        engine = ENGINES[pool.engine]
        usage = usage_patch(request, engine)
        as_max_tokens = api not in engine.max_completion_tokens_apis
        served = self.config.served_name(pool, model) if request.adapter is None else request.adapter
        return Parsed(request, ForwardBody.of(payload, served, usage, as_max_tokens, pool.allow_kv_transfer_fields,
                                              engine_adapter_field(pool.engine, request.adapter)), urls)

    def check_size(self, api: Api, payload: dict[str, Any]) -> int:
        """The count limits, then the lower bound of the tokens (module docstring), as the API's
        dialect counts them (`Dialect.check_size`); returns the body's size in items. Linear in the
        number of messages and parts."""
        return dialect_for(api).check_size(self, payload)

    def check_floor(self, payload: dict[str, Any], param: str, chars: int, images: int, tokens: int,
                    output: object, messages: int | None) -> None:
        """ContextLengthExceeded (naming `param`) when `chars` characters of text, `images` images and
        `tokens` more tokens, + the output limit `output` (the body's value, as sent; only when no pool's
        engine shortens an output limit instead of refusing it), + the chat template's tokens for
        `messages` messages (None: no template), cannot fit the largest pool; or when `output` alone is
        over the largest context and every pool's engine refuses that (vLLM, SGLang)."""
        estimation = self.config.estimation
        floor = tokens + chars // self._chars_per_token + images * self._image_floor
        if messages is not None:
            floor += estimation.tokens_per_request + estimation.tokens_per_message * messages
        if type(output) is float and output.is_integer():  # JSON's 5.0 is 5, as validation reads it
            output = int(output)
        if type(output) is int and output > 0 and self._floor_counts_output:
            floor += output
        if floor > self.largest_context or (self._output_within_context and type(output) is int
                                            and output > self.largest_context):
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.largest_context} tokens. However, this request "
                f"needs at least {floor} tokens (a lower bound, counted before measuring it). Please reduce the "
                "length of the messages or the output limit.", param=param)


# --- parse processes ----------------------------------------------------------------------------------------

SPOOL_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
"""Where a body is handed to a parse process: a RAM-backed directory when there is one, else the
system's temporary directory."""

Measure = Callable[[list[str]], Awaitable[Mapping[str, tuple[int, int]]]]


@dataclass(slots=True)
class ChunkedBody:
    """A large request body kept as the chunks it arrived in: joining them is one copy of the whole
    body, which held the event loop ~0.1-0.3 s for 64 MB here. Only a parse process reads it whole."""

    chunks: list[bytes]
    size: int

    def __len__(self) -> int:
        return self.size


Body = bytes | ChunkedBody


def body_of(chunks: list[bytes], size: int, join_max: int) -> Body:
    """`chunks` (`size` bytes in all) as bytes when one chunk or at most `join_max` bytes, else as a
    ChunkedBody (it will be parsed in a parse process)."""
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks) if size <= join_max else ChunkedBody(chunks, size)


def _spool(fd: int, body: Body) -> None:
    """Write `body` to the open file `fd` and close it (in a thread: the loop does not copy it)."""
    with os.fdopen(fd, "wb", buffering=0) as file:
        for chunk in body.chunks if isinstance(body, ChunkedBody) else (body,):
            view = memoryview(chunk)
            while view:
                view = view[file.write(view):]


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_PROCESS_PARSER: list[BodyParser] = []  # in a parse process only: its one parser, built by `_start_process`


PARSE_NICENESS = 10
"""Added to a parse process's nice value: on a busy machine the serving process (every stream, every
Redis check) goes first, the bulk work of parsing large bodies after it."""


def _start_process(config: GatewayConfig) -> None:  # pragma: no cover - runs in the parse process
    with contextlib.suppress(OSError):
        os.nice(PARSE_NICENESS)
    _PROCESS_PARSER.append(BodyParser(config))


def _parse_file(api: Api, path: str, session: str | None, measured: Mapping[str, tuple[int, int]] | None,
                adapters: Collection[str], allowed: Collection[str] | None,
                salt: str | None) -> Parsed:  # pragma: no cover - ditto
    with open(path, "rb") as file:
        body = file.read()
    return _PROCESS_PARSER[0].parse(api, body, session, measured, adapters, allowed, salt)


class ParsePool:
    """`parse_processes` parse processes (spawned, so no state of the serving process is copied),
    started on first use; one that dies is replaced (its request gets a 500, the next one a new pool).

    A body reaches a parse process through a file in `SPOOL_DIR` (mode 0600, removed as soon as the
    request is parsed), written by a thread, so the serving process never copies it in one piece.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.config.parse_processes,
                                                 mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_process, initargs=(self.config,))
        return self._executor

    async def parse(self, api: Api, body: Body, session: str | None, measure: Measure | None,
                    adapters: Collection[str] = frozenset(), allowed: Collection[str] | None = None,
                    salt: str | None = None) -> Parsed:
        """`BodyParser.parse` in a parse process (`adapters`: the LoRA adapter names known now;
        `allowed`: the caller's key's models, None: all; `salt`: the `cache_salt` to set); its
        GatewayErrors are raised here. With image URLs to measure, `measure(urls)` gives their sizes
        and the body is parsed again with them."""
        fd, path = tempfile.mkstemp(prefix="kimi-gateway-body-", dir=SPOOL_DIR)
        try:
            await asyncio.to_thread(_spool, fd, body)
            parsed = await self._run(_parse_file, api, path, session, None, adapters, allowed, salt)
            if parsed.request is None and measure is not None:
                parsed = await self._run(_parse_file, api, path, session, await measure(parsed.urls), adapters,
                                         allowed, salt)
            return parsed
        finally:  # freeing a large file's pages takes a while: not on the event loop either
            try:
                asyncio.get_running_loop().run_in_executor(None, _remove, path)
            except RuntimeError:  # the loop's executor is shut down (the server is stopping)
                _remove(path)

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        executor = self._pool()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, work, *args)
        except BrokenProcessPool:
            if self._executor is executor:
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            raise GatewayError("A request parser process ended unexpectedly; please retry.") from None

    def reconfigure(self, config: GatewayConfig) -> None:
        """Parse with `config` from now on (a reload): the processes started with the old one finish
        what they hold and end; the next body starts new ones."""
        self.config = config
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=False)
            self._executor = None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
