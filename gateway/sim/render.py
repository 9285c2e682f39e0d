"""vLLM's render and tokenize endpoints: a prompt's token ids without generating.

    POST /v1/chat/completions/render   chat request -> one GenerateRequest object
    POST /v1/completions/render        completion request -> a list of GenerateRequest, one per prompt
    POST /tokenize                     {"prompt"} or {"messages"} -> {"count", "max_model_len",
                                       "tokens", "token_strs"}
    POST /detokenize                   {"tokens": [ids]} -> {"prompt": text}

SGLang (api_version "current") serves its own `/tokenize` and `/detokenize`, also under `/v1/`
(`python/sglang/srt/entrypoints/http_server.py`; `serving_tokenize.py`, `protocol.py`
`TokenizeRequest` / `DetokenizeRequest`): `{"prompt": str | [str]}` -> `{"tokens", "count",
"max_model_len"}` (lists for a list of prompts), `{"tokens": [ids] | [[ids]]}` -> `{"text": str |
[str]}`; `model` is not checked; a body its request model refuses is its validation error (400).

Shapes from vLLM's API server (`vllm/entrypoints/openai/api_server.py` registers the render
routes with `response_model=GenerateRequest` / `list[GenerateRequest]`, the model of
`vllm/entrypoints/serve/disagg/protocol.py`: `request_id`, `token_ids`, `features`,
`sampling_params`, `model`, `stream`, `stream_options`, `cache_salt`, `priority`,
`kv_transfer_params`; `/tokenize` answers `TokenizeResponse`, `/detokenize` `DetokenizeResponse`, both
in `vllm/entrypoints/serve/tokenize/protocol.py`, served by `serving.py` beside it). `sampling_params` holds a subset of
vLLM's `SamplingParams` (n, temperature, top_p, max_tokens, stop, seed). Only the vLLM family at
api_version "current" serves the render routes (vLLM added them in 2026); `/tokenize` is older
and served by every vLLM-family version, as is `/detokenize`. Errors as the generation endpoints word them: 400 for a
bad body or a prompt over the context window, the engine's unknown-model answer.

vllm-router 0.1.17's `cache_aware` asks every worker for the render of each request (the chat or
completion body it will send, as is) and keys its prefix tree on `token_ids`; it falls back to
`/tokenize` when the render fails (observed against a logging stub, 2026-12-01).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, Field, ValidationError

from gateway.sim.asgi import Receive, Scope, Send, read_body, send_bytes, send_json
from gateway.sim.dialects import ErrorReply
from gateway.sim.tokens import (
    VOCAB_SIZE,
    FieldValidationError,
    PromptError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    engine_ints,
    output_token,
    own_output_tokens,
    prompt_token_ids,
    requested_output_field,
    requested_output_tokens,
    tools_tokens,
)
from gateway.sim.worker_state import SimWorkerState

CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETIONS_RENDER_PATH = "/v1/completions/render"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"


def serves_render(engine: SimWorkerState) -> bool:
    """Whether the engine has the render routes (vLLM family, api_version "current")."""
    return engine.config.engine in ("vllm", "ascend") and engine.config.api_version == "current"


def serves_tokenize(engine: SimWorkerState) -> bool:
    """Whether the engine has vLLM's `/tokenize` (every vLLM-family version)."""
    return engine.config.engine in ("vllm", "ascend")


def serves_sglang_tokenize(engine: SimWorkerState) -> bool:
    """Whether the engine has SGLang's `/tokenize` and `/detokenize` (SGLang, api_version "current")."""
    return engine.config.engine == "sglang" and engine.config.api_version == "current"


def _sampling_params(body: dict[str, Any], kind: str, prompt_tokens: int, max_context: int) -> dict[str, Any]:
    requested = requested_output_tokens(body, kind == "chat")
    stop = body.get("stop")
    return {
        "n": engine_ints(body, kind == "chat")["n"] or 1,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_tokens": requested if requested is not None else max(max_context - prompt_tokens, 1),
        "stop": [stop] if isinstance(stop, str) else (stop or []),
        "seed": body.get("seed"),
    }


def _generate_request(body: dict[str, Any], kind: str, ids: list[int], model: str,
                      max_context: int) -> dict[str, Any]:
    return {
        "request_id": str(body.get("request_id") or uuid.uuid4().hex),
        "token_ids": ids,
        "features": None,
        "sampling_params": _sampling_params(body, kind, len(ids), max_context),
        "model": model,
        "stream": body.get("stream") is True,
        "stream_options": body.get("stream_options"),
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority") or 0,
        "kv_transfer_params": body.get("kv_transfer_params"),
    }


async def _json_body(engine: SimWorkerState, receive: Receive, send: Send) -> dict[str, Any] | None:
    """The request's JSON object with a served (or absent) model; answers the error itself and
    returns None otherwise (also when the client left)."""
    raw = await read_body(receive)
    if raw is None:
        return None
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        await _reply(send, engine.dialect.bad_request("Invalid JSON body."))
        return None
    error = engine.dialect.check_model(body.get("model"), engine.model_names(), engine.config.served_model_names)
    if error is not None:
        await _reply(send, error)
        return None
    return body


async def _reply(send: Send, reply: ErrorReply) -> None:
    await send_bytes(send, reply.status, reply.body)


def _token_ids(engine: SimWorkerState, kind: str, body: dict[str, Any],
               check_context: bool) -> list[list[int]] | ErrorReply:
    """Token ids of each prompt, or the engine's 400 (malformed prompt, prompt over the window)."""
    config = engine.config
    try:
        if kind == "chat":
            counts = [chat_prompt_tokens(body.get("messages"), config) + tools_tokens(body.get("tools"), config)]
        else:
            counts = completion_prompt_tokens(body.get("prompt"), config)
        requested = requested_output_tokens(body, kind == "chat") if check_context else None
    except FieldValidationError as exc:
        return engine.dialect.validation_error(exc)
    except PromptError as exc:
        return engine.dialect.bad_request(str(exc))
    if kind == "text":
        bad = _out_of_vocabulary(body.get("prompt"))
        if bad is not None:  # vLLM's input processor: a ValueError, answered 400
            return engine.dialect.bad_request(f"Token id {bad} is out of vocabulary")
    if check_context:
        for count in counts:
            error = engine.dialect.check_context(count, requested, config.max_context_tokens, False,
                                                 requested_output_field(body, kind == "chat"))
            if error is not None:
                return error
    return prompt_token_ids(kind, body, counts, config)


def _out_of_vocabulary(prompt: Any) -> int | None:
    """The first token id of a token-id prompt outside 0..VOCAB_SIZE-1, else None."""
    if not isinstance(prompt, list):
        return None
    for item in prompt:
        for token in item if isinstance(item, list) else [item]:
            if isinstance(token, int) and not 0 <= token < VOCAB_SIZE:
                return token
    return None


async def render_chat(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /v1/chat/completions/render: one GenerateRequest for the chat request."""
    requests = await _rendered(engine, "chat", receive, send)
    if requests is not None:
        await send_json(send, 200, requests[0])


async def render_completion(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /v1/completions/render: a list of GenerateRequest, one per prompt."""
    requests = await _rendered(engine, "text", receive, send)
    if requests is not None:
        await send_json(send, 200, requests)


async def _rendered(engine: SimWorkerState, kind: str, receive: Receive, send: Send) -> list[dict[str, Any]] | None:
    """The GenerateRequests of a render call's body, one per prompt (`kind` "chat" or "text"); None
    when the body was refused (the error answer is sent)."""
    body = await _json_body(engine, receive, send)
    if body is None:
        return None
    ids = _token_ids(engine, kind, body, check_context=True)
    if isinstance(ids, ErrorReply):
        await _reply(send, ids)
        return None
    config = engine.config
    model = body.get("model") or config.model_name
    return [_generate_request(body, kind, one, model, config.max_context_tokens) for one in ids]


async def tokenize(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /tokenize: `{"messages": ...}` (chat) or `{"prompt": str}`; one prompt's ids. A prompt
    that is the simulated model's own answer counts as the tokens that generated it
    (`own_output_tokens`)."""
    body = await _json_body(engine, receive, send)
    if body is None:
        return
    kind = "chat" if "messages" in body else "text"
    if kind == "text" and not isinstance(body.get("prompt"), str):
        await _reply(send, engine.dialect.bad_request("prompt must be a string"))
        return
    own = own_output_tokens(body["prompt"]) if kind == "text" else None
    ids = prompt_token_ids(kind, body, [own], engine.config) if own is not None else \
        _token_ids(engine, kind, body, check_context=False)
    if isinstance(ids, ErrorReply):
        await _reply(send, ids)
        return
    await send_json(send, 200, {"count": len(ids[0]), "max_model_len": engine.config.max_context_tokens,
                                "tokens": ids[0], "token_strs": None})


async def detokenize(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /detokenize: `{"tokens": [ids]}` -> `{"prompt": text}` (vLLM's `create_detokenize`). The
    simulator's ids are hashes of the text, so it cannot give the text back: each id reads as one of
    its output words (`tokens.output_token`), a deterministic text of one word per id. `tokens`
    must be a list of non-negative integers (vLLM's `DetokenizeRequest`; the validation error
    otherwise, `FieldValidationError`)."""
    body = await _json_body(engine, receive, send)
    if body is None:
        return
    try:
        tokens = _Detokenize.model_validate({"tokens": body.get("tokens")}).tokens
    except ValidationError as exc:
        error = FieldValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])
        await _reply(send, engine.dialect.validation_error(error))
        return
    await send_json(send, 200, {"prompt": "".join(output_token(t) for t in tokens)})


class _Detokenize(BaseModel):
    """vLLM's `DetokenizeRequest.tokens`: a list of token ids >= 0 (lax ints, so 5.0 is 5)."""

    tokens: list[Annotated[int, Field(ge=0)]]


class _SglangTokenize(BaseModel):
    """SGLang's `TokenizeRequest` (`python/sglang/srt/entrypoints/openai/protocol.py`): the fields it reads."""

    prompt: str | list[str]


class _SglangDetokenize(BaseModel):
    """SGLang's `DetokenizeRequest`: `tokens`, one list of ids or a list of them."""

    tokens: list[int] | list[list[int]]


async def _sglang_body(engine: SimWorkerState, model: type[BaseModel], receive: Receive,
                       send: Send) -> BaseModel | None:
    """The body as SGLang's request model reads it; answers its 400 itself and returns None
    otherwise (also when the client left). SGLang checks no `model` here."""
    raw = await read_body(receive)
    if raw is None:
        return None
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        error = FieldValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])
        await _reply(send, engine.dialect.validation_error(error))
        return None


async def sglang_tokenize(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """SGLang's POST /tokenize: one prompt's ids and count, or a list of each for a list of prompts."""
    request = await _sglang_body(engine, _SglangTokenize, receive, send)
    if request is None:
        return
    assert isinstance(request, _SglangTokenize)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    ids = _token_ids(engine, "text", {"prompt": prompts}, check_context=False) if prompts else []
    if isinstance(ids, ErrorReply):
        await _reply(send, ids)
        return
    context = engine.config.max_context_tokens
    if isinstance(request.prompt, str):
        answer: dict[str, Any] = {"tokens": ids[0], "count": len(ids[0]), "max_model_len": context}
    else:
        answer = {"tokens": ids, "count": [len(one) for one in ids], "max_model_len": context}
    await send_json(send, 200, answer)


async def sglang_detokenize(engine: SimWorkerState, scope: Scope, receive: Receive, send: Send) -> None:
    """SGLang's POST /detokenize: the text of one list of ids (`""` for none), or of each list.
    Each id reads as one of the simulator's output words, as the vLLM route's (`detokenize`)."""
    request = await _sglang_body(engine, _SglangDetokenize, receive, send)
    if request is None:
        return
    assert isinstance(request, _SglangDetokenize)
    tokens = request.tokens
    if tokens and isinstance(tokens[0], list):
        text: str | list[str] = ["".join(output_token(t) for t in one) for one in tokens]
    else:
        text = "".join(output_token(t) for t in tokens)  # type: ignore[arg-type]
    await send_json(send, 200, {"text": text})
