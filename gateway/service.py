"""The request sequence (design §2), orchestration only: parse → features → pool → worker → upstream.

`ProxyService.handle` returns a `BufferedResponse` (errors, non-streaming answers) or a
`RelayResponse` (an accepted stream) and raises GatewayError for the client's mistakes and for
exhausted upstreams. Failover happens only before the engine's first body byte.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from gateway.affinity.hashing import longest_match
from gateway.affinity.response_store import ResponseOwner
from gateway.auth.keys import Principal
from gateway.backends.client import UpstreamResponse, first_byte_budget, request_timeout
from gateway.backends.registry import DEFAULT_RETRY_AFTER_S, WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import PoolConfig
from gateway.errors import (
    GatewayError,
    NoCapacity,
    UpstreamError,
    UpstreamTimeout,
    error_bytes_from_upstream,
)
from gateway.parsing import Body, BodyParser, Payload, encode_for
from gateway.protocol.responses import chat_usage, response_id_of
from gateway.record import RequestOutcome, RequestRecord
from gateway.routing.features import Api, RoutingRequest
from gateway.routing.policy import Candidate, Decision, RoutingPolicy
from gateway.routing.pools import fitting_pools, larger_pools, serving_pools
from gateway.routing.response_affinity import owner_of
from gateway.state import AppState
from gateway.streaming import (
    RETRYABLE,
    AnswerTooLarge,
    AttemptFailed,
    Lease,
    Outcome,
    UpstreamStream,
    first_chunk,
    first_content,
    mark_first_byte,
    open_upstream,
    read_rest,
)

# A 504 after the whole answer budget: a client retry would repeat the same long generation. The
# OpenAI SDKs honour this header (their `_should_retry` reads `x-should-retry` before the status).
NO_CLIENT_RETRY = {"x-should-retry": "false"}

UPSTREAM_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                                  "responses": "/v1/responses"}
RESPONSE_AFFINITY = "response_affinity"
"""The route reason of a Responses follow-up sent to the worker that stores its history."""

Headers = list[tuple[bytes, bytes]]


SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = b"application/json"


@dataclass(slots=True)
class BufferedResponse:
    """A complete answer: status, headers (lower-case names) and body bytes."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: Headers = field(default_factory=list)


@dataclass(slots=True)
class RelayResponse:
    """An accepted upstream stream (HTTP 200) to relay: the stream that owns the upstream, headers."""

    stream: UpstreamStream
    content_type: bytes = b"text/event-stream"
    headers: Headers = field(default_factory=list)


class ProxyService:
    """Routes and proxies chat and completions requests for one AppState."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        config = state.config
        self._parser = BodyParser(config, state.estimator, state.hasher)

    @property
    def parser(self) -> BodyParser:
        """The body parser for the running config (a reload replaces `state.config`)."""
        if self._parser.config is not self.state.config:
            self._parser = BodyParser(self.state.config, self.state.estimator, self.state.hasher)
        return self._parser

    async def parse(self, api: Api, body: Body, headers: Mapping[str, str]) -> tuple[Payload, RoutingRequest]:
        """Validate the body and build its routing features. Raises InvalidRequest, ModelNotFound,
        ContextLengthExceeded (also from a cheap lower bound of its tokens, before validation).

        A body over `parse_offload_bytes`, or with more than `parse_offload_items` items, is parsed
        in a parse process (`gateway/parsing.py`), so the event loop keeps serving meanwhile; its
        payload is then a `ForwardBody`, the engine's body already encoded.
        With `image_fetch.enabled`, the chat request's http(s) image URLs are fetched first to
        measure their pixel size (`ImageFetcher.measure`: bounded in time, never failing the request).
        """
        state, parser = self.state, self.parser
        session = headers.get("x-session-id")
        if isinstance(body, bytes) and len(body) <= state.config.parse_offload_bytes:
            payload, items = parser.decode(api, body)
            if items <= state.config.parse_offload_items:
                wire, model, urls = parser.validate(api, payload)
                measured = await state.images.measure(urls) if state.images is not None and urls else None
                return payload, parser.features(wire, model, session, measured)
        parsed = await state.parse_pool.parse(api, body, session,
                                              state.images.measure if state.images is not None else None)
        assert parsed.request is not None and parsed.forward is not None
        return parsed.forward, parsed.request

    async def handle(self, api: Api, body: Body, headers: Mapping[str, str], record: RequestRecord,
                     principal: Principal | None = None) -> BufferedResponse | RelayResponse:
        """The whole request path up to an accepted upstream (or a final error).

        `principal` is the authenticated caller (auth on): one request is counted against its
        request limit before the body is even parsed (so invalid or oversized bodies are not free
        and a key over its limit fetches no image URL); its token limit is charged the request's
        estimated prompt tokens + its output limit (else the first fitting pool's reservation) times
        the completions it asks for (`RoutingRequest.quota_tokens`) before routing; RateLimited
        (429) or RateLimitUnavailable (503) when refused. The charge is settled when the request
        ends (`quota_used`): at once for an answer or error given here, at the record's finish for
        a stream.
        """
        guard = self.state.auth if principal is not None else None
        counted = None
        if guard is not None:
            assert principal is not None
            counted = await guard.count_request(principal)  # before any parsing, measuring or image fetch
        payload, request = await self.parse(api, body, headers)
        record.stream = request.stream
        record.estimated_prompt_tokens = request.prompt_tokens
        record.estimate_method = request.estimate_method
        pools = fitting_pools(request, serving_pools(api, self.state.config.pools))
        pinned: Worker | None = None
        if request.previous_response_id is not None:  # only the worker storing its history can serve it
            pool, pinned = await owner_of(request.previous_response_id, "previous_response_id", self.state.responses,
                                          self.state.registry, self.state.config.pools, self.state.metrics)
            pools = [pool]
        if guard is None:
            return await self._dispatch(api, payload, request, pools, record, pinned)
        assert principal is not None
        reservation = await guard.check_quota(principal, request.quota_tokens(pools[0].default_output_tokens),
                                              requests=0, counted=counted)
        if reservation is None:
            return await self._dispatch(api, payload, request, pools, record, pinned)
        record.on_finish = lambda done: guard.settle_soon(reservation, quota_used(
            done, request, reservation.tokens, done.outcome is not RequestOutcome.OK or done.status >= 400))
        try:
            result = await self._dispatch(api, payload, request, pools, record, pinned)
        except GatewayError:
            await guard.settle(reservation, quota_used(record, request, reservation.tokens, failed=True))
            raise
        if isinstance(result, BufferedResponse):
            await guard.settle(reservation, quota_used(record, request, reservation.tokens, result.status >= 400))
        return result

    async def _dispatch(self, api: Api, payload: Payload, request: RoutingRequest, pools: list[PoolConfig],
                        record: RequestRecord, pinned: Worker | None = None) -> BufferedResponse | RelayResponse:
        state = self.state
        metrics = state.metrics
        pool = pools[0]
        record.pool = pool.name
        metrics.estimated_prompt_tokens.labels(pool.name, request.estimate_method).observe(request.prompt_tokens)
        failures = Failures()
        try:  # a 5xx whose verdict waited for the next attempt is settled however the request ends
            return await self._dispatch_loop(api, payload, request, pools, record, failures, pinned)
        finally:
            failures.charge(state.registry)

    async def _dispatch_loop(self, api: Api, payload: Payload, request: RoutingRequest,
                             pools: list[PoolConfig], record: RequestRecord,
                             failures: Failures, pinned: Worker | None = None) -> BufferedResponse | RelayResponse:
        """Until an attempt is accepted or `max_attempts` ran out: choose the pool and its candidates
        with room (`choose_pool`), the worker (`decide`), make the attempt (`_attempt`), and judge a
        failed one (`after_failure`): same pool, a larger one, or a final answer.

        `pinned` (a Responses follow-up's owner, `routing/response_affinity.py`) replaces the choice:
        one attempt on that worker (`pools` is its pool alone), no policy, spill-over or failover,
        since no other worker holds the stored history."""
        state = self.state
        registry = state.registry
        metrics = state.metrics
        pool = pools[0]
        tried: set[Worker] = set()
        too_long_retried = False
        last: AttemptFailed | None = None
        matches: dict[str, dict[str, float]] = {}  # pool -> worker URL -> matched share of the prompt
        bodies: dict[tuple[str, bool, bool], bytes] = {}  # (served name, usage patch, max_tokens) -> body
        queue_deadline: float | None = None  # set when the request first waits for a slot
        while record.attempts < state.config.max_attempts:
            if pinned is not None:
                if tried:
                    break
                step, to, workers = PoolStep.ROUTE, pool, [pinned]
            else:
                step, to, workers = choose_pool(registry, pool, pools, tried)
            if step is not PoolStep.ROUTE:
                if step is PoolStep.EXHAUSTED:
                    break
                if step is PoolStep.WAIT:
                    gate = registry.gates[pool.name]
                    if queue_deadline is None:
                        queue_deadline = time.monotonic() + gate.queue_timeout
                    await gate.wait_for_slot(queue_deadline)
                else:  # spill over: unavailable or saturated
                    metrics.spillovers.labels(pool.name, to.name, step.value).inc()
                    pool = to
                    record.pool = pool.name
                continue
            policy = state.router.policy(pool.name)
            if pinned is None and policy.uses_affinity and pool.name not in matches:
                matches[pool.name] = await self._affinity_matches(pool.name, request)
                # Others may have taken the free slots or broken workers meanwhile: look again. From
                # here to the attempt's Lease nothing awaits, so the room seen is the room taken.
                continue
            match = matches.get(pool.name, {})
            decision = Decision(pinned, RESPONSE_AFFINITY) if pinned is not None else decide(policy, request, workers,
                                                                                               match)
            worker = decision.worker
            record.attempts += 1
            record.worker, record.reason = worker.id, decision.reason
            metrics.route_decisions.labels(pool.name, decision.reason).inc()
            if last is not None:
                metrics.retries.labels(pool.name, last.outcome).inc()
            # Count a stream's tokens even when its client did not ask for usage (backends/patches.py).
            patch_usage = request.stream and not request.include_usage and worker.engine.supports_include_usage
            try:
                body = engine_body(bodies, payload, api, pool.served_model_name or state.config.model.name,
                                   worker, patch_usage)
                record.open_attempt, record.attempt_answered = worker, False
                result = await self._attempt(api, pool, worker, body, request, record, patch_usage)
                record.open_attempt = None
            except AttemptFailed as failure:
                self._attempt_failed(failure, pool, worker, record)
                tried.add(worker)
                last = failure
                step_to = after_failure(registry, failure, worker, pool, pools, request, record, too_long_retried,
                                        failures)
                if isinstance(step_to, BufferedResponse):
                    return step_to
                if step_to is not pool:
                    metrics.spillovers.labels(pool.name, step_to.name, "too_long").inc()
                    too_long_retried = True
                    pool = step_to
                    record.pool = pool.name
                continue
            self._attempt_accepted(pool, worker, request, record, policy.uses_affinity, match)
            if api == "responses":
                self._note_stored_response(request, pool, worker, result)
            result.headers.extend(route_headers(record))
            return result
        raise self._exhausted(last, record, pools, failures)

    def _attempt_failed(self, failure: AttemptFailed, pool: PoolConfig, worker: Worker,
                        record: RequestRecord) -> None:
        """Account for a failed attempt: its metric, its trace span, whether the engine saw it."""
        record.open_attempt = None
        record.reached_engine |= failure.outcome in (Outcome.TIMEOUT, Outcome.PROTOCOL_ERROR)
        self.state.metrics.upstream_attempts.labels(pool.name, worker.id, failure.outcome).inc()
        if record.trace is not None:
            record.trace.end_attempt(failure.outcome)

    def _attempt_accepted(self, pool: PoolConfig, worker: Worker, request: RoutingRequest, record: RequestRecord,
                          uses_affinity: bool, match: dict[str, float]) -> None:
        """Account for the accepted attempt, and remember (after the first chunk went out) that its
        worker now holds the prompt's prefix."""
        state = self.state
        record.reached_engine = True
        state.metrics.upstream_attempts.labels(pool.name, worker.id, Outcome.OK).inc()
        if record.trace is not None:
            record.trace.end_attempt(Outcome.OK)
        if uses_affinity and request.prefix is not None and state.affinity is not None:
            state.metrics.affinity_match_ratio.labels(pool.name).observe(match.get(worker.url, 0.0))
            # After this task next yields, i.e. once the first chunk went out: never before the first token.
            asyncio.get_running_loop().call_soon(state.affinity.record, pool.name, request.prefix.hashes,
                                                 worker.url)

    def _note_stored_response(self, request: RoutingRequest, pool: PoolConfig, worker: Worker,
                              result: BufferedResponse | RelayResponse) -> None:
        """Remember which worker stores the response this accepted Responses request creates (not with
        `store: false`, nor on an engine that stores nothing): from the JSON answer's `id`, or from the
        stream's `response.created` event as the relay passes it (`SSETap.on_response_id`)."""
        store = self.state.responses
        if store is None or not request.store or not worker.engine.stores_responses:
            return
        owner = ResponseOwner(pool.name, worker.url)
        if isinstance(result, RelayResponse):
            result.stream.tap.on_response_id = lambda rid: store.record(rid, owner)
        elif result.status == 200 and (rid := response_id_in_json(result.body)) is not None:
            store.record(rid, owner)

    async def _affinity_matches(self, pool: str, request: RoutingRequest) -> dict[str, float]:
        """Worker URL → share of the prompt it holds, from one store lookup (fails open to {})."""
        store, prefix = self.state.affinity, request.prefix
        if store is None or prefix is None:
            return {}
        owners = await store.lookup(pool, prefix.hashes)
        if owners is None:
            return {}
        matched = longest_match(prefix, owners)
        self.state.metrics.affinity_lookups.labels(pool, "hit" if matched else "miss").inc()
        return matched

    async def _attempt(self, api: Api, pool: PoolConfig, worker: Worker, body: bytes, request: RoutingRequest,
                       record: RequestRecord, strip_usage: bool = False) -> BufferedResponse | RelayResponse:
        """One upstream attempt: send the request, wait for the engine's headers and its first
        content within their budgets, then accept it: a stream is handed to an `UpstreamStream`
        (which from then on owns the lease and the response), a non-streaming answer is read whole.
        Raises AttemptFailed before anything reached the client, UpstreamError for an answer that
        broke or is too large after the engine accepted the request."""
        state = self.state
        headers = upstream_headers(pool, worker, record)
        timeouts = state.config.timeouts
        output = request.output_tokens if request.output_tokens is not None else pool.default_output_tokens
        timeout = request_timeout(timeouts, request.prompt_tokens, request.stream, output)
        # The wait for a stream's first content, or for a whole answer, has its own budget: aiohttp's
        # read timeout is per read and must also allow a long prefill, so it cannot catch a worker
        # that hangs quickly. A stream's headers have a shorter one: engines send them before the prefill.
        budget = first_byte_budget(timeouts, request.prompt_tokens) if request.stream else timeout.read
        header_wait = min(timeouts.response_header, budget) if request.stream else budget
        loop = asyncio.get_running_loop()
        started = loop.time()
        moved = False
        lease = Lease(worker, state.metrics, state.registry.gates[pool.name])  # owns the slot, then the response
        try:
            try:
                async with asyncio.timeout(header_wait) as deadline:

                    def move() -> None:
                        """The worker failed its health probe: this attempt goes elsewhere."""
                        nonlocal moved
                        moved = True
                        deadline.reschedule(loop.time())

                    state.registry.awaiting_headers(worker, move)
                    try:
                        lease.response = response = await open_upstream(
                            state.upstream, worker.url + UPSTREAM_PATHS[api], body, headers, timeout, pool.name)
                    finally:
                        state.registry.headers_done(worker, move)
                    record.attempt_answered = True
                    deadline.reschedule(started + budget)
                    content = True
                    if request.stream:
                        hold = timeouts.hold_headers
                        if hold is not None:  # counted from the client's arrival: its proxies' idle timers run since
                            hold = max(0.0, hold - (time.perf_counter() - record.started))
                        sse = response.headers.get("content-type", "").startswith("text/event-stream")
                        first, rest, content = await first_content(response, hold, sse)
                    else:
                        first, rest = await first_chunk(response)
            except TimeoutError:
                raise timed_out(moved, record.attempt_answered, header_wait, budget) from None
            content_type = _relayed_content_type(response, request.stream)
            passed = _passed_headers(response)
            record.status = response.status_code

            def ended(failure: str | None) -> None:
                """Passive health counts whole answers: a stream that breaks after its first byte too."""
                if failure is None:
                    state.registry.request_succeeded(worker)
                else:
                    state.registry.request_failed(worker, failure)

            if request.stream:  # `content` False: still prefilling, commit the stream and send keep-alives
                if content:
                    mark_first_byte(record)
                stream = UpstreamStream(response, first, rest, lease, record, not content, timeouts.keepalive_interval,
                                        ended, strip_usage)
                lease.hand_over()  # the stream releases the slot and closes the response (`UpstreamStream.aclose`)
                return RelayResponse(stream, content_type, passed)
            mark_first_byte(record)
            try:
                answer = await read_rest(response, first, rest, state.config.max_body_bytes)
                if not passed:  # an encoded (compressed) answer is relayed as it is
                    record.usage = _check_json_answer(answer, content_type)
            except AnswerTooLarge as exc:  # the request's doing: not held against the worker
                record.outcome = RequestOutcome.UPSTREAM_ERROR
                raise UpstreamError(f"The answer is larger than this gateway relays without streaming "
                                    f"({state.config.max_body_bytes} bytes); ask for fewer tokens or "
                                    f"completions, or stream it.") from exc
            except Exception as exc:
                record.outcome = RequestOutcome.UPSTREAM_ERROR
                ended(f"broken answer: {exc}")
                raise UpstreamError(f"The inference server failed while sending its answer ({exc}).") from exc
            ended(None)
            return BufferedResponse(200, answer, content_type, passed)
        finally:
            if not lease.handed_over:  # the slot first (a waiter may take it), then the connection
                lease.release()
                if lease.response is not None:  # closing is idempotent: first_content may have closed it
                    await lease.response.aclose()

    def attempt_cut_by_cap(self, record: RequestRecord) -> None:
        """Account for the attempt the overall cap (`timeouts.total`) cut: counted as a `timeout`;
        held against its worker only for a stream whose engine had not even sent headers (a
        streaming engine answers them at once, so it hangs; a non-streaming answer's headers come
        with its last byte, so a long generation and a hang look the same)."""
        worker = record.open_attempt
        if worker is None:
            return
        record.open_attempt = None
        record.reached_engine = True  # the engine may have been working on it all along
        self.state.metrics.upstream_attempts.labels(worker.pool, worker.id, Outcome.TIMEOUT).inc()
        if record.trace is not None:
            record.trace.end_attempt(Outcome.TIMEOUT)
        if record.stream and not record.attempt_answered:
            self.state.registry.request_failed(worker, "no response headers within the overall cap")

    def _exhausted(self, last: AttemptFailed | None, record: RequestRecord, pools: list[PoolConfig],
                   failures: Failures) -> GatewayError:
        """The error for a request no worker accepted, naming the pool it was meant for (`pools[0]`),
        the pools it spilled over to and why no worker took it."""
        where = f"pool {pools[0].name}"
        if record.pool != pools[0].name:
            where += f" (and the pools it spilled over to, up to {record.pool})"
        if last is None or last.outcome in (Outcome.CONNECT_ERROR, Outcome.MOVED):
            wait, cause, busy = self._unavailable(pools)
            if last is not None:
                cause = f"{last.detail}; {cause}"
            return NoCapacity(f"No inference server of {where} can take the request now ({cause}); "
                              f"try again in {wait} s.", headers={"retry-after": str(wait)},
                              code="upstream_overloaded" if busy else None)
        if last.outcome is Outcome.TIMEOUT:
            # A non-streaming one spent its whole answer budget on each worker: the SDK must not resend it.
            return UpstreamTimeout(f"The inference server of {where} did not answer in time ({last.detail}).",
                                   headers=None if record.stream else dict(NO_CLIENT_RETRY))
        if last.outcome is Outcome.STATUS_429:
            busy = failures.busy or last
            wait = max(1, math.ceil(busy.retry_after if busy.retry_after is not None else DEFAULT_RETRY_AFTER_S))
            return NoCapacity(f"Every inference server of {where} is busy (HTTP 429); try again in {wait} s.",
                              headers={**busy.headers, "retry-after": str(wait)}, code="upstream_overloaded")
        return UpstreamError(f"The inference servers of {where} failed to answer ({last.detail}) after "
                             f"{record.attempts} attempt{'s' if record.attempts != 1 else ''}.")

    def _unavailable(self, pools: list[PoolConfig]) -> tuple[int, str, bool]:
        """For a request that found no candidate: the shortest honest wait in whole seconds (the
        soonest a worker of its pools is back: a 429's back-off or an ejection ending, or the
        next health probe for an unhealthy one; at least 1), the workers' states as the cause,
        and whether every worker out of service is only busy (429 back-offs)."""
        registry = self.state.registry
        now = registry.clock()
        waits: list[float] = []
        states: list[str] = []
        busy = 0
        for pool in pools:
            if pool.name not in registry.pools:  # the request's pools are those of its arrival
                states.append(f"pool {pool.name} removed by a reload")
                continue
            for worker in registry.pools[pool.name]:
                if worker.draining:
                    states.append(f"{worker.id} draining")
                    continue
                if not worker.healthy:
                    waits.append(registry.health.interval)
                    state = "unhealthy"
                elif worker.misconfigured is not None:
                    waits.append(registry.health.interval)
                    state = f"misconfigured ({worker.misconfigured})"
                elif worker.ejected_until > now:
                    waits.append(worker.ejected_until - now)
                    state = "ejected"
                elif worker.busy_until > now:
                    waits.append(worker.busy_until - now)
                    state = "busy (429)"
                    busy += 1
                else:
                    waits.append(0.0)
                    state = "tried"
                states.append(f"{worker.id} {state}" + (f": {worker.last_error}" if worker.last_error else ""))
        shown = "; ".join(states[:8]) + (f"; and {len(states) - 8} more" if len(states) > 8 else "")
        return max(1, math.ceil(min(waits, default=1.0))), shown or "no workers", 0 < busy == len(states)


def _relayed_content_type(response: UpstreamResponse, stream: bool) -> bytes:
    """The content type the client gets for an engine's 200: the API's own (`text/event-stream` for a
    stream, `application/json` otherwise), never the engine's text. Raises AttemptFailed
    (protocol_error: tried elsewhere, held against the worker) for any other declared type, so an
    engine's `text/html` is never served from the gateway's origin."""
    declared = response.headers.get("content-type", "" if stream else "application/json")
    if declared.partition(";")[0].strip().lower() == ("text/event-stream" if stream else "application/json"):
        return SSE_CONTENT_TYPE if stream else JSON_CONTENT_TYPE
    raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered 200 with content type {declared[:60]!r}")


def quota_used(record: RequestRecord, request: RoutingRequest, reserved: int, failed: bool) -> int | None:
    """The tokens a request that ended (`failed`: with an error, or a stream cut short) counts
    against its key's token limit: the engine's usage (prompt + completion tokens) when it
    reported one; the reservation when the client hung up, or a complete answer came without
    usage (nothing to settle by); the prompt estimate when an engine accepted the request (or
    may have been working on it) and it failed later; None, "release it all", when no engine
    worked on it (refused connections, 5xx/429 answers, an engine's 4xx, no worker free)."""
    usage = record.usage
    if usage is not None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            return prompt + completion
    if record.disconnect_stage is not None or (record.reached_engine and not failed):
        return reserved
    if record.reached_engine:
        return request.batch_prompt_tokens if request.batch_prompt_tokens is not None else request.prompt_tokens
    return None


class PoolStep(StrEnum):
    """What the dispatch loop does next (`choose_pool`); a spill-over's value is its metric reason."""

    ROUTE = "route"  # choose among the pool's candidates with room
    UNAVAILABLE = "unavailable"  # spill over to the next pool: this one has no candidate left
    SATURATED = "saturated"  # spill over to a later pool with room: this one is at its limits
    WAIT = "wait"  # queue for a slot of this pool (no later pool has room either)
    EXHAUSTED = "exhausted"  # no candidate here, and no later pool to spill over to


def choose_pool(registry: WorkerRegistry, pool: PoolConfig, pools: list[PoolConfig],
                tried: Collection[Worker]) -> tuple[PoolStep, PoolConfig, list[Worker]]:
    """One step of choosing where a request goes, from the pool it is in (`pool`, one of `pools`,
    the fitting pools smallest first): the step, the pool it leads to (the next pool on a
    spill-over, else `pool`) and, for ROUTE, the candidates (not yet `tried`) with room. A pool
    spills over only with `spillover` set; "unavailable" goes to the next pool (whose own
    candidates are looked at in the next step), "saturated" to the first later pool with room."""
    workers = registry.candidates(pool.name, tried)
    later = pools[pools.index(pool) + 1:] if pool.spillover else []
    if not workers:
        return (PoolStep.UNAVAILABLE, later[0], workers) if later else (PoolStep.EXHAUSTED, pool, workers)
    gate = registry.gates[pool.name]
    if gate.limited and not (workers := gate.with_room(workers)):
        roomy = next((p for p in later if registry.gates[p.name].with_room(registry.candidates(p.name, tried))), None)
        return (PoolStep.SATURATED, roomy, workers) if roomy is not None else (PoolStep.WAIT, pool, workers)
    return PoolStep.ROUTE, pool, workers


def decide(policy: RoutingPolicy, request: RoutingRequest, workers: list[Worker],
           match: Mapping[str, float]) -> Decision:
    """The pool policy's choice among `workers` (candidates with room), each seen with its load,
    KV cache usage and the share of the prompt it holds (`match`: worker URL -> 0..1, from the
    affinity store; the matched tokens are that share of the estimated prompt tokens)."""
    candidates = [Candidate(w, w.load(), w.kv_usage, match.get(w.url, 0.0),
                            int(match.get(w.url, 0.0) * request.prompt_tokens)) for w in workers]
    return policy.select(request, candidates)


def engine_body(bodies: dict[tuple[str, bool, bool], bytes], payload: Payload, api: Api, served_name: str,
                  worker: Worker, patch_usage: bool) -> bytes:
    """The engine's request body for `worker`: the payload encoded with the pool's served model
    name, the usage patch, and `max_tokens` for engines without `max_completion_tokens` on `api`;
    encoded once per distinct form (`bodies` caches them for the request's later attempts)."""
    key = (served_name, patch_usage, api not in worker.engine.max_completion_tokens_apis)
    body = bodies.get(key)
    if body is None:
        body = bodies[key] = encode_for(payload, *key)
    return body


def after_failure(registry: WorkerRegistry, failure: AttemptFailed, worker: Worker, pool: PoolConfig,
                  pools: list[PoolConfig], request: RoutingRequest, record: RequestRecord,
                  too_long_retried: bool, failures: Failures) -> PoolConfig | BufferedResponse:
    """What a failed attempt leads to: the pool to try next (the same one, or the next larger
    one once after an engine's "too long"), or the engine's own error for the client, also
    when a second worker failed exactly as the one before (the request's fault, held
    against neither). Passive health: a 429 backs its worker off, a refused connection or a 5xx
    that is the worker's own counts against it (`failures` holds a 5xx until the next attempt
    tells whether the request caused it).

    Raises UpstreamError / UpstreamTimeout for failures no other worker should repeat.
    """
    outcome = failure.outcome
    if outcome is Outcome.TOO_LONG:
        larger = larger_pools(pool, pools)
        if too_long_retried or not larger:
            return engine_error(failure, record)
        return larger[0]
    if outcome is Outcome.AUTH_ERROR:
        raise UpstreamError(f"The inference server of pool {pool.name} refused the gateway's "
                            "credentials; check the pool's api_key.")
    if outcome is Outcome.TIMEOUT and not request.stream and failure.answered:
        # The engine was generating (it had answered): do not make another one repeat it.
        raise UpstreamTimeout(f"The inference server did not answer in time ({failure.detail}).",
                              headers=dict(NO_CLIENT_RETRY))
    if outcome not in RETRYABLE:
        return engine_error(failure, record)
    if outcome is Outcome.STATUS_429:  # busy, not broken
        registry.throttled(worker, failure.retry_after)
        failures.note_busy(failure)
    elif outcome is Outcome.CONNECT_ERROR:
        registry.connect_failed(worker, failure.detail)
    elif outcome is Outcome.MOVED:  # a moved attempt's worker is already marked unhealthy
        pass
    elif _may_be_the_requests_fault(failure):
        suspect = failures.suspect
        if suspect is not None and suspect[0] is not worker and _same_failure(suspect[1], failure):
            failures.suspect = None  # two workers, one answer: the request's doing
            return request_fault(failure, record)
        failures.charge(registry)  # the earlier one differed: that worker's own failure
        failures.suspect = (worker, failure)
    else:
        registry.request_failed(worker, failure.detail)
    return pool


def upstream_headers(pool: PoolConfig, worker: Worker, record: RequestRecord) -> dict[str, str]:
    """The headers of the engine request: JSON, the request id, the trace context (opening the
    attempt's span when tracing is on) and the pool's bearer credential."""
    headers = {"content-type": "application/json", "x-request-id": record.request_id}
    if record.trace is not None:
        headers.update(record.trace.start_attempt(pool.name, worker.id))
    if pool.api_key is not None:
        headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
    return headers


def timed_out(moved: bool, answered: bool, header_wait: float, budget: float) -> AttemptFailed:
    """The failure of an attempt whose wait ran out: `moved` (its worker failed a health probe,
    which ends the wait at once), no response headers within `header_wait` seconds, or (`answered`)
    no first content within `budget` seconds (the engine was working on it)."""
    if moved:
        return AttemptFailed(Outcome.MOVED, "its health probe failed before it answered")
    if not answered:
        return AttemptFailed(Outcome.TIMEOUT, f"no response headers within {header_wait:.1f}s")
    return AttemptFailed(Outcome.TIMEOUT, f"no first content within {budget:.1f}s", answered=True)


def engine_error(failure: AttemptFailed, record: RequestRecord) -> BufferedResponse:
    """Pass an engine's own 4xx answer to the client, as an OpenAI error object. An engine's
    "too long" names the request's prompt as `param` (`messages`, or `prompt` on completions),
    as OpenAI's context_length_exceeded does; the engines name other things or nothing."""
    status = failure.status or 502
    record.status = status
    record.error = failure.detail
    too_long = failure.outcome is Outcome.TOO_LONG
    param = {"chat": "messages", "responses": "input"}.get(record.api, "prompt") if too_long else None
    body = error_bytes_from_upstream(status, failure.body, "context_length_exceeded" if too_long else None, param)
    return BufferedResponse(status, body, b"application/json", route_headers(record))


def request_fault(failure: AttemptFailed, record: RequestRecord) -> BufferedResponse:
    """The engine's error for a request two workers failed the same way: passed on as the
    engine gave it, with `x-should-retry: false` (the OpenAI SDKs then do not resend it)."""
    response = engine_error(failure, record)
    record.error = f"two workers failed the request the same way ({failure.detail}): the request's fault"
    response.headers.append((b"x-should-retry", b"false"))
    return response


def route_headers(record: RequestRecord) -> Headers:
    """The `x-kimi-gateway-*` headers that tell the client where its request went and why."""
    headers = [(b"x-kimi-gateway-pool", record.pool.encode()),
               (b"x-kimi-gateway-attempts", str(record.attempts).encode())]
    if record.worker:
        headers.append((b"x-kimi-gateway-worker", record.worker.encode()))
    if record.reason:
        headers.append((b"x-kimi-gateway-route-reason", record.reason.encode()))
    if record.estimated_prompt_tokens is not None:
        headers.append((b"x-kimi-gateway-estimated-prompt-tokens",
                        f"{record.estimated_prompt_tokens}; method={record.estimate_method}".encode()))
    return headers


@dataclass(slots=True)
class Failures:
    """What a request's failed attempts showed that one attempt cannot judge alone.

    `suspect` is a 5xx not yet held against its worker: if the next worker fails the same way,
    the request caused both (a client must never be able to eject a pool); otherwise it is
    charged (`charge`). `busy` is the 429 with the shortest Retry-After.
    """

    suspect: tuple[Worker, AttemptFailed] | None = None
    busy: AttemptFailed | None = None

    def charge(self, registry: WorkerRegistry) -> None:
        """Hold the suspect 5xx against its worker after all (passive health)."""
        if self.suspect is not None:
            worker, failure = self.suspect
            self.suspect = None
            registry.request_failed(worker, failure.detail)

    def note_busy(self, failure: AttemptFailed) -> None:
        def wait(f: AttemptFailed) -> float:
            return DEFAULT_RETRY_AFTER_S if f.retry_after is None else f.retry_after
        if self.busy is None or wait(failure) < wait(self.busy):
            self.busy = failure


# 502/503/504 say "busy or broken in between", never "this request": they are not compared.
_NOT_THE_REQUEST = frozenset({502, 503, 504})
_VOLATILE = re.compile(rb"[0-9a-fA-F][0-9a-fA-F-]{15,}")  # request ids, UUIDs: differ per attempt
# Base62 request ids (`req_7Hk2LpQ9xZ`), timestamps and epoch seconds differ per attempt too: any
# word of 8+ id/time characters holding a digit (short numbers like "worker 1" still tell causes apart).
_ID_LIKE = re.compile(rb"[A-Za-z0-9_.:+-]{8,}")


def _may_be_the_requests_fault(failure: AttemptFailed) -> bool:
    return failure.outcome is Outcome.STATUS_5XX and failure.status not in _NOT_THE_REQUEST


def _same_failure(first: AttemptFailed, second: AttemptFailed) -> bool:
    """Two engine answers with the same status and the same error body (ids aside)."""
    return first.status == second.status and _without_ids(first.body) == _without_ids(second.body)


def _without_ids(body: bytes) -> bytes:
    body = _VOLATILE.sub(b"#", body)
    return _ID_LIKE.sub(lambda m: b"#" if any(48 <= c <= 57 for c in m[0]) else m[0], body)


def _passed_headers(response: UpstreamResponse) -> Headers:
    """Upstream headers the client needs besides content-type (an encoding the engine applied).
    Raises AttemptFailed (protocol_error) for an encoding that is not an HTTP token."""
    encoding = response.headers.get("content-encoding")
    if not encoding:
        return []
    if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,40}", encoding.strip()):  # RFC 9110 token
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered with content encoding {encoding[:60]!r}")
    return [(b"content-encoding", encoding.strip().encode("ascii"))]


def _check_json_answer(content: bytes, content_type: bytes) -> dict[str, Any] | None:
    """The usage of a non-streaming JSON answer; ValueError when the JSON is cut or broken."""
    if b"json" not in content_type:
        return None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"its JSON answer is incomplete or invalid: {exc}") from None
    usage = data.get("usage") if isinstance(data, dict) else None
    return chat_usage(usage) if isinstance(usage, dict) else None


def response_id_in_json(body: bytes) -> str | None:
    """The `id` of a Responses API JSON answer; None when there is none or it is not JSON."""
    try:
        return response_id_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
