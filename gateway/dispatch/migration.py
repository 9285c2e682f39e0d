"""Mid-stream migration (issue 23): a streamed chat or text completion whose worker (vLLM,
vllm-ascend, SGLang, llama.cpp: `ENGINES`) fails after content reached the client goes on on another
worker, and the client reads one answer.

While a stream is relayed, `Progress.keep` holds the whole events the client got (one list append
per read); every `FOLD_BYTES`, and at a failure, their text pieces are cut out (one pattern over
the batch, no JSON parse per event) and kept as written, decoded only when a failure needs them. When the engine fails
after that (a reset or an EOF before `data: [DONE]`, an in-band error event, no byte within the
inter-token budget `timeouts.read`), `Migration.resume` sends the request again to another worker
of the pool (never the one that failed) with the text so far as the start of the answer:

- chat: the messages plus a final `{"role": "assistant", "content": <text so far>}` (and its
  `reasoning_content`), `continue_final_message: true`, `add_generation_prompt: false` (vLLM's
  `ChatCompletionRequest`, `vllm/entrypoints/openai/chat_completion/protocol.py`: the template is
  rendered without the final message's end of turn, so the model goes on with it);
- completions: the prompt with the text so far appended;
- the output limits (`max_tokens`, `max_completion_tokens`) and `min_tokens` less the tokens
  generated: the first stream's own `completion_tokens` when it reported continuous usage, else the
  text so far counted by the continuation pool's `/tokenize` on engines that have one
  (`TOKENIZERS`), else the content chunks relayed (one token each: an engine that packs several
  tokens into a chunk, vLLM's `--stream-interval` or a loaded API server, is undercounted there);
  sampling fields, seed and stop as sent.

The continuation's events are rewritten to carry the first stream's `id`, `created` and `model`;
its opening role chunk is dropped (the client had one); an SSE comment (`: x-kimi-gateway-migrated
...`) marks the seam. Its usage is made honest: prompt tokens of the original request, completion
tokens = all generated; the re-prefilled prompt is counted in `kimi_gateway_migration_prefill_tokens`
and the access log's `migration`, not billed to the key.

An Anthropic Messages stream goes on on the engine's chat API (`Migration._continuation`: the
engines' Messages layers do not prefill a trailing assistant turn), its chat chunks written as the
rest of the client's Anthropic stream (`Migration._as_messages`).

A prefill/decode (PD) pool's stream is its decode worker's, so there a mid-stream failure is a
decode death: the continuation is a fresh prefill of prompt + text so far on a new pair
(`Migration._attempt`): another decode worker (never the one that failed), and the stream's prefill
worker again when it is still in service with room (its prefix cache holds the prompt; a decode
death says nothing against it), else the prefill policy's choice. The pair is run by the pool's own
protocol runner (`kinds.Disaggregated.pair`), which sets fresh protocol fields as for any attempt:
a new SGLang bootstrap room, a new NIXL prefill leg and its KV handle, a new Mooncake transfer id.
A NIXL stream committed before its decode leg opened (`pd.deferred.DeferredStream`) hands its
migration to its decode stream when that opens. The seam, usage and bounds are the single leg's.

Off: per request (`OPT_OUT_HEADER: off`), per pool (`migrate: false`), or everywhere
(`migration.max_per_request: 0`); `attach` decides. Not at a safe point, the failure ends the
stream as before (one SSE error event): a tool call under way, `n` > 1, `logprobs`, `echo`, a prompt
that is not one string, a finish already sent (Messages: a thinking block, no open text block, the
client's own prefill). Responses streams are not migrated.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson

from gateway.backends.control import pool_headers
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dialects.names import CHAT, COMPLETIONS, MESSAGES, Api
from gateway.dialects.registry import dialect_for
from gateway.dispatch.answers import RelayResponse
from gateway.dispatch.attempt import Attempt, SingleLeg
from gateway.dispatch.context import Dispatch
from gateway.dispatch.kinds import PD_KINDS
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.pd.attempt import PdAttempt
from gateway.dispatch.pd.deferred import DeferredStream
from gateway.dispatch.steps import decide
from gateway.errors import UpstreamError
from gateway.protocol.anthropic import STOP_REASONS, continuation_chat, message_end_events, sse_error, text_delta_event
from gateway.routing.features import CACHE_PARTITION_FIELDS, RoutingRequest
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Continuing, Outcome, UpstreamStream

OPT_OUT_HEADER = "x-kimi-gateway-migrate"
"""A request header: `off` keeps this request's stream from being migrated."""

FOLD_BYTES = 64 * 1024
"""Relayed bytes held unparsed at most (`Progress.keep`)."""

ENGINES = frozenset({"vllm", "ascend", "llamacpp", "sglang"})
"""Engine kinds a stream is continued on: vLLM and vllm-ascend, whose chat serving reads
`continue_final_message` and `add_generation_prompt` (tested against the simulator); llama.cpp,
whose server prefills a trailing assistant message by default (`--no-prefill-assistant` turns that
off: `common/arg.cpp`; `tools/server/server-common.cpp` `oaicompat_chat_params_parse` renders it
without its end of turn) and ignores the two flags (tested against the real engine:
tests/e2e/test_real_engine_migration.py); SGLang, whose chat serving reads `continue_final_message`
(`python/sglang/srt/entrypoints/openai/serving_chat.py`, `_handle_last_assistant_message`: a final
assistant message whose content is a string is taken off the messages and its content appended to
the prompt rendered with the generation prompt, so the answer goes on with it) and has no
`add_generation_prompt` field (its pydantic `ChatCompletionRequest` ignores the extra member). SGLang
renders only that message's `content`, not its `reasoning_content`: a stream that relayed reasoning
is not continued there (`refusal`)."""

SGLANG = "sglang"

TOKENIZERS = frozenset({"vllm", "ascend"})
"""Engine kinds whose `POST /tokenize` counts a text's tokens: `{"model", "prompt",
"add_special_tokens": false}` answered `{"count", "tokens", "max_model_len"}` (vLLM's
`vllm/entrypoints/serve/tokenize/serving.py` `create_tokenize`, served by vllm-ascend as well)."""

TOKENIZE_TIMEOUT = 5.0
"""Seconds the kept text's `/tokenize` may take before the chunk count is used instead."""

MIGRATION = "migration"
"""The route reason of a continuation's attempt (both phases' in a PD pool)."""

CONTINUATION_TRIES = 2
"""Workers a continuation is tried on at most (each failure before its first content moves on)."""

_EVENT_BREAK = re.compile(rb"\r?\n\r?\n")
# A chunk's text: chat's `delta.content` / `delta.reasoning_content` (vLLM's, SGLang's) or
# `delta.reasoning`, completions' `choices[].text`; a JSON string's body as written.
_PIECE = re.compile(rb'"(content|reasoning_content|reasoning|text)"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
_TOOL_CALL = re.compile(rb'"tool_calls"\s*:\s*\[\s*\{')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"')
# Anthropic's events (a Messages stream): a tool_use block, a stop reason, a thinking block's text.
_TOOL_USE = re.compile(rb'"type"\s*:\s*"tool_use"')
_STOP_REASON = re.compile(rb'"stop_reason"\s*:\s*"')
_THINKING = b'"thinking_delta"'
_BLOCK_EVENT = b'"content_block_st'  # content_block_start / content_block_stop


PARSED_EVENT_MAX = 1 << 20
"""Bytes of one event at most that `Progress` parses (for the stream's identity, a usage object, a
Messages block): a larger one (token-level data: a prompt's token ids or logprobs) is not parsed,
so an event of many MiB never costs many times its size in parsed objects; the events around it
carry the same fields."""


def _data_events(events: bytes) -> Iterator[bytes]:
    """The `data:` payloads of whole SSE events (one line each, as the engines write them), one at
    a time; an event over `PARSED_EVENT_MAX` bytes is passed over without being copied."""
    pos = 0
    while True:
        brk = _EVENT_BREAK.search(events, pos)
        end = len(events) if brk is None else brk.start()
        if end - pos <= PARSED_EVENT_MAX:
            for line in events[pos:end].split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if brk is None:
            return
        pos = brk.end()


class Progress:
    """What the client got of one stream so far. After `fold()`: `text` and `reasoning` (the
    content and reasoning relayed), `tokens` (content chunks relayed, or the engine's own
    `completion_tokens` when it reported continuous usage), `tool_call` (a tool call's delta was
    relayed), `finished` (a finish reason was relayed), `ident` (the first chunk's `id`, `created`,
    `model`), `prompt_tokens` (the engine's, when a chunk reported usage)."""

    __slots__ = ("_raw", "_reasoning", "_size", "_text", "block", "counted", "finished", "ident", "prompt_tokens",
                 "thinking", "tokens", "tool_call", "usage_tokens")

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._size = 0
        self._text: list[bytes] = []  # the JSON string bodies as written (escapes and all)
        self._reasoning: list[bytes] = []
        self.tokens = 0
        self.counted: int | None = None
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.tool_call = False
        self.finished = False
        self.ident: dict[str, Any] | None = None
        self.thinking = False  # a Messages stream relayed a thinking block
        self.block: tuple[int, str] | None = None  # a Messages stream's open content block: (index, type)

    def keep(self, events: bytes) -> None:
        """Hold whole events the client was sent (parsed later, in batches; a large read is read
        alone, never joined to a copy with the ones before it)."""
        if len(events) > FOLD_BYTES and self._raw:
            self.fold()
        self._raw.append(events)
        self._size += len(events)
        if self._size > FOLD_BYTES:
            self.fold()

    def fold(self) -> None:
        """Read the events held since the last fold into the fields. The engines write compact JSON
        (a raw `"` or newline cannot occur inside a JSON string), so the text pieces are found by
        one pattern over the batch and only they are decoded; an event is parsed whole only for
        the stream's identity (its first event) and for a usage object."""
        raw, self._raw, self._size = self._raw, [], 0
        data = b"".join(raw)
        if not data:
            return
        if self.ident is None:
            self._first_event(data)
        both = b'"reasoning_content"' in data  # an engine that writes both names: one of them is read
        text: list[bytes] = []
        reasoning: list[bytes] = []
        for match in _PIECE.finditer(data):
            name, piece = match.groups()
            if not piece or (both and name == b"reasoning"):
                continue
            (text if name == b"content" or name == b"text" else reasoning).append(piece)
            self.tokens += 1
        _add(self._text, text)
        _add(self._reasoning, reasoning)
        if not self.tool_call and b'"tool_calls"' in data and _TOOL_CALL.search(data):
            self.tool_call = True
        if not self.finished and b'"finish_reason"' in data and _FINISH.search(data):
            self.finished = True
        if _BLOCK_EVENT in data:  # Anthropic's Messages stream (each block's start and stop, rare)
            self._blocks(data)
        if not self.tool_call and b'"tool_use"' in data and _TOOL_USE.search(data):
            self.tool_call = True
        if not self.finished and b'"stop_reason"' in data and _STOP_REASON.search(data):
            self.finished = True
        if not self.thinking and _THINKING in data:
            self.thinking = True
        if b'"usage"' in data:
            for payload in _data_events(data):
                if b'"usage"' in payload:
                    self._usage(payload)

    def _first_event(self, data: bytes) -> None:
        """The stream's `id`, `created` and `model`, from its first chunk (the first fold's only)."""
        for payload in _data_events(data):
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(chunk, dict) and "id" in chunk:
                self.ident = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
                return

    def _blocks(self, data: bytes) -> None:
        """A Messages stream's open content block, from its `content_block_start` / `_stop` events."""
        for payload in _data_events(data):
            if _BLOCK_EVENT not in payload:
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(event, dict) or not isinstance(event.get("index"), int):
                continue
            if event.get("type") == "content_block_start":
                block = event.get("content_block")
                self.block = (event["index"], str(block.get("type")) if isinstance(block, dict) else "")
            elif event.get("type") == "content_block_stop":
                self.block = None

    def _usage(self, payload: bytes) -> None:
        """The engine's counts from a chunk's usage (continuous usage stats; a Messages stream's
        `message_start`, whose `input_tokens` is the prompt where the engine counted it there)."""
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        usage = chunk.get("usage") if isinstance(chunk, dict) and "error" not in chunk else None
        if isinstance(chunk, dict) and chunk.get("type") == "message_start" and isinstance(chunk.get("message"), dict):
            start = chunk["message"].get("usage")
            if isinstance(start, dict) and isinstance(start.get("input_tokens"), int) and start["input_tokens"] > 0:
                self.prompt_tokens = start["input_tokens"]
            return
        if isinstance(usage, dict) and "input_tokens" in usage:
            return  # a Messages stream's end: its counts are the tap's
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]

    @property
    def text(self) -> str:
        """The content relayed so far (after `fold()`)."""
        return _decoded(self._text)

    @property
    def reasoning(self) -> str:
        """The reasoning relayed so far (after `fold()`)."""
        return _decoded(self._reasoning)

    @property
    def generated(self) -> int:
        """Tokens generated so far: the engine's count when its stream gave one, else the kept text's
        tokens counted by the engine's tokenizer (`counted`, set by `Migration.resume`), else the
        chunks'."""
        if self.usage_tokens is not None:
            return self.usage_tokens
        return max(self.tokens, self.counted) if self.counted is not None else self.tokens


def refusal(api: str, body: dict[str, Any], progress: Progress, engine: str = "vllm") -> str | None:
    """Why a stream cannot be continued from here (None: it can): its request asks for what a
    continuation cannot give seamlessly on the pool's `engine` kind, or its answer is not at a safe
    point."""
    if progress.tool_call:
        return "a tool call was under way"
    if progress.finished:
        return "the answer had finished"
    if api == MESSAGES:
        return _messages_refusal(body, progress, engine)
    n = body.get("n")
    if n is not None and n != 1:
        return "n > 1"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        return "logprobs were asked for"
    if api == COMPLETIONS:
        prompt = body.get("prompt")
        if body.get("echo") is True:
            return "echo was asked for"
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and len(prompt) == 1
                                                and isinstance(prompt[0], str)):
            return "the prompt is not one string"
        if body.get("suffix") is not None:
            return "a suffix was given"
    elif not isinstance(body.get("messages"), list):
        return "no messages"
    elif engine == SGLANG and progress.reasoning:
        return "SGLang does not continue reasoning"  # its prefill is the final message's content alone
    return _straddles(body.get("stop"), body.get("include_stop_str_in_output") is True or engine == SGLANG,
                      progress)


def _messages_refusal(body: dict[str, Any], progress: Progress, engine: str) -> str | None:
    """`refusal` for a Messages stream: continued on the engine's chat API, so its text block must be
    open (its `content_block_start` relayed, no `_stop`), with no thinking block before it, and the
    client's own last turn must not be an assistant prefill (the engines' Messages layers start a
    new turn after it, llama.cpp's continues it: the continuation could not say which)."""
    if progress.thinking:
        return "a thinking block was relayed"
    if progress.block is None or progress.block[1] != "text":
        return "no text block was open"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages"
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        return "the request prefilled the answer"
    return _straddles(body.get("stop_sequences"), engine == SGLANG, progress)


def _straddles(stops: Any, unheld: bool, progress: Progress) -> str | None:
    """The refusal when a stop string may straddle the seam: the engine does not hold back a
    partial match (`unheld`) and the text kept ends with the start of one of `stops`."""
    stops = [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []
    if stops and unheld:
        # vLLM holds back max(len(stop)) - 1 characters of a stream with stop strings
        # (`vllm/v1/engine/detokenizer.py`, `stop_buffer_length`), so no stop string can straddle
        # the seam, unless the stop string is to be included in the output, which turns that off.
        # SGLang's is not relied on: the text kept may end with the start of a stop string.
        text = progress.text
        if any(isinstance(s, str) and any(text.endswith(s[:i]) for i in range(1, len(s))) for s in stops):
            return "a stop sequence may straddle the seam"
    return None


def continuation_body(api: str, body: dict[str, Any], progress: Progress, model: str) -> dict[str, Any] | None:
    """The engine body that continues `body`'s answer from `progress` (see the module docstring),
    for a pool serving `model`; None when no output is left to generate."""
    generated = progress.generated
    out = dict(body)
    out["model"] = model
    for name in ("max_tokens", "max_completion_tokens"):
        limit = out.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - generated < 1:
                return None
            out[name] = limit - generated
    least = out.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least > 0:
        out["min_tokens"] = max(least - generated, 0)
    text = progress.text
    if api == COMPLETIONS:
        prompt = out["prompt"]
        out["prompt"] = (prompt if isinstance(prompt, str) else prompt[0]) + text
        return out
    messages = out["messages"]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if body.get("continue_final_message") is True and messages and isinstance(messages[-1], dict) \
            and isinstance(messages[-1].get("content"), str):  # a continuation's own: its turn grows
        turn = {**messages[-1], "content": messages[-1]["content"] + text}
        messages = messages[:-1]
    reasoning = progress.reasoning
    if reasoning:
        turn["reasoning_content"] = str(turn.get("reasoning_content") or "") + reasoning
    out["messages"] = [*messages, turn]
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


def attach(state: AppState, dispatch: Dispatch, attempt: Attempt, result: RelayResponse) -> None:
    """Give an accepted stream its migration when a mid-stream failure could continue it elsewhere:
    a chat or text completion (or Messages) stream of a single-leg or PD attempt (no pinned
    worker) on an engine that continues a turn, with migration on for the request (no opt-out
    header), the config (`migration.max_per_request` > 0) and the pool (`migrate`)."""
    stream = result.stream
    if (not dispatch.migrate or not dialect_for(dispatch.api).migrates or dispatch.pinned is not None
            or not isinstance(stream, UpstreamStream | DeferredStream) or not attempt.pool.migrate
            or attempt.worker.engine.kind not in ENGINES or state.config.migration.max_per_request == 0):
        return
    if isinstance(attempt, PdAttempt):
        stream.migration = Migration(state, dispatch.api, attempt.pool, attempt.worker, attempt.body,
                                     dispatch.request, dispatch.ledger, attempt.strip_usage, dispatch.tried,
                                     attempt.prefill)
    elif isinstance(attempt, SingleLeg):
        stream.migration = Migration(state, dispatch.api, attempt.pool, attempt.worker, attempt.body,
                                     dispatch.request, dispatch.ledger, attempt.strip_usage, dispatch.tried)


class Migration:
    """One stream's migration state: owned by its `UpstreamStream` (`migration`), made by the
    dispatch when it accepted the stream (`attach`). `resume` finds the next worker (a PD pool's:
    the next pair) and opens the continuation; `relay` rewrites its events; `usage` is the honest
    usage after it. `body` is the engine body the stream was asked with (bytes, or a PD attempt's
    parsed one); `prefill` a PD stream's prefill worker."""

    __slots__ = ("_api", "_body", "_from", "_kept_at", "_ledger", "_parsed", "_pool", "_prefill", "_request",
                 "_state", "_strip_usage", "_tried", "_worker", "count", "prefilled", "progress")

    def __init__(self, state: AppState, api: Api, pool: PoolConfig, worker: Worker, body: bytes | dict[str, Any],
                 request: RoutingRequest, ledger: Ledger, strip_usage: bool, tried: set[Worker],
                 prefill: Worker | None = None) -> None:
        self._state = state
        self._api = api
        self._pool = pool
        self._worker = worker
        self._body = body if isinstance(body, bytes) else b""
        self._request = request
        self._ledger = ledger
        self._strip_usage = strip_usage
        self._tried = tried
        self._prefill = prefill
        self._parsed: dict[str, Any] | None = body if isinstance(body, dict) else None
        self._from: Worker | None = None
        self._kept_at: list[int] = []
        self.count = 0
        self.progress = Progress()
        self.prefilled = 0

    def ready(self) -> bool:
        """Whether a failure now would be continued (bound, safe point); notes a refusal."""
        if self.count >= self._state.config.migration.max_per_request:
            return False
        self.progress.fold()
        if self._parsed is None:
            try:
                parsed = orjson.loads(self._body)
            except orjson.JSONDecodeError:
                return False
            self._parsed = parsed if isinstance(parsed, dict) else {}
        why = refusal(self._api, self._parsed, self.progress, self._worker.engine.kind)
        if why is not None:
            self._ledger.migration_refused(self._pool.name, self._worker, why)
            return False
        return True

    async def resume(self, why: str) -> Continuing | None:
        """Open the continuation on another worker: its accepted `UpstreamStream`, or None (no
        worker with room, or its attempt failed before content: the caller ends the stream with its
        error event). Call after `ready()` said yes."""
        state, ledger, pool = self._state, self._ledger, self._pool
        self.count += 1
        self._tried.add(self._worker)
        assert self._parsed is not None
        workers = self._candidates()
        if workers:
            await self._count_kept(workers[0])
        api, body = self._continuation()
        ledger.migration_started(self._worker, why, self.progress.generated, self.count)
        outcome = "no_worker"
        for tries in range(CONTINUATION_TRIES if body is not None else 0):
            workers = workers if tries == 0 else self._candidates()
            if not workers:
                break
            attempt = self._attempt(api, orjson.dumps(body), workers)
            if attempt is None:
                break
            worker = attempt.worker
            ledger.continuation_started(worker)
            try:
                result = await attempt.run()
            except AttemptFailed as failure:
                ledger.continuation_ended(pool.name, worker, failure.outcome)
                self._tried.add(attempt.failed_worker(failure))
                outcome = "failed"
                continue
            except UpstreamError:  # an event past max_body_bytes before its first token: any worker would send it
                ledger.continuation_ended(pool.name, worker, Outcome.PROTOCOL_ERROR)
                outcome = "failed"
                break
            ledger.continuation_ended(pool.name, worker, Outcome.OK)
            self._kept_at.append(self.progress.generated)
            self._from, self._worker = self._worker, worker
            prefill = attempt.prefill if isinstance(attempt, PdAttempt) else None
            self._prefill = prefill
            ledger.migration_ended(pool.name, "migrated", worker, prefill)
            assert isinstance(result, RelayResponse)  # the continuation streams, as the request did
            stream = result.stream
            assert isinstance(stream, UpstreamStream | DeferredStream)
            stream.migration = self if self.count < state.config.migration.max_per_request else None
            return stream
        ledger.migration_ended(pool.name, outcome)
        return None

    def _candidates(self) -> list[Worker]:
        """The pool's workers a continuation may go to: with room, not tried, on an engine that
        continues a turn (`ENGINES`)."""
        registry = self._state.registry
        return [w for w in registry.gates[self._pool.name].with_room(
            registry.candidates(self._pool.name, self._tried, adapter=self._request.adapter))
            if w.engine.kind in ENGINES]

    async def _count_kept(self, worker: Worker) -> None:
        """Count the text kept so far with `worker`'s tokenizer (`TOKENIZERS`; the pool's workers
        share one) into `progress.counted`, when the first stream gave no count of its own. A
        failure (an error status, a malformed answer, no answer within `TOKENIZE_TIMEOUT`) leaves
        the chunk count."""
        progress = self.progress
        text = progress.reasoning + progress.text
        if progress.usage_tokens is not None or worker.engine.kind not in TOKENIZERS or not text:
            return
        assert self._parsed is not None
        body = {"model": self._parsed.get("model") or "", "prompt": text, "add_special_tokens": False}
        try:
            answer = await self._state.http.post(
                worker.url + "/tokenize", content=orjson.dumps(body),
                headers={"content-type": "application/json", **pool_headers([self._pool])[self._pool.name]},
                timeout=TOKENIZE_TIMEOUT)
            count = orjson.loads(answer.content)["count"] if answer.status_code == 200 else None
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError):
            return
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            progress.counted = count

    def _attempt(self, api: Api, body: bytes, workers: list[Worker]) -> SingleLeg | PdAttempt | None:
        """The continuation's attempt among `workers` (the candidates with room, none tried): one
        worker by the pool's policy; in a PD pool, a fresh pair (None: no prefill worker has room).

        A PD pair: a decode worker by the decode policy among `workers` (never the one that
        failed), and the stream's prefill worker again when it is still in service with room (a
        decode death says nothing against it, and its prefix cache holds the prompt, so the
        re-prefill of prompt + text so far computes mostly the text), else the prefill policy's
        choice among the prefill workers in service. The runner gives the pair fresh protocol
        fields (bootstrap room, KV handle, transfer id)."""
        state, pool, request, registry = self._state, self._pool, self._request, self._state.registry
        strip_usage = self._strip_usage and api == self._api
        pd = pool.disaggregation
        if pd is None:
            decision = decide(state.policies.policy(pool.name), request, workers, {})
            return SingleLeg(state, api, pool, decision.worker, MIGRATION, None, body, request, self._ledger,
                             strip_usage)
        prefills = registry.gates[pool.name].with_room(
            registry.candidates(pool.name, self._tried, "prefill", request.adapter))
        if not prefills:
            return None
        prefill = self._prefill if self._prefill in prefills else \
            decide(state.policies.policy(pool.name), request, prefills, {}).worker
        decode = decide(state.policies.policy(pool.name, "decode"), request, workers, {}).worker
        return PD_KINDS[pd.mode].pair(state, api, pool, decode, prefill, MIGRATION, body, request, self._ledger,
                                      strip_usage)

    def _continuation(self) -> tuple[Api, dict[str, Any] | None]:
        """The API and the engine body the answer goes on with (None: no output left). A Messages
        answer goes on on the engine's chat API: the engines' Messages layers start a new turn after a
        trailing assistant message (vLLM's `vllm/entrypoints/anthropic/serving.py` builds its chat
        request without `continue_final_message`; SGLang's serving_chat turns it into a user turn),
        so its chat twin (`continuation_chat`) is continued, with usage asked for."""
        assert self._parsed is not None
        model = self._parsed.get("model") or ""
        if self._api != MESSAGES:
            return self._api, continuation_body(self._api, self._parsed, self.progress, model)
        chat = {**continuation_chat(self._parsed), "stream": True, "stream_options": {"include_usage": True}}
        # Its cache partition (a salt the gateway set per key, `gateway/auth/cache_isolation.py`) too.
        chat.update((name, self._parsed[name]) for name in CACHE_PARTITION_FIELDS if name in self._parsed)
        return CHAT, continuation_body(CHAT, chat, self.progress, model)

    def seam(self) -> bytes:
        """The SSE comment that marks the latest seam (clients ignore comments: WHATWG SSE); a PD
        continuation's names its prefill worker too."""
        origin = self._from.id if self._from is not None else ""
        prefill = f" prefill={self._prefill.id}" if self._prefill is not None else ""
        return (f": x-kimi-gateway-migrated from={origin} to={self._worker.id}{prefill} "
                f"kept_tokens={self.progress.generated}\n\n").encode()

    async def relay(self, stream: Continuing) -> AsyncIterator[bytes]:
        """The continuation's events as the client gets them: the first stream's `id`, `created`
        and `model`, no second role chunk, honest usage; error events and `[DONE]` as they are."""
        stream.continuation = True
        yield self.seam()
        if self._api == MESSAGES:
            async for part in self._as_messages(stream):
                yield part
            return
        ident = self.progress.ident or {}
        async for chunk in stream.body():
            out: list[bytes] = []
            for event in _EVENT_BREAK.split(chunk):
                if not event:
                    continue
                if not event.startswith(b"data:") or b'"error"' in event:
                    out.append(event + b"\n\n")
                    continue
                payload = event[5:].strip()
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out.append(event + b"\n\n")
                    continue
                if not isinstance(data, dict):
                    out.append(event + b"\n\n")
                    continue
                data.update(ident)
                if _role_only(data):  # each continuation opens the turn again; the client's is open
                    continue
                for choice in data.get("choices") or ():
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict):
                        delta.pop("role", None)
                if isinstance(data.get("usage"), dict):
                    data["usage"] = self.usage(data["usage"])
                out.append(b"data: " + orjson.dumps(data) + b"\n\n")
            if out:
                yield b"".join(out)

    async def _as_messages(self, stream: Continuing) -> AsyncIterator[bytes]:
        """A chat continuation's events as the rest of the client's Messages stream: its content as
        `text_delta`s of the open text block, then that block's stop, one `message_delta` (the stop
        reason, the whole answer's usage) and `message_stop`; an error event as Anthropic's."""
        assert self.progress.block is not None
        index = self.progress.block[0]
        stop_reason: str | None = None
        usage: dict[str, Any] | None = None
        async for chunk in stream.body():
            out: list[bytes] = []
            for event in _EVENT_BREAK.split(chunk):
                if not event.startswith(b"data:"):
                    if event.startswith(b":"):
                        out.append(event + b"\n\n")  # a seam or keep-alive comment
                    continue
                payload = event[5:].strip()
                if payload == b"[DONE]":
                    out.append(message_end_events(index, stop_reason, self.usage(usage)))
                    continue
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    error = data["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    out.append(sse_error(str(message or "The inference server failed mid-stream.")))
                    continue
                if isinstance(data.get("usage"), dict):
                    usage = data["usage"]
                for choice in data.get("choices") or ():
                    if not isinstance(choice, dict):
                        continue
                    delta = choice.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else None
                    if isinstance(text, str) and text:
                        out.append(text_delta_event(index, text))
                    if choice.get("finish_reason") is not None:
                        stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
            if out:
                yield b"".join(out)

    def usage(self, continued: dict[str, Any] | None) -> dict[str, Any] | None:
        """The whole answer's usage from the continuation's (`continued`): the original prompt's
        tokens (the first stream's count, else the continuation's prompt less the tokens kept),
        completion tokens = those kept + the continuation's. Notes the re-prefill for the metric."""
        if not isinstance(continued, dict):
            return continued
        kept = self.progress.generated
        prompt, completion = continued.get("prompt_tokens"), continued.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return continued
        original = self.progress.prompt_tokens if self.progress.prompt_tokens is not None else max(prompt - kept, 0)
        # Every continuation prefilled the original prompt and the tokens kept when it started.
        self.prefilled = sum(original + at for at in self._kept_at[:-1]) + prompt
        out = {**continued, "prompt_tokens": original, "completion_tokens": kept + completion,
               "total_tokens": original + kept + completion}
        details = out.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], original)}
        return out

    def settled(self, continued: dict[str, Any] | None) -> dict[str, Any] | None:
        """The record's usage once the continuation ended (its engine's usage made honest), with
        the re-prefill counted in the metric and the access log."""
        usage = self.usage(continued)
        if self.prefilled:
            self._ledger.migration_prefilled(self._pool.name, self.prefilled)
        return usage


def _add(kept: list[bytes], pieces: list[bytes]) -> None:
    """Keep one fold's JSON string bodies as one (a piece per fold, not per token: a stream of
    millions of one-token chunks costs its text's bytes, not an object per chunk); pieces that do
    not decode (no engine writes them) are kept apart, for `_decoded` to drop."""
    if len(pieces) > 1:
        joined = b"".join(pieces)
        try:
            orjson.loads(b'"' + joined + b'"')
        except orjson.JSONDecodeError:
            kept.extend(pieces)
            return
        kept.append(joined)
    elif pieces:
        kept.append(pieces[0])


def _decoded(pieces: list[bytes]) -> str:
    """JSON string bodies (as written, escapes included) joined and decoded: escapes never span
    two bodies, so the joined body is one JSON string's. An undecodable one (no engine writes it)
    is dropped piece by piece."""
    try:
        text = orjson.loads(b'"' + b"".join(pieces) + b'"')
    except orjson.JSONDecodeError:
        good = []
        for piece in pieces:
            try:
                good.append(orjson.loads(b'"' + piece + b'"'))
            except orjson.JSONDecodeError:
                continue
        return "".join(good)
    return text if isinstance(text, str) else ""


def _role_only(chunk: dict[str, Any]) -> bool:
    """A chat chunk that only opens the assistant's turn (`delta: {"role": "assistant", "content": ""}`)."""
    if chunk.get("usage") is not None:
        return False
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta:
            return False
        if any(v not in (None, "") for k, v in delta.items() if k != "role"):
            return False
    return True
