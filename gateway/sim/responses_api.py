"""The simulator's OpenAI Responses API, as vLLM serves it (entrypoints/openai/serving_responses.py and
its router), with the stored responses vLLM keeps with `VLLM_ENABLE_RESPONSES_API_STORE=1`:

    POST /v1/responses                 JSON `response` object, or typed SSE events (`event: <type>`
                                       + `data: <json>`, `sequence_number` from 0, no `[DONE]`):
                                       response.created, response.in_progress, response.output_item.added,
                                       response.content_part.added, response.output_text.delta (one per
                                       token), response.output_text.done, response.content_part.done,
                                       response.output_item.done, response.completed (with the usage,
                                       `_usage`). A response stopped by its limit is `incomplete`
                                       (`_final_status`). With `background` (which needs `store`): the
                                       response stored `queued` at once and generated in a task
                                       (`ResponsesServer._background`); streamed, its events as they come.
    GET /v1/responses/{id}             the stored response; with `?stream=true` (and `starting_after=N`)
                                       the SSE events of a background stream from sequence number
                                       N + 1, the stored ones one per `tpot_s`, the rest as they are
                                       generated; for any other response the 200 and its headers, then
                                       a broken connection, as vLLM 0.32 answers (`_replay`). Each
                                       replay is recorded in `ResponsesServer.replays` (events sent,
                                       ended by the client).
                                       The worker's global stream faults apply to it
                                       (`drop_after_chunks`, `reset_after_chunks`,
                                       `stall_after_chunks`, `error_after_chunks`: `_replay`)
    DELETE /v1/responses/{id}          FastAPI's 405 `{"detail": "Method Not Allowed"}` (`allow: GET`), as
                                       vLLM 0.32 answers: its router has no DELETE route
                                       (`vllm/entrypoints/openai/responses/api_router.py`) and its
                                       HTTPException handler is registered for FastAPI's subclass, not
                                       the Starlette one the router raises
                                       (`vllm/entrypoints/serve/exception_handling/register.py`); with
                                       `SimConfig.responses_delete`, OpenAI's
                                       `{"id", "object": "response", "deleted": true}`
    POST /v1/responses/{id}/cancel     a queued background response: `cancelled`, its generation aborted;
                                       any other: 400 "Cannot cancel a synchronous response." (`_cancel`)

A response's id is the body's `request_id` when it has one, else `resp_` + a uuid, as vLLM's
`ResponsesRequest.request_id` (`vllm/entrypoints/openai/protocol.py`) becomes the response id and
the store's key (`serving_responses.py`): a second request with that id stores over the first. A
request whose id is running already is refused as vLLM's engine refuses it
(`gateway/sim/request_ids.py`).

Stored responses live in this process's memory (`ResponsesServer.stored`), keyed by id: the input
messages and the output text. `previous_response_id` prepends that conversation (instructions, stored
messages, the stored answer as an assistant message) to the new input, as vLLM's
`_construct_input_messages` does, so the prompt and its prefix-cache blocks include the history. An
unknown id is a 404 in vLLM's shape: `Response with id '…' not found.`, param `response_id`.
Context: vLLM 0.32 refuses a `max_output_tokens` over max_model_len and a prompt over it in its
renderer's words (as for chat, `dialects.vllm_context_error`), a prompt of exactly max_model_len with
`The engine prompt length N exceeds the max_model_len M.` (`_validate_generator_input`,
vllm/entrypoints/openai/responses/serving.py), and clamps the output to the room left
(`get_max_tokens`); the SGLang dialect refuses prompt + output over its context as for chat. vLLM's
sampling-parameter checks come next (`gateway.sim.sampling`). Prompt tokens, admission,
prefill, decode pacing, the prefix cache, disconnect → abort and the faults (`fail_status`,
`hang_before_headers`, `black_hole`, `drop_after_chunks`, `raw_stream_chunks`, global or per request in
`x_sim_faults`) are chat's (`generation.py`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import orjson

from gateway.sim import script as sc
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
    send_bytes,
    send_json,
)
from gateway.sim.config import SimFaults
from gateway.sim.dialects import ErrorReply
from gateway.sim.generation import (
    RAW_CHUNK_PAUSE_S,
    RESET_PAUSE_S,
    _DropConnection,
    _refused_up_front,
    _reset,
    _Responder,
    read_recorded,
    request_faults,
)
from gateway.sim.request_ids import VLLM_FAMILY, already_running, engine_request_id
from gateway.sim.sampling import check_sampling
from gateway.sim.script import ScriptStep
from gateway.sim.stepper import StepRequest
from gateway.sim.tokens import (
    FieldValidationError,
    PromptError,
    chat_prompt_tokens,
    generated_count,
    output_token,
    responses_output_limit,
)
from gateway.sim.worker_state import SimRequestRecord, SimWorkerState


@dataclass
class StoredResponse:
    """One stored response: the conversation it answered (chat messages) and its answer object.

    A background response is stored from its start (status `queued`) and runs in `task`; a background
    stream also keeps its SSE `events` as they are generated (vLLM's `event_store`), which `notify`
    announces to the streams that follow it. Only such a response can be replayed."""

    messages: list[dict[str, Any]]
    text: str
    response: dict[str, Any]
    events: list[bytes] = field(default_factory=list)  # a background stream's SSE events, in order
    background: bool = False
    live: bool = False  # a background stream: `events` is its replay
    done: bool = True  # False while a background response generates
    task: asyncio.Task[None] | None = None
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake the streams waiting for this response's next event (or its end)."""
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def next_change(self, seen: int) -> None:
        """Return once there are more than `seen` events or the response is done."""
        while len(self.events) <= seen and not self.done:
            await self._tick.wait()


@dataclass
class Replay:
    """One `GET ?stream=true` replay: events sent so far; `aborted` when the client hung up before its end."""

    response_id: str
    sent: int = 0
    aborted: bool = False
    completed: bool = False
    fault: bool = False  # a stream fault ended it (`ResponsesServer._replay`)


@dataclass
class ResponsesServer:
    """The Responses API of one simulated engine; `stored` is its in-memory response store,
    `replays` the stream replays served, in order."""

    engine: SimWorkerState
    stored: dict[str, StoredResponse] = field(default_factory=dict)
    replays: list[Replay] = field(default_factory=list)

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/responses."""
        engine = self.engine
        read = await read_recorded(engine, scope, receive)
        if read is None:
            return
        body, record = read
        async with DisconnectWatch(receive) as watch:
            try:
                await self._serve(body, record, watch, send)
            except ClientDisconnected:
                engine.note_aborted()
                engine.update(record, aborted=True, finished_at=time.monotonic())
            except _DropConnection:
                engine.update(record, finished_at=time.monotonic())

    async def by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET/DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel."""
        rest = scope["path"][len("/v1/responses/"):].rstrip("/")
        response_id, _, action = rest.partition("/")
        method = scope["method"]
        if (action, method) not in (("", "GET"), ("", "DELETE"), ("cancel", "POST")):
            await send_json(send, 405 if action in ("", "cancel") else 404,
                            {"detail": "Method Not Allowed" if action in ("", "cancel") else "Not Found"})
            return
        stored = self.stored.get(response_id)
        if method == "DELETE" and not self.engine.config.responses_delete:  # no route: whatever the id
            await send_bytes(send, 405, orjson.dumps({"detail": "Method Not Allowed"}),
                             [*JSON_HEADERS, (b"allow", b"GET")])
        elif stored is None:
            reply = self._not_found(response_id)
            await send_json(send, reply.status, orjson.loads(reply.body))
        elif method == "GET" and _query(scope, "stream") == "true":
            await self._replay(response_id, stored, _query(scope, "starting_after"), receive, send)
        elif method == "GET":
            await send_json(send, 200, stored.response)
        elif method == "DELETE":
            del self.stored[response_id]
            await send_json(send, 200, {"id": response_id, "object": "response", "deleted": True})
        else:
            await self._cancel(stored, send)

    async def _cancel(self, stored: StoredResponse, send: Send) -> None:
        """POST …/cancel (vLLM 0.32 `cancel_responses`, `vllm/entrypoints/openai/responses/serving.py`): a
        response not `queued` or `in_progress` is refused (400 "Cannot cancel a synchronous response.",
        param `response_id`); else its status becomes `cancelled`, its generation is aborted, and the
        answer is the stored response (as it was when queued: no output, no usage), which stays so."""
        if stored.response.get("status") not in ("queued", "in_progress"):
            reply = self.engine.dialect.error("Cannot cancel a synchronous response.", "invalid_request_error", 400,
                                              "response_id")
            await send_json(send, 400, orjson.loads(reply.body))
            return
        stored.response = {**stored.response, "status": "cancelled"}
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        await send_json(send, 200, stored.response)

    async def _replay(self, response_id: str, stored: StoredResponse, starting_after: str | None,
                      receive: Receive, send: Send) -> None:
        """GET ?stream=true: the events of a background stream after sequence number `starting_after`
        (-1 if absent), one per `tpot_s` seconds, then those still to come as they are generated; a
        client's hang-up ends it (`Replay.aborted`). Any other response has no events to replay: vLLM
        0.32's replay generator raises for it after the 200 and its SSE headers went out
        (`responses_background_stream_generator`; Starlette's `StreamingResponse` sends the headers
        before the first item), so the connection breaks without a body; the simulator answers the
        same. A background stream cancelled meanwhile ends its replay without `response.completed`
        (vLLM's would wait forever). The worker's global
        stream faults apply after that many events, as on a generation's stream: `drop_after_chunks`
        (the body left unended), `reset_after_chunks` (a TCP reset), `stall_after_chunks` (silence
        until the client leaves), `error_after_chunks` (the Responses API's `error` event, the
        shape vLLM 0.32's `responses_stream_generator` turns a GenerationError into,
        `vllm/entrypoints/openai/responses/serving.py`, then the end)."""
        after = int(starting_after) if starting_after is not None and starting_after.lstrip("-").isdigit() else -1
        if not stored.live:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            return  # the body left unended: the server drops the connection
        replay = Replay(response_id)
        self.replays.append(replay)
        pause = self.engine.config.tpot_s
        faults = self.engine.faults
        async with DisconnectWatch(receive) as watch:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            try:
                index = max(after + 1, 0)
                while True:
                    await watch.run(stored.next_change(index))
                    if index >= len(stored.events):
                        break
                    if pause:
                        await watch.sleep(pause)
                    if await _replay_fault(faults, replay.sent, send, watch):
                        replay.fault = True
                        return
                    await send({"type": "http.response.body", "body": stored.events[index], "more_body": True})
                    replay.sent += 1
                    index += 1
            except ClientDisconnected:
                replay.aborted = True
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        replay.completed = True

    def _not_found(self, response_id: str) -> ErrorReply:
        """vLLM's `_make_not_found_error`: 404 `invalid_request_error`, param `response_id`."""
        return self.engine.dialect.error(f"Response with id '{response_id}' not found.", "invalid_request_error", 404,
                                         "response_id")

    async def _serve(self, body: Any, record: SimRequestRecord, watch: DisconnectWatch, send: Send) -> None:
        engine = self.engine
        dialect = engine.dialect
        stream = isinstance(body, dict) and body.get("stream") is True
        engine.update(record, stream=stream)
        found = await request_faults(engine, record, send, body)
        if found is None:
            return
        faults, fail = found
        responder = _Responder(send, engine, record, faults.drop_after_chunks if stream else None)
        if await _refused_up_front(engine, record, responder, watch, faults, fail, body.get("model")):
            return
        try:
            limit = responses_output_limit(body)
        except FieldValidationError as exc:
            await responder.reply(dialect.validation_error(exc))
            return
        if limit is not None and limit < 1:
            await responder.reply(dialect.bad_request("max_output_tokens must be a positive integer",
                                                      "max_output_tokens"))
            return
        previous = body.get("previous_response_id")
        prior: StoredResponse | None = None
        if previous is not None:
            prior = self.stored.get(previous) if isinstance(previous, str) else None
            if prior is None:
                await responder.reply(self._not_found(str(previous)))
                return
        try:
            messages = _input_messages(body, prior)
            prompt_tokens = chat_prompt_tokens(messages, engine.config)
        except PromptError as exc:
            await responder.reply(dialect.bad_request(str(exc), "input"))
            return
        background = body.get("background") is True
        if background and body.get("store", True) is False:  # vLLM's ResponsesRequest.validate_background
            await responder.reply(dialect.error("background can only be used when `store` is true", "Bad Request",
                                                400, "background"))
            return
        engine.update(record, prompt_tokens=prompt_tokens)
        max_context = engine.config.max_context_tokens
        if engine.config.engine == "sglang":
            error = dialect.check_context(prompt_tokens, limit, max_context, False)
        elif (error := dialect.check_context(prompt_tokens, limit, max_context, False, "max_output_tokens",
                                             generate=False)) is not None:
            pass  # vLLM's renderer: an output limit over the context, a prompt over it
        elif prompt_tokens >= max_context:  # vLLM's _validate_generator_input; it clamps the output instead
            error = dialect.error(f"The engine prompt length {prompt_tokens} exceeds the max_model_len "
                                  f"{max_context}. Please reduce prompt.", "invalid_request_error", 400, "input")
        else:
            error = check_sampling(engine.config.engine, dialect, body)  # vLLM's SamplingParams checks
        if error is not None:
            await responder.reply(error)
            return
        response_id = engine_request_id("responses", record.headers, body)  # the client's `request_id`, as vLLM
        if engine.config.engine in VLLM_FAMILY and not engine.running_ids.claim(response_id):
            await responder.reply(already_running(dialect.error, response_id, False))
            return
        if background:
            await self._background(body, record, watch, responder, faults, messages, prompt_tokens, limit, prior,
                                   stream, response_id)
            return
        try:
            await self._generate(body, record, watch, responder, faults, engine, messages, prompt_tokens, limit,
                                 prior, stream, response_id)
        finally:
            engine.running_ids.release(response_id)

    async def _background(self, body: dict[str, Any], record: SimRequestRecord, watch: DisconnectWatch,
                          responder: _Responder, faults: SimFaults, messages: list[dict[str, Any]],
                          prompt_tokens: int, limit: int | None, prior: StoredResponse | None, stream: bool,
                          response_id: str) -> None:
        """A background response (vLLM 0.32 `_create_responses`, `vllm/entrypoints/openai/responses/serving.py`):
        stored at once with status `queued`, no output and no usage, and generated in a task no client
        holds (`ResponsesServer.stored[id].task`; the finished response replaces the stored one unless it
        was cancelled). Without `stream` the answer is that queued response; with it, the generation's
        events as they come (`_run_background_request_stream` and `responses_background_stream_generator`),
        and a client that leaves does not stop the generation. The running request id is released when
        the task ends."""
        engine = self.engine
        queued = {**_response_object(body, engine.config.model_name, response_id), "status": "queued"}
        stored = StoredResponse(messages, "", queued, background=True, live=stream, done=False)
        self.stored[response_id] = stored
        stored.task = asyncio.get_running_loop().create_task(self._run_background(
            stored, body, record, faults, messages, prompt_tokens, limit, prior, stream, response_id))
        if not stream:
            await responder.reply(ErrorReply(200, orjson.dumps(queued)))
            return
        await responder.start(200, SSE_HEADERS)
        index = 0
        try:
            while True:
                await watch.run(stored.next_change(index))
                if index >= len(stored.events):
                    break
                await responder.event(stored.events[index])
                index += 1
        except ClientDisconnected:
            return  # the generation goes on
        await responder.body(b"", more=False)

    async def _run_background(self, stored: StoredResponse, body: dict[str, Any], record: SimRequestRecord,
                              faults: SimFaults, messages: list[dict[str, Any]], prompt_tokens: int,
                              limit: int | None, prior: StoredResponse | None, stream: bool,
                              response_id: str) -> None:
        """The generation of a background response, its answer unsent (`_Detached`); cancelled by
        …/cancel (an aborted request, as a client's disconnect aborts one)."""
        engine = self.engine
        try:
            async with DisconnectWatch(_never_disconnects) as watch:
                await self._generate(body, record, watch, _Detached(_discard, engine, record, None), faults, engine,
                                     messages, prompt_tokens, limit, prior, stream, response_id,
                                     stored if stream else None)
        except asyncio.CancelledError:
            engine.note_aborted()
            engine.update(record, aborted=True, finished_at=time.monotonic())
        except _DropConnection:
            engine.update(record, finished_at=time.monotonic())
        finally:
            engine.running_ids.release(response_id)
            stored.done = True
            stored.notify()

    def _store(self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]], text: str,
               final: dict[str, Any]) -> None:
        """Store a finished response unless the request said `store: false`; a background response
        updates its entry unless it was cancelled (vLLM's `responses_full_generator`)."""
        if body.get("store", True) is False:
            return
        current = self.stored.get(response_id)
        if current is not None and current.background and not current.done:
            if current.response.get("status") != "cancelled":
                current.messages, current.text, current.response = messages, text, final
            return
        self.stored[response_id] = StoredResponse(messages, text, final)

    async def _generate(self, body: dict[str, Any], record: SimRequestRecord, watch: DisconnectWatch,
                        responder: _Responder, faults: SimFaults, engine: SimWorkerState,
                        messages: list[dict[str, Any]],
                        prompt_tokens: int, limit: int | None, prior: StoredResponse | None, stream: bool,
                        response_id: str, live: StoredResponse | None = None) -> None:
        """Admission, prefill, the answer (JSON or events) and the store, for a request checked above;
        `live`: a background stream's entry, which keeps the events for its followers."""
        keys = engine.prompt_keys("chat", {"messages": messages}, [prompt_tokens], engine.cache_partition(body))
        step = sc.next_step(engine.script, "responses", body)
        # vLLM: min(max_output_tokens, max_model_len - prompt); SGLang's scheduler likewise
        room = engine.config.output_room(prompt_tokens)
        schema = so.responses_format(body) if step is None else None
        if schema is not None:  # a structured answer (`gateway.sim.structured`), cut by the limit as any answer
            step = (-1, ScriptStep(text=so.answer_text(so.instance(schema))))
        eos_after = engine.config.eos_after_tokens  # the model's own end, under any limit
        if step is not None:
            output_tokens, finish = min(sc.output_tokens(step[1]), room), "stop"
            if schema is not None and limit is not None and limit < output_tokens:
                step, output_tokens, finish = (-1, sc.cut_text(step[1], limit)), limit, "length"
            if eos_after is not None:
                output_tokens = min(output_tokens, eos_after)
        else:
            output_tokens, finish = generated_count({}, limit, engine.config.default_output_tokens, room, eos_after)
        active: ActiveRequest
        if engine.stepper is not None:
            active = engine.new_step_request(prompt_tokens, keys, 1, output_tokens)
        else:
            admitted = engine.try_admit(prompt_tokens, keys)
            if admitted is None:
                admitted = await watch.run(engine.admit(prompt_tokens, keys))
            active = admitted
            engine.update(record, cached_tokens=active.cached_tokens, prefill_tokens=active.prefill_tokens)
        reason = "abort"
        response = _response_object(body, engine.config.model_name, response_id)
        # the limit the engine ran with: `max_output_tokens=sampling_params.max_tokens` (`from_request`,
        # vllm/entrypoints/openai/responses/protocol.py), min(the request's, the room) or the room
        response["max_output_tokens"] = room if limit is None else min(limit, room)
        events = _EventWriter(responder, live)
        try:
            if stream and faults.raw_stream_chunks is not None:
                await _send_raw(engine, record, responder, watch, faults)
                reason = "stop"
                return
            if stream:
                await responder.start(200, SSE_HEADERS)
                await events.send("response.created", response=response)
                await events.send("response.in_progress", response=response)
            if isinstance(active, StepRequest):
                await watch.sleep(engine.config.ttft_s)
                await watch.run(engine.run_stepped_prefill(active))
                engine.update(record, cached_tokens=active.cached_tokens, prefill_tokens=active.prefill_tokens)
            else:
                await watch.sleep(engine.prefill_seconds(active))
                engine.finish_prefill(active)
            item_id = f"msg_{uuid.uuid4().hex}"
            if step is not None:
                await self._scripted(step, item_id, body, response, messages, prompt_tokens, active, record,
                                     watch, events if stream else None, responder, finish)
                reason = finish
                return
            pieces: list[str] = []
            for i in range(output_tokens):
                await _decode_token(engine, active, watch, i)
                pieces.append(output_token(i))
                engine.update(record, completion_tokens_sent=i + 1)
                if not stream:
                    continue
                if i == 0:
                    await events.send("response.output_item.added", output_index=0, item={
                        "id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"})
                    await events.send("response.content_part.added", item_id=item_id, output_index=0,
                                      content_index=0, part={"annotations": [], "text": "", "type": "output_text",
                                                             "logprobs": []})
                await events.send("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                  delta=pieces[-1], logprobs=[])
            text = "".join(pieces)
            part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            item = {"id": item_id, "content": [part], "role": "assistant", "status": "completed", "type": "message"}
            usage = _usage(prompt_tokens, output_tokens, active, engine.config.kv_block_tokens)
            final = {**response, **_final_status(finish), "output": [item] if output_tokens else [], "usage": usage}
            self._store(response_id, body, messages, text, final)
            if stream:
                if output_tokens:
                    await events.send("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
                                      text=text, logprobs=[])
                    await events.send("response.content_part.done", item_id=item_id, output_index=0,
                                      content_index=0, part=part)
                    await events.send("response.output_item.done", output_index=0, item=item)
                await events.send("response.completed", response=final)
                await responder.body(b"", more=False)
            else:
                await responder.reply(ErrorReply(200, orjson.dumps(final)))
            reason = finish
        finally:
            engine.stop_running(active, reason)


    async def _scripted(self, step: tuple[int, ScriptStep], item_id: str, body: dict[str, Any],
                        response: dict[str, Any], messages: list[dict[str, Any]], prompt_tokens: int,
                        active: ActiveRequest, record: SimRequestRecord, watch: DisconnectWatch,
                        events: _EventWriter | None, responder: _Responder, finish: str = "stop") -> None:
        """A scripted answer (`gateway.sim.script`): its text item and `function_call` items, each
        delta one decoded token, streamed (`events`) in vLLM's event order or as one response."""
        engine = self.engine
        output: list[dict[str, Any]] = []
        sent = 0
        for index, (item, deltas) in enumerate(sc.responses_items(step, item_id)):
            output.append(item)
            call = item["type"] == "function_call"
            if events is not None:
                added = ({**item, "arguments": "", "status": "in_progress"} if call
                         else {**item, "content": [], "status": "in_progress"})
                await events.send("response.output_item.added", output_index=index, item=added)
                if not call:
                    await events.send("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"annotations": [], "text": "", "type": "output_text",
                                                             "logprobs": []})
            for delta in deltas:
                await _decode_token(engine, active, watch, sent)
                sent += 1
                engine.update(record, completion_tokens_sent=sent)
                if events is None:
                    continue
                if call:
                    await events.send("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=delta)
                else:
                    await events.send("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=delta, logprobs=[])
            if events is None:
                continue
            if call:
                await events.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"], name=item["name"])
            else:
                part = item["content"][0]
                await events.send("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[])
                await events.send("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)
            await events.send("response.output_item.done", output_index=index, item=item)
        usage = _usage(prompt_tokens, sent, active, engine.config.kv_block_tokens)
        final = {**response, **_final_status(finish), "output": output, "usage": usage}
        self._store(response["id"], body, messages, step[1].text, final)
        if events is not None:
            await events.send("response.completed", response=final)
            await responder.body(b"", more=False)
        else:
            await responder.reply(ErrorReply(200, orjson.dumps(final)))


async def _decode_token(engine: SimWorkerState, active: ActiveRequest, watch: DisconnectWatch, i: int) -> None:
    """Wait until output token `i` (0-based) exists: the scheduler's step i + 1 (stepped), else the
    decode time (none before the first token), counting it generated."""
    if isinstance(active, StepRequest):
        if active.steps < i + 1:
            await watch.run(active.wait_steps(i + 1))
        return
    if i > 0:
        await watch.sleep(engine.decode_seconds())
    engine.note_generated(active)


async def _send_raw(engine: SimWorkerState, record: SimRequestRecord, responder: _Responder, watch: DisconnectWatch,
                    faults: SimFaults) -> None:
    """`raw_stream_chunks`: exactly the configured bytes, one write per chunk, ~20 ms apart (as chat's)."""
    engine.update(record, fault="raw_stream_chunks")
    await responder.start(200, SSE_HEADERS)
    for i, chunk in enumerate(faults.raw_chunk_bytes() or []):
        if i > 0:
            await watch.sleep(RAW_CHUNK_PAUSE_S)
        await responder.event(chunk)
    await responder.body(b"", more=False)


async def _replay_fault(faults: SimFaults, sent: int, send: Send, watch: DisconnectWatch) -> bool:
    """Inject the stream fault due after `sent` replayed events, if any: True when it ended the replay
    (dropped, reset, or ended with an error event); a stall returns only when the client left."""
    if faults.drop_after_chunks is not None and sent >= faults.drop_after_chunks:
        return True  # the handler returns with the body unended: the server drops the connection
    if faults.reset_after_chunks is not None and sent >= faults.reset_after_chunks:
        await asyncio.sleep(RESET_PAUSE_S)
        _reset(send)
        return True
    if faults.stall_after_chunks is not None and sent >= faults.stall_after_chunks:
        await watch.until_disconnected()
    if faults.error_after_chunks is not None and sent >= faults.error_after_chunks:
        error = {"type": "error", "code": "InternalServerError", "message": "Simulated failure mid-replay.",
                 "param": None, "sequence_number": sent}
        await send({"type": "http.response.body", "body": b"event: error\ndata: " + orjson.dumps(error) + b"\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    return False


class _EventWriter:
    """Typed SSE events with vLLM's `sequence_number` (0, 1, ... across the stream); a background
    stream's (`live`) are kept in its stored entry for the streams that follow it."""

    def __init__(self, responder: _Responder, live: StoredResponse | None = None) -> None:
        self._responder = responder
        self._sequence = 0
        self._live = live

    async def send(self, kind: str, **fields: Any) -> None:
        payload = {**fields, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        event = b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
        if self._live is not None:
            self._live.events.append(event)
            self._live.notify()
        await self._responder.event(event)


class _Detached(_Responder):
    """The responder of a background generation: its answer goes nowhere (the stored response and,
    streamed, the stored events are what clients read)."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True

    async def body(self, data: bytes, more: bool) -> None:
        return None


async def _discard(message: Any) -> None:
    return None


async def _never_disconnects() -> dict[str, Any]:
    """A `receive` whose client never leaves (a background generation's watch)."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}  # never reached


def _usage(prompt_tokens: int, output_tokens: int, active: ActiveRequest, block_tokens: int) -> dict[str, Any]:
    """A response's `usage` as vLLM 0.32's `ResponseUsage` (`vllm/entrypoints/openai/responses/protocol.py`,
    filled in `responses_full_generator`): cached and cache-written prompt tokens (`cache_write_tokens`,
    `ActiveRequest.created_cache_tokens`), reasoning and tool-output tokens (none here) and the per-turn
    lists, empty for a single-turn request without tools (`SimpleContext.all_turn_metrics`)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": active.cached_tokens,
                                     "cache_write_tokens": active.created_cache_tokens(block_tokens),
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + output_tokens}


def _number(value: Any, default: float) -> float:
    """A sampling field of the request as the float vLLM's `SamplingParams` holds (its default when
    absent, null or no number)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _final_status(finish_reason: str) -> dict[str, Any]:
    """A finished response's `status` and `incomplete_details` for its generation's finish reason:
    stopped by its token limit (`length`: `max_output_tokens`, or the context's room) it is
    `incomplete` with reason `max_output_tokens`, else `completed` (vLLM 0.32
    `vllm/entrypoints/openai/responses/serving.py` `responses_full_generator`: finish reason
    "length" makes the status "incomplete"; `protocol.py` `ResponsesResponse.from_request` sets
    `IncompleteDetails(reason="max_output_tokens")` for it). Streamed, the last event is still
    `response.completed`, its `response` carrying that status (`ResponseCompletedEvent`). The SGLang
    dialect answers the same: its `serving_responses.py` is adapted from vLLM's (its own status
    handling not checked against a release)."""
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed", "incomplete_details": None}


def _query(scope: Scope, name: str) -> str | None:
    """One query parameter's value (the first), None when absent."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name)
    return values[0] if values else None


def _response_object(body: dict[str, Any], model: str, response_id: str) -> dict[str, Any]:
    """The `response` object before its output (status in_progress), with the request's settings, in
    vLLM 0.32's `ResponsesResponse` fields (`vllm/entrypoints/openai/responses/protocol.py`,
    `from_request`): `id` the request's id; `temperature`, `top_p`, `presence_penalty` and
    `frequency_penalty` its sampling parameters as floats (defaults 1.0, 1.0, 0.0, 0.0);
    `service_tier` ("auto") and `truncation` ("disabled") as the request says or defaults; no
    `store` or `error` field (the model has none). The SGLang dialect answers the same object."""
    parallel = body.get("parallel_tool_calls")
    return {
        "id": response_id, "created_at": int(time.time()), "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
        "object": "response", "output": [], "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "temperature": _number(body.get("temperature"), 1.0), "tool_choice": "auto", "tools": [],
        "top_p": _number(body.get("top_p"), 1.0), "background": body.get("background") is True,
        "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
        "previous_response_id": body.get("previous_response_id"), "prompt": None, "reasoning": None,
        "service_tier": body.get("service_tier") or "auto", "status": "in_progress", "text": body.get("text"),
        "top_logprobs": None, "truncation": body.get("truncation") or "disabled", "usage": None, "user": None,
        "presence_penalty": _number(body.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(body.get("frequency_penalty"), 0.0),
    }


def _input_messages(body: dict[str, Any], prior: StoredResponse | None) -> list[dict[str, Any]]:
    """The chat messages the request stands for: instructions, the stored conversation and its answer
    (with `previous_response_id`), then the new input. Raises PromptError for an input of another shape."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if prior is not None:
        messages.extend(m for m in prior.messages if m.get("role") != "system")
        messages.append({"role": "assistant", "content": prior.text})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for item in value:
            if not isinstance(item, dict):
                raise PromptError("each input item must be an object")
            messages.append(_item_message(item))
    else:
        raise PromptError("input must be a string or a non-empty list of input items")
    return messages


def _item_message(item: dict[str, Any]) -> dict[str, Any]:
    """One input item as a chat message (content parts renamed to chat's: input_text → text ...)."""
    if item.get("type", "message") == "message" and "role" in item:
        content = item.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("input_text", "output_text"):
                    parts.append({"type": "text", "text": part.get("text") or ""})
                elif kind == "input_image":
                    parts.append({"type": "image_url", "image_url": {"url": part.get("image_url") or ""}})
                else:
                    raise PromptError(f"unsupported content part: {kind!r}")
            content = parts
        return {"role": item["role"], "content": content}
    if item.get("type") == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else orjson.dumps(output).decode()}
    return {"role": "assistant", "content": orjson.dumps(item).decode()}
