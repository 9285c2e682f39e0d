"""The request sequence (design §2), orchestration only: parse → features → pool → worker → upstream.

`ProxyService.handle` returns a `BufferedResponse` (errors, non-streaming answers) or a
`RelayResponse` (an accepted stream) and raises GatewayError for the client's mistakes and for
exhausted upstreams. Failover happens only before the engine's first body byte.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.affinity.hashing import longest_match
from gateway.auth.keys import Principal
from gateway.backends.client import UpstreamResponse, first_byte_budget, request_timeout
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
from gateway.record import RequestRecord
from gateway.routing.features import Api, RoutingRequest
from gateway.routing.policy import Candidate
from gateway.routing.pools import fitting_pools, larger_pools
from gateway.state import AppState
from gateway.streaming import (
    RETRYABLE,
    AnswerTooLarge,
    AttemptFailed,
    Lease,
    Outcome,
    UpstreamStream,
    early_stream_error,
    first_chunk,
    mark_first_byte,
    open_upstream,
    read_rest,
)

UPSTREAM_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

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
        self._served = {p.name: p.served_model_name or config.model.name for p in config.pools}
        self.parser = BodyParser(config, state.estimator, state.hasher)

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
        (429) or RateLimitUnavailable (503) when refused.
        """
        guard = self.state.auth if principal is not None else None
        if guard is not None:
            assert principal is not None
            await guard.count_request(principal)  # before any parsing, measuring or image fetch
        payload, request = await self.parse(api, body, headers)
        record.stream = request.stream
        record.estimated_prompt_tokens = request.prompt_tokens
        record.estimate_method = request.estimate_method
        pools = fitting_pools(request, self.state.config.pools)
        if guard is not None:
            assert principal is not None
            await guard.check_quota(principal, request.quota_tokens(pools[0].default_output_tokens), requests=0)
        return await self._dispatch(api, payload, request, pools, record)

    async def _dispatch(self, api: Api, payload: Payload, request: RoutingRequest,
                        pools: list[PoolConfig], record: RequestRecord) -> BufferedResponse | RelayResponse:
        state = self.state
        metrics = state.metrics
        pool = pools[0]
        record.pool = pool.name
        metrics.estimated_prompt_tokens.labels(pool.name, request.estimate_method).observe(request.prompt_tokens)
        tried: set[Worker] = set()
        too_long_retried = False
        last: AttemptFailed | None = None
        matches: dict[str, dict[str, float]] = {}  # pool -> worker URL -> matched share of the prompt
        bodies: dict[tuple[str, bool], bytes] = {}  # (served model name, usage patch) -> upstream body
        queue_deadline: float | None = None  # set when the request first waits for a slot
        while record.attempts < state.config.max_attempts:
            workers = state.registry.candidates(pool.name, tried)
            later = pools[pools.index(pool) + 1:] if pool.spillover else []
            if not workers:
                if not later:
                    break
                metrics.spillovers.labels(pool.name, later[0].name, "unavailable").inc()
                pool = later[0]
                record.pool = pool.name
                continue
            gate = state.registry.gates[pool.name]
            if gate.limited and not (workers := gate.with_room(workers)):
                roomy = next((p for p in later if state.registry.gates[p.name].with_room(
                    state.registry.candidates(p.name, tried))), None)
                if roomy is not None:
                    metrics.spillovers.labels(pool.name, roomy.name, "saturated").inc()
                    pool = roomy
                    record.pool = pool.name
                else:
                    if queue_deadline is None:
                        queue_deadline = time.monotonic() + gate.queue_timeout
                    await gate.wait_for_slot(queue_deadline)
                continue
            policy = state.router.policy(pool.name)
            if policy.uses_affinity and pool.name not in matches:
                matches[pool.name] = await self._affinity_matches(pool.name, request)
                # Others may have taken the free slots or broken workers meanwhile: look again. From
                # here to the attempt's Lease nothing awaits, so the room seen is the room taken.
                continue
            match = matches.get(pool.name, {})
            candidates = [Candidate(w, w.load(), w.kv_usage, match.get(w.url, 0.0),
                                    int(match.get(w.url, 0.0) * request.prompt_tokens)) for w in workers]
            decision = policy.select(request, candidates)
            worker = decision.worker
            record.attempts += 1
            record.worker, record.reason = worker.id, decision.reason
            metrics.route_decisions.labels(pool.name, decision.reason).inc()
            if last is not None:
                metrics.retries.labels(pool.name, last.outcome).inc()
            # Count a stream's tokens even when its client did not ask for usage (backends/patches.py).
            patch_usage = request.stream and not request.include_usage and worker.engine.supports_include_usage
            try:
                key = (self._served[pool.name], patch_usage)
                if key not in bodies:
                    bodies[key] = encode_for(payload, *key)
                record.open_attempt, record.attempt_answered = worker, False
                result = await self._attempt(api, pool, worker, bodies[key], request, record, patch_usage)
                record.open_attempt = None
            except AttemptFailed as failure:
                record.open_attempt = None
                metrics.upstream_attempts.labels(pool.name, worker.id, failure.outcome).inc()
                if record.trace is not None:
                    record.trace.end_attempt(failure.outcome)
                tried.add(worker)
                last = failure
                step = self._after_failure(failure, worker, pool, pools, request, record, too_long_retried)
                if isinstance(step, BufferedResponse):
                    return step
                if step is not pool:
                    metrics.spillovers.labels(pool.name, step.name, "too_long").inc()
                    too_long_retried = True
                    pool = step
                    record.pool = pool.name
                continue
            metrics.upstream_attempts.labels(pool.name, worker.id, Outcome.OK).inc()
            if record.trace is not None:
                record.trace.end_attempt(Outcome.OK)
            if policy.uses_affinity and request.prefix is not None and state.affinity is not None:
                metrics.affinity_match_ratio.labels(pool.name).observe(match.get(worker.url, 0.0))
                # After this task next yields, i.e. once the first chunk went out: never before the first token.
                asyncio.get_running_loop().call_soon(state.affinity.record, pool.name, request.prefix.hashes,
                                                     worker.url)
            result.headers.extend(self._route_headers(record))
            return result
        raise self._exhausted(last, record)

    def _after_failure(self, failure: AttemptFailed, worker: Worker, pool: PoolConfig, pools: list[PoolConfig],
                       request: RoutingRequest, record: RequestRecord,
                       too_long_retried: bool) -> PoolConfig | BufferedResponse:
        """What a failed attempt leads to: the pool to try next (the same one, or the next larger
        one once after an engine's "too long"), or the engine's own error for the client.

        Raises UpstreamError / UpstreamTimeout for failures no other worker should repeat.
        """
        outcome = failure.outcome
        if outcome is Outcome.TOO_LONG:
            larger = larger_pools(pool, pools)
            if too_long_retried or not larger:
                return self._engine_error(failure, record)
            return larger[0]
        if outcome is Outcome.AUTH_ERROR:
            raise UpstreamError(f"The inference server of pool {pool.name} refused the gateway's "
                                "credentials; check the pool's api_key.")
        if outcome is Outcome.TIMEOUT and not request.stream:
            # The engine may have been generating all along: do not make another one repeat it.
            raise UpstreamTimeout(f"The inference server did not answer in time ({failure.detail}).")
        if outcome not in RETRYABLE:
            return self._engine_error(failure, record)
        registry = self.state.registry
        if outcome is Outcome.STATUS_429:  # busy, not broken
            registry.throttled(worker, failure.retry_after)
        elif outcome is Outcome.CONNECT_ERROR:
            registry.connect_failed(worker, failure.detail)
        else:
            registry.request_failed(worker, failure.detail)
        return pool

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
        state = self.state
        headers = {"content-type": "application/json", "x-request-id": record.request_id}
        if record.trace is not None:
            headers.update(record.trace.start_attempt(pool.name, worker.id))
        if pool.api_key is not None:
            headers["authorization"] = f"Bearer {pool.api_key.get_secret_value()}"
        timeouts = state.config.timeouts
        timeout = request_timeout(timeouts, request.prompt_tokens, request.stream)
        lease = Lease(worker, state.metrics, state.registry.gates[pool.name])
        response = None
        try:
            keepalive = timeouts.keepalive_interval if request.stream else None
            # The whole wait for the first byte has its own budget: httpx's read timeout is per read
            # and must also allow a long prefill, so it cannot catch a worker that hangs quickly.
            budget = first_byte_budget(timeouts, request.prompt_tokens)
            if not request.stream:
                budget += timeouts.generation
            try:
                async with asyncio.timeout(budget):
                    response = await open_upstream(state.upstream, worker.url + UPSTREAM_PATHS[api], body, headers,
                                                   timeout)
                    record.attempt_answered = True
                    first, rest, pending = await first_chunk(response, keepalive)
            except TimeoutError:
                response = None  # first_chunk closed it
                raise AttemptFailed(Outcome.TIMEOUT, f"no first byte within {budget:.1f}s") from None
            content_type = _relayed_content_type(response, request.stream)
            passed = _passed_headers(response)
            record.status = response.status_code

            def ended(failure: str | None) -> None:
                """Passive health counts whole answers: a stream that breaks after its first byte too."""
                if failure is None:
                    state.registry.request_succeeded(worker)
                else:
                    state.registry.request_failed(worker, failure)

            if first is None:  # still prefilling: commit the stream and send keep-alives meanwhile
                stream = UpstreamStream(response, None, rest, lease, record, pending, keepalive or 0.0, ended,
                                        strip_usage)
                response = None
                return RelayResponse(stream, content_type, passed)
            mark_first_byte(record)
            if request.stream:
                if (early := early_stream_error(first)) is not None:
                    raise early
                stream = UpstreamStream(response, first, rest, lease, record, on_end=ended, strip_usage=strip_usage)
                response = None  # the stream owns it now
                return RelayResponse(stream, content_type, passed)
            try:
                content = await read_rest(response, first, rest, state.config.max_body_bytes)
                if not passed:  # an encoded (compressed) answer is relayed as it is
                    record.usage = _check_json_answer(content, content_type)
            except AnswerTooLarge as exc:  # the request's doing: not held against the worker
                record.outcome = "upstream_error"
                raise UpstreamError(f"The answer is larger than this gateway relays without streaming "
                                    f"({state.config.max_body_bytes} bytes); ask for fewer tokens or "
                                    f"completions, or stream it.") from exc
            except Exception as exc:
                record.outcome = "upstream_error"
                ended(f"broken answer: {exc}")
                raise UpstreamError(f"The inference server failed while sending its answer ({exc}).") from exc
            ended(None)
            lease.release()
            return BufferedResponse(200, content, content_type, passed)
        except BaseException:
            lease.release()
            raise
        finally:
            if response is not None:
                await response.aclose()

    def attempt_cut_by_cap(self, record: RequestRecord) -> None:
        """Account for the attempt the overall cap (`timeouts.total`) cut: counted as a `timeout`;
        held against its worker only for a stream whose engine had not even sent headers (a
        streaming engine answers them at once, so it hangs; a non-streaming answer's headers come
        with its last byte, so a long generation and a hang look the same)."""
        worker = record.open_attempt
        if worker is None:
            return
        record.open_attempt = None
        self.state.metrics.upstream_attempts.labels(worker.pool, worker.id, Outcome.TIMEOUT).inc()
        if record.trace is not None:
            record.trace.end_attempt(Outcome.TIMEOUT)
        if record.stream and not record.attempt_answered:
            self.state.registry.request_failed(worker, "no response headers within the overall cap")

    def _engine_error(self, failure: AttemptFailed, record: RequestRecord) -> BufferedResponse:
        """Pass an engine's own 4xx answer to the client, as an OpenAI error object."""
        status = failure.status or 502
        record.status = status
        record.error = failure.detail
        code = "context_length_exceeded" if failure.outcome is Outcome.TOO_LONG else None
        body = error_bytes_from_upstream(status, failure.body, code)
        return BufferedResponse(status, body, b"application/json", self._route_headers(record))

    def _exhausted(self, last: AttemptFailed | None, record: RequestRecord) -> GatewayError:
        """The error for a request no worker accepted."""
        if last is None or last.outcome in (Outcome.CONNECT_ERROR,):
            return NoCapacity(f"No healthy inference server is available for pool {record.pool}; try again shortly.",
                              headers={"retry-after": "1"})
        if last.outcome is Outcome.TIMEOUT:
            return UpstreamTimeout(f"The inference server did not answer in time ({last.detail}).")
        if last.outcome is Outcome.STATUS_429:
            retry = str(int(last.retry_after or 1))
            return NoCapacity("All inference servers are busy; try again shortly.", headers={"retry-after": retry},
                              code="upstream_overloaded")
        return UpstreamError(f"The inference servers failed to answer ({last.detail}) after {record.attempts} "
                             f"attempt{'s' if record.attempts != 1 else ''}.")

    @staticmethod
    def _route_headers(record: RequestRecord) -> Headers:
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


def _relayed_content_type(response: UpstreamResponse, stream: bool) -> bytes:
    """The content type the client gets for an engine's 200: the API's own (`text/event-stream` for a
    stream, `application/json` otherwise), never the engine's text. Raises AttemptFailed
    (protocol_error: tried elsewhere, held against the worker) for any other declared type, so an
    engine's `text/html` is never served from the gateway's origin."""
    declared = response.headers.get("content-type", "" if stream else "application/json")
    if declared.partition(";")[0].strip().lower() == ("text/event-stream" if stream else "application/json"):
        return SSE_CONTENT_TYPE if stream else JSON_CONTENT_TYPE
    raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"engine answered 200 with content type {declared[:60]!r}")


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
    return usage if isinstance(usage, dict) else None
