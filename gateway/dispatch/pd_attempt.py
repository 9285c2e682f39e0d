"""The two-leg attempt of a prefill/decode (PD) pool: a prefill worker computes the prompt's KV
cache, a decode worker receives it and generates the answer the client gets (issue 13).

One class per protocol (the wire shapes, with their sources, are in `gateway/sim/pd.py`'s
docstring; tests/integration/test_pd_wire.py checks these legs against the peers' recorded ones):

- `SglangAttempt`: the same body, plus `bootstrap_host` (the prefill worker's host),
  `bootstrap_port` (its bootstrap server) and `bootstrap_room` (a fresh random non-negative 63-bit
  int per attempt, a list of them for a batch of prompts), to both workers at once. The prefill
  answer is read to its end and dropped.
- `NixlAttempt` (vLLM NixlConnector): first the prefill leg (`stream: false`, `max_tokens: 1`,
  `max_completion_tokens: 1` when present, no `stream_options` or `min_tokens`,
  `kv_transfer_params` asking for a remote decode), then the original request plus the
  `kv_transfer_params` the prefill answer returned to the decode worker.
- `MooncakeAttempt` (vLLM MooncakeConnector): both legs at once, tied by a fresh `transfer_id`; the
  decode leg names the prefill worker's bootstrap server and engine id (its `GET /query`).

Both legs carry the same `x-request-id` (the gateway's engine request id, never the client's). A
NIXL prefill answer's handle is checked before the decode leg opens (`foreign_kv_handle`): one
naming another host or port than the prefill worker's fails the attempt against the prefill
worker (`protocol_error`), so a decode worker never pulls KV from a host the prefill worker chose
freely. The client's own `kv_transfer_params` and bootstrap fields never reach these legs
(`gateway/parsing.py` strips them; each protocol writes its own). The decode leg is the `SingleLeg` path (held start,
first-content wait, relay); the prefill leg is a `PrefillLeg` task in the attempt's `Holding`, so
the relay's end or a client hang-up aborts both. A prefill failure before the decode leg's first
content fails the attempt against the prefill worker (the dispatch retries with a new prefill
worker, a new room / transfer id); after a committed stream (keep-alives, no content yet) it aborts
the decode leg, whose relay then ends with one SSE error event, never a hang.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from gateway.backends.client import TransportError, UpstreamTimeouts
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dispatch.answers import SSE_CONTENT_TYPE, BufferedResponse, RelayResponse
from gateway.dispatch.attempt import UPSTREAM_PATHS, SingleLeg, budgets, hold_window
from gateway.dispatch.params import TimeoutConfig
from gateway.errors import UpstreamError
from gateway.protocol.sse import sse_error_event
from gateway.record import RequestOutcome, RequestRecord
from gateway.routing.features import Api, RoutingRequest
from gateway.state import AppState
from gateway.streaming import (
    KEEPALIVE_COMMENT,
    RETRYABLE,
    AttemptFailed,
    Holding,
    Outcome,
    UpstreamStream,
    first_chunk,
    open_upstream,
    read_rest,
)

MAX_ROOM = (1 << 63) - 1  # SGLang's bootstrap_room: a non-negative 63-bit int (sgl-router pd_router.rs)

# The prefill leg of both vLLM connectors asks for a remote decode (vllm_pd_router.rs).
NIXL_PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def fresh_room() -> int:
    """A random SGLang bootstrap room, 0..2^63-1 (never reused: each attempt draws its own)."""
    return secrets.randbelow(MAX_ROOM + 1)


def batch_size(body: dict[str, Any]) -> int | None:
    """How many prompts a completions body carries when it is a batch (a list of strings or of
    token lists), else None (one prompt: chat, a string, one token list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return None


def sglang_fields(body: dict[str, Any], host: str, port: int | None) -> dict[str, Any]:
    """SGLang's three bootstrap fields for `body`: lists (one entry per prompt) for a batch."""
    n = batch_size(body)
    if n is None:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": fresh_room()}
    return {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
            "bootstrap_room": [fresh_room() for _ in range(n)]}


def vllm_prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of vLLM's PD protocols: the request generating one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = kv_transfer_params
    return out


def prefill_budget(timeouts: TimeoutConfig, prompt_tokens: int) -> float:
    """Seconds a prefill worker may take to answer its leg: `timeouts.prefill_first_byte` (else
    `first_byte_base`) plus `first_byte_per_1k_tokens` per 1,000 prompt tokens. A prefill is
    prompt work only, so a non-streamed request's answer budget (its generation) is no measure of
    it: a prefill worker that accepts the leg and never answers is found within this, not minutes."""
    base = timeouts.first_byte_base if timeouts.prefill_first_byte is None else timeouts.prefill_first_byte
    return base + timeouts.first_byte_per_1k_tokens * prompt_tokens / 1000.0


def host_of(url: str) -> str:
    """The host part of a worker URL (no brackets for IPv6)."""
    return urlsplit(url).hostname or ""


def foreign_kv_handle(params: dict[str, Any], pool: PoolConfig, prefill: Worker) -> str | None:
    """Why a vLLM NIXL prefill answer's `kv_transfer_params` must not reach a decode worker, or None.

    The decode worker reads the KV blocks from the handle's `remote_host:remote_port` (the NIXL side
    channel, `nixl_connector.py`), so a handle is only passed on when it names the prefill worker
    that answered: `remote_host` its configured `side_channel_host` (else its URL's host, compared
    case-insensitively) and, when `side_channel_port` is configured, `remote_port` that port. A
    handle without a remote prefill (`do_remote_prefill` not true and no host or port: the decode
    worker then prefills locally) passes."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if params.get("do_remote_prefill") is not True and host is None and port is None:
        return None
    configured = pool.disaggregation.prefill if pool.disaggregation is not None else []
    entry = next((p for p in configured if p.url == prefill.url), None)
    expected_host = (entry.side_channel_host if entry is not None else None) or host_of(prefill.url)
    expected_port = entry.side_channel_port if entry is not None else None
    if not isinstance(host, str) or host.strip("[]").lower() != expected_host.strip("[]").lower():
        return (f"the prefill answer's KV handle names remote_host {str(host)[:80]!r}, not the prefill worker's "
                f"{expected_host!r}")
    if type(port) is not int or not 0 < port < 65536 or (expected_port is not None and port != expected_port):
        return (f"the prefill answer's KV handle names remote_port {str(port)[:20]!r}"
                + (f", not the prefill worker's {expected_port}" if expected_port is not None else ""))
    return None


class PrefillLeg:
    """The prefill leg of one PD attempt, running as its own task from creation: sends `body`,
    reads the whole answer (`answer`, bytes) and ends; `failure` is its AttemptFailed. A failed
    health probe of the prefill worker meanwhile ends it at once (`Outcome.MOVED`). Closable
    (`aclose` cancels it when still running, which closes its upstream response): owned by the
    attempt's Holding. `on_late_failure` (set once the decode stream was committed) is awaited
    when the leg fails after that. Its headers mark the worker alive (`Worker.answered_at`) and
    clear the request's `record.prefill_pending`."""

    __slots__ = ("_record", "_registry", "_task", "answer", "done_at", "failure", "on_late_failure", "started",
                 "worker")

    def __init__(self, state: AppState, pool: PoolConfig, worker: Worker, url: str, body: bytes,
                 headers: dict[str, str], timeout: UpstreamTimeouts, budget: float,
                 record: RequestRecord) -> None:
        self.worker = worker
        self._record = record
        self._registry = state.registry
        self.answer: bytes | None = None
        self.failure: AttemptFailed | None = None
        self.on_late_failure: Callable[[], Awaitable[None]] | None = None
        self.started = time.perf_counter()
        self.done_at: float | None = None
        self._task = asyncio.ensure_future(self._run(state, pool, url, body, headers, timeout, budget))

    @property
    def task(self) -> asyncio.Future[None]:
        return self._task

    def _moved(self) -> None:
        if not self._task.done():
            self.failure = AttemptFailed(Outcome.MOVED, "the prefill worker failed a health probe")
            self._task.cancel()

    async def _run(self, state: AppState, pool: PoolConfig, url: str, body: bytes, headers: dict[str, str],
                   timeout: UpstreamTimeouts, budget: float) -> None:
        self._registry.awaiting_headers(self.worker, self._moved)
        try:
            async with asyncio.timeout(budget):
                response = await open_upstream(state.upstream, url, body, headers, timeout, pool.name)
                self.worker.answered_at = time.perf_counter()
                if self._record.prefill_pending is self.worker:
                    self._record.prefill_pending = None
                try:
                    first, rest = await first_chunk(response)
                    self.answer = await read_rest(response, first, rest, state.config.max_body_bytes)
                except (*TransportError, ValueError) as exc:
                    raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"prefill answer broke: {exc}", answered=True) from exc
                finally:
                    await response.aclose()
            self.done_at = time.perf_counter()
            self._registry.request_succeeded(self.worker)
        except asyncio.CancelledError:
            if self.failure is None:  # cancelled by its owner: nothing to report
                raise
        except TimeoutError:  # not `answered`: another prefill worker may repeat a prefill (no generation lost)
            self.failure = AttemptFailed(Outcome.TIMEOUT, f"the prefill worker did not answer within {budget:.1f}s")
        except AttemptFailed as failure:
            self.failure = failure
        finally:
            self._registry.headers_done(self.worker, self._moved)
        if self.failure is not None and self.on_late_failure is not None:
            state.metrics.pd_leg_failures.labels(pool.name, "prefill", self.failure.outcome).inc()
            self._registry.request_failed(self.worker, f"prefill leg: {self.failure.detail}")
            await self.on_late_failure()

    async def result(self) -> bytes:
        """The prefill answer once the leg ended; raises its AttemptFailed."""
        await asyncio.wait((self._task,))
        if self.failure is not None:
            raise self.failure
        assert self.answer is not None
        return self.answer

    async def aclose(self) -> None:
        """Abort the leg when still running (its upstream response is closed); idempotent."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait((self._task,))


class PdAttempt(SingleLeg):
    """A two-leg attempt: `worker` is the decode worker (its answer goes to the client, its outcome
    is counted against it), `prefill` the prefill worker. `failed_worker` names the leg that failed.
    Subclasses implement `_legs` per protocol."""

    __slots__ = ("_failed", "_prefill_leg", "prefill", "prefill_reason")

    def __init__(self, state: AppState, api: Api, pool: PoolConfig, decode: Worker, prefill: Worker, reason: str,
                 prefill_reason: str, matched: float | None, body: bytes, request: RoutingRequest,
                 record: RequestRecord, strip_usage: bool) -> None:
        super().__init__(state, api, pool, decode, reason, matched, body, request, record, strip_usage)
        self.prefill = prefill
        self.prefill_reason = prefill_reason
        self._failed: Worker | None = None
        self._prefill_leg: PrefillLeg | None = None

    @property
    def cache_worker(self) -> Worker:
        """The prefill worker: it holds the prompt's prefix cache."""
        return self.prefill

    def failed_worker(self, failure: AttemptFailed) -> Worker:
        return self._failed or self.worker

    async def run(self) -> BufferedResponse | RelayResponse:
        """Take both slots (the prefill's outside the pool's request count), run the protocol's
        legs, release everything unless a stream took it."""
        state = self._state
        gate = state.registry.gates[self.pool.name]
        self._record.prefill_worker = self.prefill.id
        holding = Holding()
        try:
            holding.lease(self.worker, state.metrics, gate)
            holding.lease(self.prefill, state.metrics, gate, counted=False)
            result = await self._legs(holding, self.upstream_headers())
            self._observe(result)
            return result
        finally:
            if holding:
                await holding.aclose()

    async def _legs(self, holding: Holding, headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        raise NotImplementedError

    def _start_prefill(self, holding: Holding, body: dict[str, Any], headers: dict[str, str]) -> PrefillLeg:
        """Open the prefill leg (its own task) into `holding`."""
        timeouts = self._state.config.timeouts
        timeout, _, _ = budgets(timeouts, self._request, self.pool)
        budget = prefill_budget(timeouts, self._request.prompt_tokens)
        self._record.prefill_pending = self.prefill  # the worker a hang-up meanwhile is held against
        leg = PrefillLeg(self._state, self.pool, self.prefill, self.prefill.url + UPSTREAM_PATHS[self._api],
                         orjson.dumps(body), headers, timeout, budget, self._record)
        self._prefill_leg = leg
        return holding.opened(leg)

    async def _prefill_answer(self, leg: PrefillLeg) -> bytes:
        """The prefill leg's answer; its failure is the attempt's, against the prefill worker."""
        try:
            return await leg.result()
        except AttemptFailed:
            self._prefill_failed(leg)
            raise

    def _prefill_failed(self, leg: PrefillLeg) -> None:
        self._failed = self.prefill
        self.prefill.pd_engine_id = None  # a restarted prefill engine has a new id: read it again
        assert leg.failure is not None
        self._state.metrics.pd_leg_failures.labels(self.pool.name, "prefill", leg.failure.outcome).inc()

    async def _both(self, holding: Holding, leg: PrefillLeg,
                    headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        """Both legs at once: the decode leg's answer, unless the prefill leg fails first (then the
        decode leg is aborted and the attempt fails against the prefill worker)."""
        serve = asyncio.ensure_future(self._serve(holding, headers))
        try:
            await asyncio.wait((serve, leg.task), return_when=asyncio.FIRST_COMPLETED)
            if not serve.done() and leg.failure is not None:
                serve.cancel()
                await asyncio.wait((serve,))
                self._prefill_failed(leg)
                raise leg.failure
            try:
                result = await serve
            except AttemptFailed as failure:
                self._state.metrics.pd_leg_failures.labels(self.pool.name, "decode", failure.outcome).inc()
                raise
        finally:
            if not serve.done():  # our own task was cancelled (the client hung up): end the decode leg too
                serve.cancel()
                await asyncio.wait((serve,))
        if isinstance(result, RelayResponse):
            if not leg.task.done():
                leg.on_late_failure = lambda: self._abort_waiting_decode(result)
            elif leg.failure is not None:  # failed in the loop step that committed the stream: no
                # late-failure call will come, so do now what it would do (else a decode with no
                # content waits for KV until the engine's own timeout)
                self._state.metrics.pd_leg_failures.labels(self.pool.name, "prefill", leg.failure.outcome).inc()
                self._state.registry.request_failed(leg.worker, f"prefill leg: {leg.failure.detail}")
                await self._abort_waiting_decode(result)
        return result

    async def _abort_waiting_decode(self, result: RelayResponse) -> None:
        """The prefill leg failed after the decode stream was committed: while the decode worker has
        sent no content it waits for KV that will not come, so abort it (the relay then ends with
        one SSE error event; the decode worker is not blamed: the prefill worker is). Once it sent
        content, the KV had arrived: let it finish."""
        if self._record.first_byte_at is None and isinstance(result.stream, UpstreamStream):
            await result.stream.abort("The prefill worker failed before the first token")

    def _observe(self, result: BufferedResponse | RelayResponse) -> None:
        """Per-phase metrics: the prefill leg's time, and the KV hand-off (prefill answer to the
        decode leg's first byte) when the prefill answered first."""
        leg, metrics, pool = self._prefill_leg, self._state.metrics, self.pool.name
        if leg is None or leg.done_at is None:
            return
        metrics.pd_prefill_seconds.labels(pool).observe(leg.done_at - leg.started)
        first = self._record.first_byte_at
        if first is not None and first >= leg.done_at:
            metrics.pd_handoff_seconds.labels(pool).observe(first - leg.done_at)


class SglangAttempt(PdAttempt):
    """SGLang bootstrap: the same body (plus the bootstrap fields) to both legs at once."""

    __slots__ = ()

    async def _legs(self, holding: Holding, headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        body = orjson.loads(self._body)
        body.update(sglang_fields(body, host_of(self.prefill.url), self.prefill.bootstrap_port))
        self._body = orjson.dumps(body)
        leg = self._start_prefill(holding, body, headers)
        return await self._both(holding, leg, headers)


class DeferredStream:
    """A committed stream whose upstream is not open yet: a vLLM NIXL prefill leg that outlasts the
    hold window (`timeouts.hold_headers`). The client gets its 200 and `: keep-alive` comments every
    `keepalive` seconds while `start()` runs (the prefill leg's end, then the decode leg's opening);
    then the decode stream's bytes (`UpstreamStream.body`). A failure of `start()` ends the stream
    with one SSE error event (`on_failure(exc)` accounts it), as any failure after a commit does.
    Owns `holding` (both slots, the prefill leg) until `start()` hands it to the decode stream;
    `aclose()` (idempotent) releases whatever it still holds. Quacks as `UpstreamStream` for the
    relay (`body`, `aclose`, `sse`)."""

    sse = True

    def __init__(self, start: Callable[[Holding], Awaitable[RelayResponse]], holding: Holding,
                 keepalive: float | None, on_failure: Callable[[Exception], str]) -> None:
        self._start = start
        self.holding = holding
        self._keepalive = keepalive
        self._on_failure = on_failure
        self._inner: RelayResponse | None = None
        self._closed = False

    async def body(self) -> AsyncIterator[bytes]:
        """Keep-alives until the decode stream opened, then its bytes; one SSE error on failure."""
        task = asyncio.ensure_future(self._start(self.holding))
        try:
            while not task.done():
                await asyncio.wait((task,), timeout=self._keepalive)
                if not task.done():
                    yield KEEPALIVE_COMMENT
            try:
                self._inner = task.result()
            except (AttemptFailed, UpstreamError) as exc:
                yield sse_error_event(self._on_failure(exc))
                return
            async for chunk in self._inner.stream.body():
                yield chunk
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._inner is not None:
                await self._inner.stream.aclose()
        finally:
            if self.holding:
                await self.holding.aclose()


class NixlAttempt(PdAttempt):
    """vLLM NIXL: the prefill leg first, then the decode leg with the KV's `kv_transfer_params`. A
    streaming request whose prefill leg outlasts the hold window is committed first
    (`DeferredStream`: keep-alives while the prefill runs), as an aggregated engine's long prefill is."""

    __slots__ = ()

    async def _legs(self, holding: Holding, headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        body = orjson.loads(self._body)
        leg = self._start_prefill(holding, vllm_prefill_body(body, dict(NIXL_PREFILL_PARAMS)), headers)
        if self._request.stream:
            done, _ = await asyncio.wait((leg.task,), timeout=hold_window(self._state.config.timeouts, self._record))
            if not done:
                return self._deferred(holding, leg, body, headers)
        return await self._decode(holding, leg, body, headers)

    def _deferred(self, holding: Holding, leg: PrefillLeg, body: dict[str, Any],
                  headers: dict[str, str]) -> RelayResponse:
        """Commit the stream now; the decode leg opens once the prefill leg answered."""
        async def start(owned: Holding) -> RelayResponse:
            result = await self._decode(owned, leg, body, headers)
            assert isinstance(result, RelayResponse)
            self._observe(result)
            return result

        self._record.status = 200
        stream = DeferredStream(start, holding.hand_over(), self._state.config.timeouts.keepalive_interval,
                                self._failed_after_commit)
        return RelayResponse(stream, SSE_CONTENT_TYPE, [])

    def _failed_after_commit(self, exc: Exception) -> str:
        """Account a deferred stream's failure (the record, the failed leg's worker); its message."""
        record = self._record
        record.outcome = RequestOutcome.UPSTREAM_ERROR
        record.error = str(exc)
        worker = self._failed or self.worker
        if not isinstance(exc, AttemptFailed) or exc.outcome in RETRYABLE:  # the worker's fault, not the request's
            self._state.registry.request_failed(worker, f"after the stream was committed: {exc}")
        if isinstance(exc, AttemptFailed) and exc.status is not None and 400 <= exc.status < 500:
            return f"The inference server refused the request ({exc.detail})."
        return f"The inference server failed before the first token ({exc}); the response is incomplete."

    async def _decode(self, holding: Holding, leg: PrefillLeg, body: dict[str, Any],
                      headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        """The prefill leg's answer, then the decode leg with its `kv_transfer_params`."""
        answer = await self._prefill_answer(leg)
        try:
            params = orjson.loads(answer).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            self._failed = self.prefill
            raise AttemptFailed(Outcome.PROTOCOL_ERROR, "the prefill answer is not a JSON object",
                                answered=True) from None
        if params is not None and not isinstance(params, dict):
            # vLLM's decode worker would refuse it with a 400 the client would be blamed for: it is
            # the prefill worker's fault (null is passed on, as vllm-router does: decode prefills locally)
            self._failed = self.prefill
            raise AttemptFailed(Outcome.PROTOCOL_ERROR, "the prefill answer's kv_transfer_params is not an object",
                                answered=True)
        if params is not None and (refused := foreign_kv_handle(params, self.pool, self.prefill)) is not None:
            self._failed = self.prefill
            self._state.metrics.pd_leg_failures.labels(self.pool.name, "prefill", Outcome.PROTOCOL_ERROR).inc()
            raise AttemptFailed(Outcome.PROTOCOL_ERROR, refused, answered=True)
        body["kv_transfer_params"] = params
        self._body = orjson.dumps(body)
        try:
            return await self._serve(holding, headers)
        except AttemptFailed as failure:
            self._state.metrics.pd_leg_failures.labels(self.pool.name, "decode", failure.outcome).inc()
            raise


async def mooncake_engine_id(http: httpx.AsyncClient, bootstrap: str) -> str:
    """The engine id a vLLM Mooncake prefill worker's bootstrap server (`bootstrap`:
    http://host:port) reports for DP rank 0 (`GET /query`: {rank: {"engine_id": str,
    "worker_addr": ...}}, mooncake_utils.py). Raises AttemptFailed (connect_error) when it
    cannot be read."""
    try:
        response = await http.get(bootstrap + "/query")
        response.raise_for_status()
        table = response.json()
        ranks = sorted(table, key=lambda k: int(k) if str(k).isdigit() else 1 << 30)
        engine_id = table[ranks[0]]["engine_id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise AttemptFailed(Outcome.CONNECT_ERROR, f"prefill bootstrap server {bootstrap}/query: "
                            f"{type(exc).__name__}") from exc
    if not isinstance(engine_id, str):
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"prefill bootstrap server {bootstrap}/query: no engine_id")
    return engine_id


class MooncakeAttempt(PdAttempt):
    """vLLM Mooncake: both legs at once, tied by a fresh `transfer_id`; the decode leg finds the
    prefill worker through its bootstrap server (`remote_bootstrap_addr`) and names its engine id
    (read once from the bootstrap server's `GET /query`, kept on the worker, forgotten when an
    attempt through it fails)."""

    __slots__ = ()

    async def _legs(self, holding: Holding, headers: dict[str, str]) -> BufferedResponse | RelayResponse:
        host = host_of(self.prefill.url)
        bootstrap = f"http://{f'[{host}]' if ':' in host else host}:{self.prefill.bootstrap_port}"
        if self.prefill.pd_engine_id is None:
            try:
                self.prefill.pd_engine_id = await mooncake_engine_id(self._state.http, bootstrap)
            except AttemptFailed:
                self._failed = self.prefill
                raise
        body = orjson.loads(self._body)
        transfer = f"xfer-{uuid.uuid4()}"
        prefill_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer}
        leg = self._start_prefill(holding, vllm_prefill_body(body, prefill_params), headers)
        body["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer,
                                      "remote_bootstrap_addr": bootstrap, "remote_engine_id": self.prefill.pd_engine_id}
        self._body = orjson.dumps(body)
        try:
            return await self._both(holding, leg, headers)
        except AttemptFailed:
            # A decode leg fails too when it named a restarted prefill engine's old id (its prefill
            # legs still succeed): read the id again for the next attempt.
            self.prefill.pd_engine_id = None
            raise
