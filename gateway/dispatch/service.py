"""The request sequence (design §2), orchestration only: parse → features → pool → attempt → answer.

`ProxyService.handle` returns a `BufferedResponse` (errors, non-streaming answers) or a
`RelayResponse` (an accepted stream) and raises GatewayError for the client's mistakes and for
exhausted upstreams. Failover happens only before the engine's first body byte.

The dispatch loop, in named steps: choose the pool and its candidates with room
(`steps.choose_pool`: route, spill over, wait or give up), look up the prompt's prefix owners once
per pool, let the pool's kind make one attempt (`kinds.PoolKind`: the policy's decision and the
engine body), run it (`attempt.Attempt.run`) and judge a failed one (`failures.after_failure`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from dataclasses import replace

from gateway.affinity.hashing import longest_match, session_hash
from gateway.affinity.response_store import ResponseOwner
from gateway.auth.access import model_not_found_message
from gateway.auth.cache_isolation import SALTED_APIS, salts
from gateway.auth.keys import Principal
from gateway.auth.standing import RateLimitStanding
from gateway.backends.lora_loader import adapter_missing
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dialects.names import Api
from gateway.dialects.registry import dialect_for
from gateway.dispatch.answers import BufferedResponse, RelayResponse, response_id_in_json, route_headers
from gateway.dispatch.attempt import Attempt, silence_limit
from gateway.dispatch.context import Dispatch
from gateway.dispatch.failures import after_failure, exhausted
from gateway.dispatch.kinds import PINNED, kind_of
from gateway.dispatch.ledger import Ledger, context_used
from gateway.dispatch.migration import OPT_OUT_HEADER
from gateway.dispatch.migration import attach as attach_migration
from gateway.dispatch.steps import AffinityMatch, PoolStep, choose_pool
from gateway.errors import GatewayError, ModelNotFound, ModelNotPermitted
from gateway.flow.admission import Flow
from gateway.flow.priority import PRIORITY_APIS, client_value, engine_value, with_priority, without_scheduling_fields
from gateway.parsing import Body, BodyParser, Payload, with_engine_output_limit, with_output_limit, with_salt
from gateway.routing.features import SESSION_HEADERS, RoutingRequest, scoped_session, session_hint
from gateway.routing.pools import fitting_pools, output_room, skipped_pools
from gateway.routing.response_affinity import follow_up_of
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Outcome


def with_standing(result: BufferedResponse | RelayResponse,
                  standing: RateLimitStanding | None) -> BufferedResponse | RelayResponse:
    """`result` with the key's rate-limit headers (`standing`) when it is a served answer (a stream,
    or a buffered answer below 400; an engine's error keeps its own, an engine's 429 its
    `x-ratelimit-*`)."""
    if standing is not None and (isinstance(result, RelayResponse) or result.status < 400):
        result.headers.extend(standing.header_list())
    return result


class ProxyService:
    """Routes and proxies the proxied APIs' requests (chat, completions, messages, responses) for one AppState."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        config = state.config
        self._parser = BodyParser(config, state.estimator, state.hasher)
        self._salts = (config.auth, salts(config.auth))

    @property
    def parser(self) -> BodyParser:
        """The body parser for the running config (a reload replaces `state.config`)."""
        if self._parser.config is not self.state.config:
            self._parser = BodyParser(self.state.config, self.state.estimator, self.state.hasher)
        return self._parser

    def salt_of(self, api: Api, principal: Principal | None) -> str | None:
        """The `cache_salt` the gateway sets for `principal`'s request on `api` (`auth.cache_isolation`,
        gateway/auth/cache_isolation.py); None: the body's own (isolation off, no key, an API whose
        engines cache nothing reusable)."""
        auth = self.state.config.auth
        if self._salts[0] is not auth:  # a reload
            self._salts = (auth, salts(auth))
        if principal is None or api not in SALTED_APIS:
            return None
        return self._salts[1].get(principal.name)

    async def parse(self, api: Api, body: Body, headers: Mapping[str, str],
                    allowed: Collection[str] | None = None, salt: str | None = None) -> tuple[Payload, RoutingRequest]:
        """Validate the body and build its routing features. Raises InvalidRequest, ModelNotFound,
        ContextLengthExceeded (also from a cheap lower bound of its tokens, before validation), and
        ModelNotPermitted for a model not in `allowed` (the key's models; None: all), as soon as
        the model is known: before its tokens are estimated or its image URLs fetched
        (`BodyParser.validate`). With `salt`, the body's `cache_salt` is set to it (`salt_of`)
        before it is validated, so the prefix hashes and the engine's cache are partitioned alike.

        A body over `parse_offload_bytes`, or with more than `parse_offload_items` items, is parsed
        in a parse process (`gateway/parsing.py`), so the event loop keeps serving meanwhile; its
        payload is then a `ForwardBody`, the engine's body already encoded.
        With `image_fetch.enabled`, the chat request's http(s) image URLs are fetched first to
        measure their pixel size (`ImageFetcher.measure`: bounded in time, never failing the request).
        """
        state, parser = self.state, self.parser
        session = session_hint(*map(headers.get, SESSION_HEADERS))
        if isinstance(body, bytes) and len(body) <= state.config.parse_offload_bytes:
            payload, items = parser.decode(api, body)
            if items <= state.config.parse_offload_items:
                payload = with_salt(payload, salt)
                wire, model, urls = parser.validate(api, payload, state.registry.adapter_names(), allowed)
                measured = await state.images.measure(urls) if state.images is not None and urls else None
                return payload, parser.features(wire, model, session, measured)
        parsed = await state.parse_pool.parse(api, body, session,
                                              state.images.measure if state.images is not None else None,
                                              state.registry.adapter_names(), allowed, salt)
        assert parsed.request is not None and parsed.forward is not None
        return parsed.forward, parsed.request

    async def handle(self, api: Api, body: Body, headers: Mapping[str, str], ledger: Ledger,
                     principal: Principal | None = None) -> BufferedResponse | RelayResponse:
        """The whole request path up to an accepted upstream (or a final error).

        `principal` is the authenticated caller (auth on): one request is counted against its
        request limit before the body is even parsed (so invalid or oversized bodies are not free
        and a key over its limit fetches no image URL); a model the key may not use is 404
        `model_not_found` as soon as the body names it (`ModelNotPermitted`: the answer of an
        unknown model, before any estimate; counted as `AuthGuard.refused_model`); its token limit
        is charged the request's estimated prompt tokens + its output limit (else the first fitting
        pool's reservation) times the completions it asks for (`RoutingRequest.quota_tokens`)
        before routing, the prompt of a Responses follow-up including the stored conversation the
        engine prefills before its new input (`follow_up_of`); RateLimited (429) or
        RateLimitUnavailable (503) when refused (the key's limits on the request's model too,
        `model_limits`). A key with a token limit (its own or the model's) whose request sets no
        output limit has the reserved one written into the engine's body
        (`parsing.with_output_limit`), and a client's llama.cpp `n_predict` is set to it
        (`parsing.with_engine_output_limit`), so the engine cannot generate past what was charged. The
        charge is settled when the request ends (`quota_used`): at once for an answer or error given
        here, at the ledger's finish for a stream. A limited key's served answer (and its 429) carries
        what is left of its limits, in the API's rate-limit headers (`auth/standing.py`).

        A request naming a LoRA adapter no candidate worker has loads it only once nothing before
        its engine can refuse it any more (`_adapter_ready`: after the key's limits and a follow-up's
        owner), and is charged for that load; a token count never loads one. A key without
        `client_priority` has its body's scheduling fields (`priority`, SGLang's DP ranks) stripped;
        with flow control on a pool of the chain, its flow and band are named here
        (`FlowControl.flow_of`).
        """
        guard = self.state.auth if principal is not None else None
        dialect = dialect_for(api)
        generates = dialect.generates  # False: count_tokens
        counted = None
        standing = None
        if guard is not None:
            assert principal is not None
            if not generates:  # their own request limit (no tokens), first: a refusal costs no request
                await guard.count_counting(principal)
            standing = RateLimitStanding(dialect.rate_limit_headers)
            counted = await guard.count_request(principal, standing)  # before any parsing, measuring or image fetch
        try:
            payload, request = await self.parse(api, body, headers, principal.models if principal is not None else None,
                                                self.salt_of(api, principal))
        except ModelNotPermitted as refused:
            if guard is not None:
                guard.refused_model()
            ledger.refused_model(refused.model)
            raise
        if request.session_key is not None:  # one API key's hints never meet another's
            request = replace(request, session_key=scoped_session(
                request.session_key, principal.name if principal is not None else None, request.adapter))
        ledger.parsed(request)
        serving = self._adapter_pools(request.adapter) if request.adapter else self.parser.chains[request.model]
        pools = fitting_pools(request, serving)
        if len(pools) < len(serving):
            ledger.skipped(skipped_pools(request, serving) or None)
        pinned: Worker | None = None
        if request.previous_response_id is not None:  # only the worker storing its history can serve it
            pool, pinned, history = await follow_up_of(request.previous_response_id, self.state.responses,
                                                       self.state.registry, self.state.config.pools,
                                                       self.state.metrics, principal)
            pools = [pool]
            if history:  # the engine prefills the stored conversation before the new input
                request = replace(request, prompt_tokens=request.prompt_tokens + history)
                ledger.history_counted(request)
        migrate = headers.get(OPT_OUT_HEADER, "").strip().lower() != "off"
        flows, config = self.state.flow, self.state.config
        if principal is not None and not flows.client_priority(config, principal):
            payload = without_scheduling_fields(payload)  # the gateway's to set (gateway/flow/priority.py)
        flow = flows.flow_of(config, principal, headers) if generates and any(  # count_tokens: never held
            p.flow_control.enabled or p.flow_control.engine_priority for p in pools) else None
        size = len(body)
        if guard is None:
            return await self._dispatch(api, payload, request, pools, ledger, pinned, migrate, flow, size)
        assert principal is not None
        default_output, room = pools[0].default_output_tokens, output_room(pools[0], request)
        if principal.limits_tokens(request.model) and generates:
            # What is reserved bounds what the engine may generate: it gets that output limit, in
            # llama.cpp's own `n_predict` too when the client sent one (that server ranks it first).
            out = request.reserved_output(default_output, room)
            if request.output_tokens is None:
                payload, request = with_output_limit(payload, api, out), replace(request, output_tokens=out)
            payload = with_engine_output_limit(payload, out)
        reservation = await guard.check_quota(principal, request.quota_tokens(default_output, room), requests=0,
                                              counted=counted, model=request.model, counting=not generates,
                                              standing=standing)
        if reservation is None:
            return with_standing(await self._dispatch(api, payload, request, pools, ledger, pinned, migrate, flow,
                                                      size), standing)
        ledger.hold_quota(guard, reservation, request)
        try:
            result = await self._dispatch(api, payload, request, pools, ledger, pinned, migrate, flow, size)
        except GatewayError:
            await ledger.settle_quota(failed=True)
            raise
        if isinstance(result, BufferedResponse):
            await ledger.settle_quota(result.status >= 400)
        return with_standing(result, standing)

    async def _adapter_ready(self, api: Api, request: RoutingRequest, pools: list[PoolConfig], ledger: Ledger,
                             pinned: Worker | None) -> tuple[RoutingRequest, list[PoolConfig]]:
        """A request for LoRA adapter `request.adapter` about to be dispatched (past every refusal the
        gateway gives before an engine): where no candidate worker of `pools` (or `pinned`, a
        follow-up's owner) has the adapter and a pool loads it on demand, it is loaded now and the
        request charged for it (`Ledger.adapter_loaded`). A token count (an API that generates
        nothing) never loads one: where none has it, it is counted as the adapter's base model
        (`_counted_as_base`). Returns the request and pools to dispatch. Raises what
        `LoraLoader.ensure` raises."""
        adapter, lora = request.adapter, self.state.lora
        assert adapter is not None
        if not dialect_for(api).generates:
            return (request, pools) if lora.loaded_somewhere(adapter, pools, pinned) else \
                self._counted_as_base(request, pools)
        if await lora.ensure(adapter, pools, pinned):
            ledger.adapter_loaded()
        return request, pools

    def _counted_as_base(self, request: RoutingRequest, pools: list[PoolConfig]) -> tuple[RoutingRequest,
                                                                                          list[PoolConfig]]:
        """A token count for an adapter no worker has loaded, sent as its base model (the first model
        one of `pools` serves, as `/v1/models` names its `parent`) to those of `pools` serving it: an
        adapter has its base model's tokenizer and chat template (vLLM renders and counts every
        request with the one renderer, vllm/entrypoints/anthropic/serving.py `count_tokens`; SGLang
        tokenizes with its tokenizer manager's), so the count is the adapter's."""
        config = self.state.config
        for model in config.served_models():
            chain = {p.name for p in config.model_pools(model.name)}
            base = [p for p in pools if p.name in chain]
            if base:
                return replace(request, adapter=None, model=model.name), base
        return request, pools

    def _adapter_pools(self, adapter: str) -> list[PoolConfig]:
        """The pools serving LoRA `adapter` (declared, or listed by one of their workers), in config
        order. Raises ModelNotFound when none does any more (its workers unloaded it meanwhile)."""
        registry = self.state.registry
        pools = [p for p in self.state.config.pools if registry.serves_adapter(p.name, adapter)]
        if not pools:
            raise ModelNotFound(model_not_found_message(adapter), param="model")
        return pools

    async def _dispatch(self, api: Api, payload: Payload, request: RoutingRequest, pools: list[PoolConfig],
                        ledger: Ledger, pinned: Worker | None = None, migrate: bool = True,
                        flow: Flow | None = None, size: int = 0) -> BufferedResponse | RelayResponse:
        """Dispatch a parsed request to its fitting `pools` (smallest first): one `Dispatch` state
        for its way through them, and a held 5xx verdict settled however it ends. With `pinned`
        (a Responses follow-up's owner; `pools` is then its pool alone) only that worker is tried.
        `migrate`: its stream may be continued on another worker after a mid-stream failure.
        `flow`: its flow and band when a pool of its chain has flow control on; `size`: its body's bytes."""
        state = self.state
        if request.adapter is not None:
            request, pools = await self._adapter_ready(api, request, pools, ledger, pinned)
        pool = pools[0]
        ledger.in_pool(pool.name, request)
        dispatch = Dispatch(state, api, payload, request, ledger, pools, pool, pinned=pinned, migrate=migrate,
                            flow=flow, size=size)
        try:  # a 5xx whose verdict waited for the next attempt is settled however the request ends
            return await self._dispatch_loop(dispatch)
        finally:
            dispatch.failures.charge(ledger)
            if dispatch.admission is not None:
                dispatch.admission.done()

    async def _dispatch_loop(self, dispatch: Dispatch) -> BufferedResponse | RelayResponse:
        """Until an attempt is accepted or `max_attempts` ran out: choose the pool and its candidates
        with room (`choose_pool`), spill over or wait for a slot when it has none, look up the
        prefix owners once per pool, make the pool kind's attempt and run it, and judge a failed
        one (`_attempt_failed`): same pool, a larger one, or a final answer. A pinned request
        (`Dispatch.pinned`) makes one attempt on its worker (`kinds.PINNED`), whatever the policy."""
        state, ledger = self.state, dispatch.ledger
        record = ledger.record
        reloaded = False  # the request's adapter was found gone on its worker and loaded again (once)
        while record.attempts < state.config.max_attempts:
            pool = dispatch.pool
            if dispatch.pinned is not None:
                if dispatch.tried:  # no other worker holds what it needs
                    break
                step, to, workers = PoolStep.ROUTE, pool, [dispatch.pinned]
            else:
                step, to, workers = choose_pool(state.registry, pool, dispatch.pools, dispatch.tried,
                                                dispatch.request.adapter)
            if step is PoolStep.EXHAUSTED:
                break
            if step is PoolStep.WAIT:
                await self._wait_for_slot(dispatch)
                continue
            if step is not PoolStep.ROUTE:  # spill over: unavailable or saturated
                ledger.spilled(pool.name, to.name, step.value)
                dispatch.move_to(to)
                continue
            if dispatch.flow is not None and dispatch.admission is None and pool.flow_control.enabled:
                await self._admit(dispatch)  # held while the pool is saturated; then look again
                continue
            policy = state.policies.policy(pool.name)
            if dispatch.pinned is None and policy.uses_affinity and pool.name not in dispatch.matches:
                dispatch.matches[pool.name] = await self._affinity_matches(pool.name, dispatch.request, ledger)
                # Others may have taken the free slots or broken workers meanwhile: look again. From
                # here to the attempt's slot nothing awaits, so the room seen is the room taken.
                continue
            if pool.flow_control.enabled and dispatch.pinned is None:  # the workers with room, if any
                workers = state.flow.with_room(pool, workers)
            if dispatch.flow is not None:
                self._engine_priority(dispatch, pool)
            kind = PINNED if dispatch.pinned is not None else kind_of(pool)
            attempt = kind.attempt(dispatch, policy, workers, dispatch.matches.get(pool.name, {}))
            if dispatch.admission is not None:  # from here its worker's not-started count holds it
                dispatch.admission.done()
            self._attempt_started(dispatch, attempt)
            try:
                result = await attempt.run()
            except AttemptFailed as failure:
                gone = None if reloaded else self._adapter_gone(dispatch, attempt, failure)
                if gone is not None:
                    reloaded = True
                    if await state.lora.ensure(gone, dispatch.pools, dispatch.pinned):
                        ledger.adapter_loaded()
                    continue
                answer = self._attempt_failed(dispatch, attempt, failure)
                if answer is not None:
                    return answer
                continue
            self._attempt_accepted(dispatch, attempt)
            if dispatch.migrate and isinstance(result, RelayResponse):
                self._may_migrate(dispatch, attempt, result)
            if dialect_for(dispatch.api).stores_responses:
                self._note_stored_response(dispatch.request, attempt.pool, attempt.worker, result, ledger)
            result.headers.extend(route_headers(record))
            return result
        raise exhausted(state.registry, dispatch.last, record, dispatch.pools, dispatch.failures)

    def _may_migrate(self, dispatch: Dispatch, attempt: Attempt, result: RelayResponse) -> None:
        """Give an accepted stream its migration when a mid-stream failure could continue it
        elsewhere (`gateway/dispatch/migration.py`, `attach`: what qualifies, PD pools included)."""
        attach_migration(self.state, dispatch, attempt, result)

    async def _admit(self, dispatch: Dispatch) -> None:
        """Flow control: wait until the request's pool lets it in (`FlowControl.admit`, at once when
        it has room), once per request; the wait goes to the access log. Raises what `admit`
        raises (429/503 with Retry-After, a hang-up's CancelledError)."""
        config, request, pool = self.state.config, dispatch.request, dispatch.pool
        assert dispatch.flow is not None
        fair = config.flow_control.fair_by
        cost = request.quota_tokens(pool.default_output_tokens, output_room(pool, request)) if fair == "tokens" else 1
        dispatch.admission = await self.state.flow.admit(config.flow_control, pool, dispatch.flow, cost, dispatch.size)
        if dispatch.admission.waited:
            dispatch.ledger.flow_waited(dispatch.admission.waited)

    @staticmethod
    def _engine_priority(dispatch: Dispatch, pool: PoolConfig) -> None:
        """The engine `priority` for `pool`: the client's own when it may set one and did; else the
        request's band in the pool's engine's terms where its engines run priority scheduling
        (`flow_control.engine_priority`) and the API has the field; else none (the engine bodies
        encoded so far are dropped when that changes)."""
        flow = dispatch.flow
        assert flow is not None
        if flow.client_priority and dispatch.engine_priority is None and client_value(dispatch.payload) is not None:
            return
        want = engine_value(pool.engine, flow.band) \
            if pool.flow_control.engine_priority and dispatch.api in PRIORITY_APIS else None
        if want != dispatch.engine_priority:
            dispatch.payload = with_priority(dispatch.payload, want)
            dispatch.bodies.clear()
            dispatch.engine_priority = want

    async def _wait_for_slot(self, dispatch: Dispatch) -> None:
        """Queue for a slot of the request's pool, up to `queue_timeout` after it first queued."""
        gate = self.state.registry.gates[dispatch.pool.name]
        if dispatch.queue_deadline is None:
            dispatch.queue_deadline = time.monotonic() + gate.queue_timeout
        await gate.wait_for_slot(dispatch.queue_deadline)

    def _attempt_started(self, dispatch: Dispatch, attempt: Attempt) -> None:
        """Account for an attempt about to run: the record's attempt count, worker and route
        reason, the decision's metric, and a retry's (labelled with what the last one failed by)."""
        dispatch.ledger.attempt_started(attempt.pool.name, attempt.worker, attempt.reason,
                                        None if dispatch.last is None else dispatch.last.outcome)

    def _adapter_gone(self, dispatch: Dispatch, attempt: Attempt, failure: AttemptFailed) -> str | None:
        """The on-demand LoRA adapter a failed attempt was refused for because its worker no longer
        has it (`lora_loader.adapter_missing`: another replica unloaded it since this one last read
        that worker's list), else None. Then the attempt is accounted as failed, the worker no
        longer serves the adapter here, and the caller loads it again (once per request) instead of
        passing the engine's "does not exist" on; the worker stays a candidate (it may get it back)."""
        adapter, pool = dispatch.request.adapter, attempt.pool
        if adapter is None or pool.adapter_path(adapter) is None or failure.outcome is not Outcome.CLIENT_ERROR \
                or not adapter_missing(failure.status, failure.body, adapter):
            return None
        worker = attempt.failed_worker(failure)
        dispatch.ledger.attempt_failed(pool.name, worker, failure.outcome)
        self.state.lora.adapter_gone(worker, adapter)
        return adapter

    def _attempt_failed(self, dispatch: Dispatch, attempt: Attempt,
                        failure: AttemptFailed) -> BufferedResponse | None:
        """Account for a failed attempt (its metric, its trace span, whether the engine saw it)
        and judge it (`after_failure`): None to try again (in the same pool or, after an engine's
        "too long", once in the next larger one), else the final answer. Raises what
        `after_failure` raises for failures no other worker should repeat."""
        ledger, pool, worker = dispatch.ledger, attempt.pool, attempt.failed_worker(failure)
        ledger.attempt_failed(pool.name, worker, failure.outcome)
        dispatch.tried.add(worker)
        dispatch.last = failure
        step_to = after_failure(ledger, failure, worker, pool, dispatch.pools, dispatch.request,
                                dispatch.too_long_retried, dispatch.failures)
        if isinstance(step_to, BufferedResponse):
            return step_to
        if step_to is not pool:
            ledger.spilled(pool.name, step_to.name, "too_long")
            dispatch.too_long_retried = True
            dispatch.move_to(step_to)
        return None

    def _attempt_accepted(self, dispatch: Dispatch, attempt: Attempt) -> None:
        """Account for the accepted attempt, and remember (after the first chunk went out) that its
        worker now holds the prompt's prefix."""
        state, request = self.state, dispatch.request
        pool, worker = attempt.pool, attempt.worker
        remembered = attempt.matched is not None and request.prefix is not None and state.affinity is not None
        dispatch.ledger.attempt_accepted(pool.name, worker, attempt.matched if remembered else None)
        if remembered:
            assert request.prefix is not None and state.affinity is not None
            hashes = request.prefix.hashes
            if request.session_key is not None:  # and the session's worker, for its next turn
                hashes = (*hashes, session_hash(request.session_key))
            # After this task next yields, i.e. once the first chunk went out: never before the first token.
            asyncio.get_running_loop().call_soon(state.affinity.record, pool.name, hashes, attempt.cache_worker.url)

    def _note_stored_response(self, request: RoutingRequest, pool: PoolConfig, worker: Worker,
                              result: BufferedResponse | RelayResponse, ledger: Ledger) -> None:
        """Remember which worker stores the response this accepted Responses request creates (not with
        `store: false`, nor on an engine that stores nothing), and its size as a follow-up's prompt
        holds it (`ResponseOwner.context_tokens`): from the JSON answer's `id` and usage, or from the
        stream's `response.created` event as the relay passes it (`SSETap.on_response_id`), with the
        request's prompt estimate + its reserved output until the ledger notes the stream's usage
        at its end (`Ledger.response_stored`). A background response's answer has no usage yet: its
        estimate stays (an upper bound of what the engine will store)."""
        store = self.state.responses
        if store is None or not request.store or not worker.engine.stores_responses:
            return
        estimate = request.prompt_tokens + request.reserved_output(pool.default_output_tokens,
                                                                   output_room(pool, request))
        owner = ResponseOwner(pool.name, worker.url, ledger.record.key, estimate)
        if isinstance(result, RelayResponse):
            def created(rid: str) -> None:
                store.record(rid, owner)
                ledger.response_stored(store, rid)
            result.stream.tap.on_response_id = created
        elif result.status == 200 and (rid := response_id_in_json(result.body)) is not None:
            used = context_used(ledger.record.usage)
            store.record(rid, owner if used is None else replace(owner, context_tokens=used))

    async def _affinity_matches(self, pool: str, request: RoutingRequest, ledger: Ledger) -> dict[str, float]:
        """Worker URL → share of the prompt it holds, and (an `AffinityMatch`) the worker that served
        the request's session last, from one store lookup (fails open to {})."""
        store, prefix = self.state.affinity, request.prefix
        if store is None or prefix is None:
            return {}
        hashes = prefix.hashes
        if request.session_key is not None:
            hashes = (*hashes, session_hash(request.session_key))
        owners = await store.lookup(pool, hashes)
        if owners is None:
            return {}
        matched = longest_match(prefix, owners[:len(prefix.hashes)])
        ledger.affinity_looked_up(pool, bool(matched))
        if len(owners) > len(prefix.hashes) and owners[-1] is not None:
            return AffinityMatch(matched, owners[-1])
        return matched

    def attempt_cut_by_hang_up(self, ledger: Ledger) -> None:
        """Passive health for a client that hung up before its response while an attempt still
        waited: the worker that had sent it nothing (a PD attempt's prefill worker while its leg is
        unanswered, else the attempt's worker before its response headers) counts a failed request
        when the client waited at least `silence_limit` seconds and that worker answered no other
        request since this attempt started. A wedged engine (it accepts requests and answers none,
        its health probe green) is so ejected within the patience of its clients, when a
        non-streamed answer budget would keep it in for minutes; a quick hang-up, or a busy engine
        answering others, is held against nobody."""
        ledger.hang_up_verdict(silence_limit(self.state.config.timeouts, ledger.record.estimated_prompt_tokens or 0))


