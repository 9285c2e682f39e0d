"""`POST /v1/chat/completions`, `POST /v1/completions` and Anthropic's `POST /v1/messages` (+
`/v1/messages/count_tokens`, `gateway.sim.anthropic`) of the simulator.

Order of work for one request: read the body; record it; apply faults (hang, fail); check the
model name and the context window (errors before any stream byte); hash the prompt's blocks (with
a prefix cache); wait for admission (`max_num_seqs`, KV room); "prefill" for `ttft_s` (+ uncached
tokens / `prefill_tokens_per_s`), then cache the prompt's blocks; emit one word per token every
`tpot_s` (x the batch slowdown). With `scheduler="stepped"` the worker's step scheduler does the
admission, prefill and decode timing instead (`gateway.sim.stepper`); the handler waits for its
request's progress and sends each token as it appears. Every wait races the client's disconnect,
which marks the record aborted.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import ValidationError

from gateway.sim import anthropic as a
from gateway.sim import chat_tools as ct
from gateway.sim import responses as r
from gateway.sim import script as sc
from gateway.sim import sglang_shapes as sg
from gateway.sim import structured as so
from gateway.sim.active import ActiveRequest
from gateway.sim.asgi import (
    JSON_HEADERS,
    SSE_HEADERS,
    ClientDisconnected,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    lower_headers,
    read_body,
)
from gateway.sim.config import SimFaults
from gateway.sim.dialects import ErrorReply
from gateway.sim.kvcache import PromptKey
from gateway.sim.pd import PdFailure
from gateway.sim.pd_leg import PdLeg
from gateway.sim.request_ids import VLLM_FAMILY, already_running, engine_request_id
from gateway.sim.sampling import check_sampling
from gateway.sim.script import ScriptStep
from gateway.sim.stepper import StepRequest
from gateway.sim.tokens import (
    FieldValidationError,
    PromptError,
    chat_prompt_tokens,
    completion_continued_tokens,
    completion_prompt_tokens,
    continued_tokens,
    generated_count,
    messages_max_tokens,
    output_text,
    output_token,
    pretokenized_chat_prompt,
    requested_output_field,
    requested_output_tokens,
    text_tokens,
    tools_tokens,
)
from gateway.sim.worker_state import SimRequestRecord, SimWorkerState

RAW_CHUNK_PAUSE_S = 0.02
"""Pause between `raw_stream_chunks` writes, so each leaves as its own TCP segment."""

NULL_MAX_TOKENS_MESSAGE = "'>' not supported between instances of 'NoneType' and 'int'"
"""What the `null_max_tokens_500` fault answers: the TypeError of a completions path that compares
a null `max_tokens` with the room left in the context."""

_FAULT_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError",
                500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


class _DropConnection(Exception):
    """Stop without finishing the response: uvicorn then closes the connection mid-body."""


@dataclass(frozen=True)
class _Plan:
    """A validated generation request."""

    kind: r.Kind
    stream: bool
    prompt_tokens: list[int]
    output_tokens: int
    finish_reason: str
    fmt: r.StreamFormat
    keys: tuple[PromptKey, ...] = ()
    leg: PdLeg | None = None
    """The PD hand-over of a worker with a `pd_role` (see `gateway.sim.pd_leg`)."""
    anthropic: bool = False  # a Messages request: Anthropic's answer shapes
    script: tuple[int, ScriptStep] | None = None
    """The fixed answer (a script's step, a forced tool call, a structured answer: `gateway.sim.chat_tools`)."""
    forced: bool = False  # a fixed chat answer without text has `content` "" rather than null (`_fixed_plan`)
    model: str = ""
    """The `model` a chat or completions answer names (`SimWorkerState.answer_model`); "" for the first served name."""
    start: int = 0
    """Tokens of the answer the request already holds (a continued assistant turn, a completion
    prompt ending in the model's own text: `tokens.continued_tokens`): output token 0 is answer token `start`."""

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)


class _Responder:
    """Sends one response and notes its milestones in the record (status, header/byte times)."""

    def __init__(self, send: Send, engine: SimWorkerState, record: SimRequestRecord,
                 drop_after_events: int | None, anthropic: bool = False, faults: SimFaults | None = None,
                 watch: DisconnectWatch | None = None, cut_answer: bool = False) -> None:
        self.anthropic = anthropic  # errors in Anthropic's shape, the stream ends without `[DONE]`
        self._cut_answer = cut_answer  # a 200 answer is cut after half its body (`SimFaults.cut_answer`)
        self._send = send
        self._engine = engine
        self._record = record
        self._drop_after = drop_after_events
        self._stall_after = faults.stall_after_chunks if faults is not None else None  # `faults`: a stream's only
        self._error_after = faults.error_after_chunks if faults is not None else None
        self._reset_after = faults.reset_after_chunks if faults is not None else None
        self._pause_after = faults.pause_after_chunks if faults is not None else None
        self._pause_s = faults.pause_s if faults is not None else 0.0
        self._watch = watch
        self._events = 0
        self.started = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True
        self._engine.note_status(status)
        self._engine.update(self._record, status=status, headers_at=time.monotonic())

    async def body(self, data: bytes, more: bool) -> None:
        if data and self._record.first_byte_at is None:
            self._engine.update(self._record, first_byte_at=time.monotonic())
        await self._send({"type": "http.response.body", "body": data, "more_body": more})
        if not more:
            self._engine.update(self._record, completed=True, finished_at=time.monotonic())

    async def event(self, data: bytes) -> None:
        """One SSE write; drops the connection instead once `drop_after_chunks` events went out."""
        if self._drop_after is not None and self._events >= self._drop_after:
            self._engine.update(self._record, fault="drop_after_chunks")
            raise _DropConnection
        if self._reset_after is not None and self._events >= self._reset_after:
            self._engine.update(self._record, fault="reset_after_chunks")
            await asyncio.sleep(RESET_PAUSE_S)  # the events sent are read before the reset discards them
            _reset(self._send)
            raise _DropConnection
        if self._stall_after is not None and self._events >= self._stall_after and self._watch is not None:
            self._engine.update(self._record, fault="stall_after_chunks")
            await self._watch.until_disconnected()
        if self._pause_after is not None and self._events == self._pause_after:
            self._pause_after = None  # once
            self._engine.update(self._record, fault="pause_after_chunks")
            await (self._watch.sleep(self._pause_s) if self._watch is not None else asyncio.sleep(self._pause_s))
        if self._error_after is not None and self._events >= self._error_after:
            self._engine.update(self._record, fault="error_after_chunks")
            if self.anthropic:  # vLLM 0.32's Messages layer: vllm/entrypoints/anthropic/serving.py
                # `message_stream_converter`, `except Exception`: an `error` event, and the stream ends
                event = b"event: error\ndata: " + orjson.dumps(
                    {"type": "error", "error": {"type": "internal_error",
                                                "message": "Simulated failure mid-generation."}}) + b"\n\n"
            else:
                event = self._engine.dialect.stream_error("Simulated failure mid-generation.", "InternalServerError",
                                                          500) + r.SSE_DONE
            await self.body(event, more=True)
            await self.body(b"", more=False)
            raise _DropConnection
        self._events += 1
        await self.body(data, more=True)

    async def end_stream(self) -> None:
        if not self.anthropic:
            await self.event(r.SSE_DONE)
        await self.body(b"", more=False)

    async def reply(self, reply: ErrorReply, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.anthropic and reply.status >= 400 and not reply.app_wide:
            reply = _anthropic_error(reply)
        headers = [*JSON_HEADERS, (b"content-length", str(len(reply.body)).encode()), *(extra_headers or [])]
        await self.start(reply.status, headers)
        if self._cut_answer and reply.status == 200:
            self._engine.update(self._record, fault="cut_answer")
            await self.body(reply.body[:len(reply.body) // 2], more=True)
            raise _DropConnection
        await self.body(reply.body, more=False)


RESET_PAUSE_S = 0.05
"""How long a reset waits after the last event it lets out (a peer's kernel resets the connection
after the data it acknowledged; a reset discards what the client had not read yet)."""


def _reset(send: Send) -> None:
    """Reset the connection `send` writes to (uvicorn's: `send` is its request cycle's bound method,
    which holds the transport): `SO_LINGER` 0, then the transport aborted, so the kernel sends a RST."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _anthropic_error(reply: ErrorReply) -> ErrorReply:
    """An engine error in Anthropic's shape, with the engine's error type and message (a body that
    is not the engine's JSON error, a fault's own `fail_body`, is left as it is)."""
    try:
        data = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return reply
    inner = data.get("error") if isinstance(data, dict) else None
    inner = inner if isinstance(inner, dict) else data
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return reply
    return replace(reply, body=a.error_body(str(inner.get("type") or "BadRequestError"), inner["message"]))


async def read_recorded(engine: SimWorkerState, scope: Scope,
                        receive: Receive) -> tuple[Any, SimRequestRecord] | None:
    """Read a request's body (its JSON, else its text as sent) and open its record; None when the
    client left before sending it all."""
    raw = await read_body(receive)
    if raw is None:
        return None
    try:
        body: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = raw.decode("utf-8", errors="replace")
    return body, engine.new_record(scope["path"], lower_headers(scope), body)


async def request_faults(engine: SimWorkerState, record: SimRequestRecord, send: Send, body: Any,
                         anthropic: bool = False) -> tuple[SimFaults, bool] | None:
    """`SimWorkerState.effective_faults` of a JSON object `body` (its `x_sim_faults` over the
    worker's); None once the engine's 400 went out instead: a body that is no object, or an
    `x_sim_faults` that is no SimFaults (in Anthropic's error shape with `anthropic`)."""
    dialect = engine.dialect
    if not isinstance(body, dict):
        await _Responder(send, engine, record, None, anthropic).reply(dialect.bad_request("Invalid JSON body."))
        return None
    try:
        override = SimFaults.model_validate(body["x_sim_faults"]) if "x_sim_faults" in body else None
    except ValidationError as exc:
        await _Responder(send, engine, record, None, anthropic).reply(
            dialect.bad_request(f"Invalid x_sim_faults: {exc}"))
        return None
    return engine.effective_faults(override)


async def handle_generation(engine: SimWorkerState, kind: r.Kind, scope: Scope, receive: Receive,
                            send: Send, anthropic: str | None = None) -> None:
    """Serve one chat or text completion request (ASGI level); with `anthropic` ("messages" or
    "count_tokens") an Anthropic Messages API request, served as its chat request (`kind` "chat")."""
    read = await read_recorded(engine, scope, receive)
    if read is None:
        return
    body, record = read
    try:
        async with DisconnectWatch(receive) as watch:
            try:
                await _serve(engine, kind, body, record, watch, send, scope, anthropic)
            except ClientDisconnected:
                engine.note_aborted()
                engine.update(record, aborted=True, finished_at=time.monotonic())
            except _DropConnection:
                engine.update(record, finished_at=time.monotonic())
    finally:
        engine.note_finished(record)


PooledAnswer = Callable[[SimWorkerState, dict[str, Any]], tuple[ErrorReply, int]]
"""A pooling API's answer to a JSON object body: (the reply, its prompt tokens), `gateway.sim.pooling`.
Raises FieldValidationError, PromptError."""


async def handle_pooled(engine: SimWorkerState, answer: PooledAnswer, scope: Scope, receive: Receive,
                        send: Send) -> None:
    """Serve one request of a pooling API (embeddings, rerank, score; ASGI level): recorded like a
    generation request, the same faults before it is read (`_refused_up_front`: hangs, `fail_status`,
    an unknown model), `ttft_s` for its forward pass, then `answer`'s JSON in one piece (or half of
    it with `cut_answer`). A body that is no JSON object is the engine's 400; `answer`'s
    FieldValidationError its validation error, a PromptError its 400."""
    read = await read_recorded(engine, scope, receive)
    if read is None:
        return
    body, record = read
    async with DisconnectWatch(receive) as watch:
        try:
            dialect = engine.dialect
            found = await request_faults(engine, record, send, body)
            if found is None:
                return
            faults, fail = found
            responder = _Responder(send, engine, record, None, cut_answer=faults.cut_answer)
            if await _refused_up_front(engine, record, responder, watch, faults, fail, body.get("model")):
                return
            try:
                reply, tokens = answer(engine, body)
            except FieldValidationError as exc:
                await responder.reply(dialect.validation_error(exc))
                return
            except PromptError as exc:
                await responder.reply(dialect.bad_request(str(exc)))
                return
            engine.update(record, prompt_tokens=tokens)
            await watch.sleep(engine.config.ttft_s)
            await responder.reply(reply)
        except ClientDisconnected:
            engine.note_aborted()
            engine.update(record, aborted=True, finished_at=time.monotonic())
        except _DropConnection:
            engine.update(record, finished_at=time.monotonic())


async def _serve(engine: SimWorkerState, kind: r.Kind, body: Any, record: SimRequestRecord,
                 watch: DisconnectWatch, send: Send, scope: Scope, anthropic: str | None = None) -> None:
    dialect = engine.dialect
    found = await request_faults(engine, record, send, body, bool(anthropic))
    if found is None:
        return
    faults, fail = found
    stream = body.get("stream") is True and anthropic != "count_tokens"
    engine.update(record, stream=stream)
    responder = _Responder(send, engine, record, faults.drop_after_chunks if stream else None, bool(anthropic),
                           faults if stream else None, watch, faults.cut_answer and not stream)

    if await _refused_up_front(engine, record, responder, watch, faults, fail, body.get("model")):
        return
    if faults.null_max_tokens_500 and kind == "text" and "max_tokens" in body and body["max_tokens"] is None:
        engine.update(record, fault="null_max_tokens_500")
        await responder.reply(dialect.error(NULL_MAX_TOKENS_MESSAGE, "InternalServerError", 500))
        return
    step = sc.next_step(engine.script, "messages", body) if anthropic == "messages" else None
    vllm = engine.config.engine in VLLM_FAMILY
    schema = so.messages_format(body) if anthropic == "messages" and vllm else None
    try:
        if anthropic is not None:
            body = _as_chat(body, anthropic == "messages", engine.config.engine == "sglang")
        elif kind == "chat" and vllm:
            schema = so.chat_format(body)
        plan = _plan(engine, kind, body, stream)
    except FieldValidationError as exc:
        await responder.reply(dialect.validation_error(exc))
        return
    except so.ParameterError as exc:
        await responder.reply(dialect.bad_request(str(exc), exc.parameter))
        return
    except PromptError as exc:
        await responder.reply(dialect.bad_request(str(exc)))
        return
    refusal = None
    if kind == "chat":
        refusal = (ct.check_tools(body, engine.config, dialect) if vllm
                   else ct.check_sglang_tools(body, dialect, anthropic is not None))
    if refusal is not None:
        await responder.reply(refusal)
        return
    if kind == "chat" and anthropic is None and not vllm:  # SGLang: its format's constraint, its own checks above
        try:
            schema = so.chat_format(body)
        except PromptError:
            schema = None
    engine.update(record, prompt_tokens=plan.total_prompt_tokens)
    if anthropic == "count_tokens":  # the engine's tokenizer count, nothing generated
        answer = a.count_tokens_answer(plan.total_prompt_tokens, engine.config.engine in VLLM_FAMILY)
        await responder.reply(ErrorReply(200, orjson.dumps(answer)))
        return
    if anthropic is not None:
        plan = replace(plan, anthropic=True, finish_reason="length")
    if step is not None:
        plan = replace(plan, script=step, output_tokens=sc.output_tokens(step[1]), finish_reason="stop")
    elif anthropic != "count_tokens":
        plan = _fixed_plan(engine, plan, body, schema, anthropic is not None)
    for tokens in plan.prompt_tokens:
        error = dialect.check_context(tokens, requested_output_tokens(body, kind == "chat"),
                                      engine.config.max_context_tokens, stream,
                                      requested_output_field(body, kind == "chat"))
        if error is not None:
            await _reply_context_error(responder, error)
            return
    sampling_error = check_sampling(engine.config.engine, dialect, body)  # vLLM: once the prompt fits
    if sampling_error is not None:
        await responder.reply(sampling_error)
        return
    running_id = None
    if engine.config.engine in VLLM_FAMILY:  # vLLM refuses an id already running (gateway/sim/request_ids.py)
        running_id = engine_request_id(kind, record.headers, body)
        if not engine.running_ids.claim(running_id):
            await _reply_context_error(responder, already_running(dialect.error, running_id,
                                                                  stream and anthropic is None))
            return
    try:
        keys = engine.prompt_keys(kind, body, plan.prompt_tokens, engine.cache_partition(body, anthropic is not None))
        plan = replace(plan, keys=tuple(keys))
        if engine.pd is not None:
            leg = PdLeg.start(engine, record, kind, body, len(plan.prompt_tokens), scope)
            if isinstance(leg, ErrorReply):
                await responder.reply(leg)
                return
            leg.keys = plan.keys
            if leg.sglang_prefill:  # SGLang's prefill worker stops after the first token
                plan = replace(plan, output_tokens=min(plan.output_tokens, 1))
            plan = replace(plan, leg=leg)
        await _run_admitted(engine, plan, record, responder, watch, faults)
    finally:
        if running_id is not None:
            engine.running_ids.release(running_id)


async def _refused_up_front(engine: SimWorkerState, record: SimRequestRecord, responder: _Responder,
                            watch: DisconnectWatch, faults: SimFaults, fail: bool, model: Any) -> bool:
    """The steps every generation API takes before reading its request: a hang or black-hole fault
    waits for the client to leave, a `fail_status` fault answers its error, and an unknown model
    gets the engine's 404. True when the request was answered (or abandoned) here."""
    if faults.hang_before_headers or faults.black_hole:
        engine.update(record, fault="black_hole" if faults.black_hole else "hang_before_headers")
        await watch.until_disconnected()
    if fail:
        await _fail(engine, record, responder, faults)
        return True
    error = engine.dialect.check_model(model, engine.model_names(), engine.config.served_model_names)
    if error is not None:
        await responder.reply(error)
        return True
    return False


async def _fail(engine: SimWorkerState, record: SimRequestRecord, responder: _Responder, faults: SimFaults) -> None:
    status = faults.fail_status or 500
    engine.update(record, fault="fail_status")
    if faults.fail_body is not None:
        reply = ErrorReply(status, faults.fail_body.encode("utf-8"))
    else:
        err_type = _FAULT_TYPES.get(status, "InternalServerError")
        reply = engine.dialect.error(f"Simulated failure (HTTP {status}).", err_type, status)
    extra = [(b"retry-after", str(faults.retry_after_s).encode())] if faults.retry_after_s is not None else []
    extra += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (faults.fail_headers or {}).items()]
    await responder.reply(reply, extra)


async def _reply_context_error(responder: _Responder, error: ErrorReply) -> None:
    if not error.in_band_stream:
        await responder.reply(error)
        return
    await responder.start(200, SSE_HEADERS)
    await responder.event(error.stream_event)
    await responder.end_stream()


def _as_chat(body: dict[str, Any], needs_max_tokens: bool, sglang: bool) -> dict[str, Any]:
    """An Anthropic request as the chat request the engine serves it as, with `max_tokens` as the
    integer the engine's `AnthropicMessagesRequest` read (5.0 is 5). Raises PromptError (400), and
    FieldValidationError for a Messages `max_tokens` that model refuses: missing ("Field
    required"), not an integer (5.5) or not positive."""
    max_tokens = messages_max_tokens(body) if needs_max_tokens else None
    # vLLM's and SGLang's AnthropicMessagesRequest build their chat request from Anthropic's own
    # fields only: sampling extras such as `min_tokens` / `ignore_eos` do not reach the sampler.
    chat = {k: v for k, v in body.items()
            if k not in ("system", "stream", "min_tokens", "ignore_eos", "tools", "tool_choice")}
    chat["messages"] = a.chat_messages(body, sglang)
    chat.update(ct.from_anthropic(body))
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    return chat


def _fixed_plan(engine: SimWorkerState, plan: _Plan, body: dict[str, Any], schema: Any, messages: bool) -> _Plan:
    """`plan` with the fixed answer `chat_tools.fixed_answer` finds (chat: a scripted step, a forced call
    or a structured answer; Messages, whose script was read before: a forced call or a structured
    answer), cut by the output limit as any answer is (a Messages tool call is sent whole, as a scripted
    one is); `plan` itself when there is none."""
    script = sc.SimScript() if messages else engine.script
    fixed = ct.fixed_answer(script, body, schema, engine.config)
    if fixed is None:
        return plan
    index, step, finish = fixed
    total = sc.output_tokens(step) if messages else len(ct.tokens(step))
    room = engine.config.max_context_tokens - plan.total_prompt_tokens
    count, why = generated_count(body, requested_output_tokens(body, True), total, room, total)
    if messages and not step.tool_calls:
        step = sc.cut_text(step, count)  # a Messages answer holds what was generated
    # an empty `content` is "": vLLM's with a forced choice (`content or ""`), SGLang's always (its
    # serving_chat.py `_build_chat_response`: `text if text else ""`)
    empty_text = engine.config.engine == "sglang" or ct.forced_call(body) is not None
    return replace(plan, script=(index, step), output_tokens=count, forced=empty_text,
                   finish_reason=finish if why == "stop" else "length")


def _plan(engine: SimWorkerState, kind: r.Kind, body: dict[str, Any], stream: bool) -> _Plan:
    config = engine.config
    start = 0
    if kind == "chat":
        messages = body.get("messages")
        held = continued_tokens(body, config.engine) if isinstance(body, dict) else None
        if held is not None and isinstance(messages, list) and len(messages) > 1:
            # The prompt is the turns before it plus the tokens of the answer's start.
            start, prompt_tokens = held, [chat_prompt_tokens(messages[:-1], config) + held]
        else:
            start, prompt_tokens = held or 0, [chat_prompt_tokens(messages, config)]
        prompt_tokens = [prompt_tokens[0] + tools_tokens(body.get("tools"), config)]
        if (ids := pretokenized_chat_prompt(body, config.engine)) is not None:  # no template rendered
            start, prompt_tokens = 0, [ids]
    else:
        prompt_tokens = completion_prompt_tokens(body.get("prompt"), config)
        start = completion_continued_tokens(body.get("prompt"))
        if start:  # the prompt's own text, then the tokens of the answer it ends with
            prompt = body["prompt"]
            answer = output_text(start).encode("utf-8")
            prompt_tokens = [text_tokens(len(prompt.encode("utf-8")) - len(answer), config.bytes_per_token) + start]
    requested = requested_output_tokens(body, kind == "chat")
    eos_after, natural = config.eos_after_tokens, config.default_output_tokens
    output_tokens, finish_reason = generated_count(body, requested,
                                                   None if natural is None else max(natural - start, 0),
                                                   config.output_room(max(prompt_tokens, default=0)),
                                                   None if eos_after is None else max(eos_after - start, 0))
    return _Plan(kind, stream, prompt_tokens, output_tokens, finish_reason, r.StreamFormat.from_body(body),
                 start=start, model=engine.answer_model(body.get("model")))


async def _run_admitted(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                        watch: DisconnectWatch, faults: SimFaults) -> None:
    """Queue for admission, then generate; keeps the running/waiting gauges right on every exit."""
    active: ActiveRequest
    if engine.stepper is not None:  # admitted by the scheduler loop once `_prefill` queues it
        active = engine.new_step_request(plan.total_prompt_tokens, plan.keys, len(plan.prompt_tokens),
                                         plan.output_tokens)
    else:
        admitted = engine.try_admit(plan.total_prompt_tokens, plan.keys)
        if admitted is None:
            admitted = await watch.run(engine.admit(plan.total_prompt_tokens, plan.keys))
        active = admitted
        engine.update(record, cached_tokens=active.cached_tokens, prefill_tokens=active.prefill_tokens,
                      admitted_at=active.admitted_at)
    reason = "abort"
    try:
        if plan.anthropic and not (plan.stream and faults.raw_stream_chunks is not None):  # raw: streams only
            await (_anthropic_sse if plan.stream else _anthropic_json)(engine, plan, record, responder, watch,
                                                                        active)
        elif not plan.stream:
            await _generate_json(engine, plan, record, responder, watch, active)
        elif faults.raw_stream_chunks is not None:
            await _generate_raw(engine, plan, record, responder, watch, active, faults)
        else:
            await _generate_sse(engine, plan, record, responder, watch, active)
        reason = plan.finish_reason
    except PdFailure as exc:
        await _reply_pd_failure(engine, record, responder, exc)
    finally:
        engine.stop_running(active, reason)
        if plan.leg is not None:
            plan.leg.finish()


async def _reply_pd_failure(engine: SimWorkerState, record: SimRequestRecord, responder: _Responder,
                            exc: PdFailure) -> None:
    """HTTP 500 with the engine's message, or an SSE error event once the stream has begun."""
    engine.update(record, pd_failure=exc.kind)
    reply = engine.dialect.error(exc.message, "InternalServerError", 500)
    if not responder.started:
        await responder.reply(reply)
        return
    await responder.event(engine.dialect.stream_error(exc.message, "InternalServerError", 500))
    await responder.end_stream()


async def _prefill(engine: SimWorkerState, watch: DisconnectWatch, active: ActiveRequest,
                   leg: PdLeg | None = None, record: SimRequestRecord | None = None) -> None:
    """Sleep for the modelled time to first token, then cache the prompt's blocks. A PD leg
    first waits for its hand-over; KV received from a prefill worker is not computed again. A
    `StepRequest` waits `ttft_s` (the API server's share), then for the scheduler's prefill; its PD
    transfer happens before admission, so it does not subtract this worker's own prefix cache."""
    if isinstance(active, StepRequest):
        await watch.sleep(engine.config.ttft_s)
        remote = await leg.before_prefill(watch, active) if leg is not None else 0
        await watch.run(engine.run_stepped_prefill(active, remote))
        if record is not None:
            engine.update(record, cached_tokens=active.cached_tokens, prefill_tokens=active.prefill_tokens,
                          admitted_at=active.admitted_at)
        if leg is not None:
            leg.after_prefill(active)
        return
    if leg is None:
        await watch.sleep(engine.prefill_seconds(active))
    else:
        remote = await leg.before_prefill(watch, active)
        rate = engine.config.prefill_tokens_per_s
        local = max(0, active.prefill_tokens - remote)
        await watch.sleep(engine.config.ttft_s + (local / rate if rate is not None else 0.0))
    engine.finish_prefill(active)
    if leg is not None:
        leg.after_prefill(active)


async def _next_token(engine: SimWorkerState, watch: DisconnectWatch, active: ActiveRequest, i: int,
                      tokens: int, pause_first_only: bool = False) -> None:
    """Wait until output token `i` (0-based) of `active` exists. Per-request timing: sleep the decode
    time before every token but the first (`pause_first_only`: even a zero one, which still yields
    so a disconnect is noticed; else only with `tpot_s` > 0), then count `tokens` generated.
    Stepped: wait for the scheduler's step `i` + 1 (which counts the tokens)."""
    if isinstance(active, StepRequest):
        if active.steps < i + 1:
            await watch.run(active.wait_steps(i + 1))
        return
    if i > 0 and (pause_first_only or engine.config.tpot_s > 0):
        await watch.sleep(engine.decode_seconds())
    if tokens:
        engine.note_generated(active, tokens)


async def _generate_json(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                         watch: DisconnectWatch, active: ActiveRequest) -> None:
    config = engine.config
    await _prefill(engine, watch, active, plan.leg, record)
    n_prompts = len(plan.prompt_tokens)
    for i in range(plan.output_tokens):
        await _next_token(engine, watch, active, i, n_prompts)
    completion_tokens = plan.output_tokens * n_prompts
    meta = r.ResponseMeta.new(plan.kind, plan.model or config.model_name, engine.answer_shape)
    text = output_text(plan.output_tokens, plan.start)
    if plan.kind == "chat":
        payload = r.chat_completion(meta, text, plan.finish_reason, plan.total_prompt_tokens, completion_tokens,
                                    active.cached_tokens, active.created_cache_tokens(config.kv_block_tokens))
        if plan.script is not None:
            payload["choices"][0]["message"].update(ct.message_fields(plan.script, plan.output_tokens, plan.forced))
    else:
        payload = r.text_completion(meta, [text] * n_prompts, plan.finish_reason, plan.total_prompt_tokens,
                                    completion_tokens, active.cached_tokens)
    if config.engine == "sglang":
        payload["usage"] = sg.usage(plan.total_prompt_tokens, completion_tokens, active.cached_tokens,
                                    config.enable_cache_report)
    if plan.leg is not None:
        payload.update(plan.leg.response_fields(active))
    engine.update(record, completion_tokens_sent=completion_tokens)
    await responder.reply(ErrorReply(200, orjson.dumps(payload)))


async def _generate_sse(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                        watch: DisconnectWatch, active: ActiveRequest) -> None:
    config = engine.config
    meta = r.ResponseMeta.new(plan.kind, plan.model or config.model_name, engine.answer_shape)
    if not config.stream_headers_after_prefill:
        await responder.start(200, SSE_HEADERS)
    await _prefill(engine, watch, active, plan.leg, record)
    if config.stream_headers_after_prefill:
        await responder.start(200, SSE_HEADERS)
    prompt_total, cached = plan.total_prompt_tokens, active.cached_tokens
    if plan.kind == "chat":
        await responder.event(r.sse_event(r.role_chunk(meta, plan.fmt, prompt_tokens=prompt_total,
                                                       cached_tokens=cached)))
    sent = 0
    steps = max(plan.output_tokens, 1)
    stepped = isinstance(active, StepRequest)
    interval = config.stream_interval if plan.script is None else 1
    text = ""
    for i in range(steps):
        if plan.output_tokens > 0 or not stepped:
            await _next_token(engine, watch, active, i, 0, pause_first_only=True)
        last = i == steps - 1
        text += output_token(plan.start + i) if plan.output_tokens > 0 else ""
        if plan.output_tokens > 0 and not stepped:
            for _ in plan.prompt_tokens:
                engine.note_generated(active)
        if not last and (i + 1) % interval:
            continue  # held for the next chunk (`SimConfig.stream_interval`)
        held = (i % interval) + 1 if plan.output_tokens > 0 else 0
        for index in range(len(plan.prompt_tokens)):
            sent += held
            chunk = r.token_chunk(meta, plan.fmt, text, index=index,
                                  finish_reason=plan.finish_reason if last else None,
                                  prompt_tokens=prompt_total, completion_tokens=sent, cached_tokens=cached)
            if plan.script is not None and plan.kind == "chat" and plan.output_tokens > 0:
                chunk["choices"][0]["delta"] = ct.delta(plan.script, i)
            await responder.event(r.sse_event(chunk))
            engine.update(record, completion_tokens_sent=sent)
        text = ""
    if plan.fmt.include_usage:
        chunk = r.usage_chunk(meta, prompt_total, sent, cached, active.created_cache_tokens(config.kv_block_tokens))
        if config.engine == "sglang":
            chunk["usage"] = sg.usage(prompt_total, sent, cached, config.enable_cache_report)
        await responder.event(r.sse_event(chunk))
    await responder.end_stream()


async def _anthropic_json(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                          watch: DisconnectWatch, active: ActiveRequest) -> None:
    """A Messages answer as one `message` object, after the whole generation."""
    config = engine.config
    await _prefill(engine, watch, active, plan.leg, record)
    for i in range(plan.output_tokens):
        await _next_token(engine, watch, active, i, 1)
    shapes = a.usage_shapes(config.messages_usage_mode, plan.total_prompt_tokens, plan.output_tokens,
                            active.cached_tokens, active.created_cache_tokens(config.kv_block_tokens))
    payload = a.message(a.message_id(), config.model_name, output_text(plan.output_tokens), plan.finish_reason,
                        shapes.answer)
    if plan.script is not None:
        payload.update(content=sc.messages_content(plan.script), stop_reason=_stop_reason(plan))
    engine.update(record, completion_tokens_sent=plan.output_tokens)
    await responder.reply(ErrorReply(200, orjson.dumps(payload)))


async def _anthropic_sse(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                         watch: DisconnectWatch, active: ActiveRequest) -> None:
    """A streamed Messages answer: the engine's Anthropic events in their order
    (`gateway.sim.anthropic`), one `text_delta` per token."""
    config = engine.config
    if not config.stream_headers_after_prefill:
        await responder.start(200, SSE_HEADERS)
    await _prefill(engine, watch, active, plan.leg, record)
    if config.stream_headers_after_prefill:
        await responder.start(200, SSE_HEADERS)
    shapes = a.usage_shapes(config.messages_usage_mode, plan.total_prompt_tokens, plan.output_tokens,
                            active.cached_tokens, active.created_cache_tokens(config.kv_block_tokens))
    mid = a.message_id()
    await responder.event(a.message_start(mid, config.model_name, shapes.start))
    if plan.script is not None:
        await _scripted_messages_sse(engine, plan, plan.script, record, responder, watch, active)
        return
    for i in range(plan.output_tokens):
        await _next_token(engine, watch, active, i, 1, pause_first_only=True)
        if i == 0:
            await responder.event(a.block_start())
        await responder.event(a.text_delta(output_token(i)))
        engine.update(record, completion_tokens_sent=i + 1)
    if plan.output_tokens == 0:
        await responder.event(a.block_start())
    for chunk in a.stream_end(plan.finish_reason, shapes, mid, config.model_name,
                              output_text(plan.output_tokens) if shapes.stop is not None else ""):
        await responder.event(chunk)
    await responder.end_stream()


def _stop_reason(plan: _Plan) -> str:
    """A fixed Messages answer's `stop_reason`: `max_tokens` when the limit cut it, else the step's
    (vllm/entrypoints/anthropic/serving.py `_to_anthropic_stop_reason`: "length" wins, a tool call is
    `tool_use` even for a named choice's "stop")."""
    assert plan.script is not None
    return "max_tokens" if plan.finish_reason == "length" else sc.stop_reason(plan.script[1])


async def _scripted_messages_sse(engine: SimWorkerState, plan: _Plan, step: tuple[int, ScriptStep],
                                 record: SimRequestRecord, responder: _Responder, watch: DisconnectWatch,
                                 active: ActiveRequest) -> None:
    """The rest of a scripted Messages stream (after `message_start`): the step's content events,
    each delta one decoded token, then `message_delta` (`tool_use` / `end_turn`) and `message_stop`."""
    sent = 0
    for chunk in sc.messages_events(step):
        if chunk.startswith(b"event: content_block_delta\n"):
            await _next_token(engine, watch, active, sent, 1, pause_first_only=True)
            sent += 1
            engine.update(record, completion_tokens_sent=sent)
        await responder.event(chunk)
    shapes = a.usage_shapes(engine.config.messages_usage_mode, plan.total_prompt_tokens, sent, active.cached_tokens,
                            active.created_cache_tokens(engine.config.kv_block_tokens))
    await responder.event(a.event({"type": "message_delta", "delta": {"stop_reason": _stop_reason(plan),
                                                                      "stop_sequence": None},
                                   "usage": shapes.delta if shapes.delta is not None else shapes.answer}))
    await responder.event(a.event({"type": "message_stop"}))
    await responder.end_stream()


async def _generate_raw(engine: SimWorkerState, plan: _Plan, record: SimRequestRecord, responder: _Responder,
                        watch: DisconnectWatch, active: ActiveRequest, faults: SimFaults) -> None:
    """Send exactly the configured bytes, one write per chunk, ~20 ms apart."""
    engine.update(record, fault="raw_stream_chunks")
    await responder.start(200, SSE_HEADERS)
    await _prefill(engine, watch, active, plan.leg, record)
    chunks = faults.raw_chunk_bytes() or []
    for i, chunk in enumerate(chunks):
        if i > 0:
            await watch.sleep(RAW_CHUNK_PAUSE_S)
        await responder.event(chunk)
    await responder.body(b"", more=False)
