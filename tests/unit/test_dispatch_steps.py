"""The dispatch loop's steps without a socket: choose the pool and its candidates with room, the
policy's decision, the engine body, what a failed attempt leads to, and an attempt's own parts
(`gateway/dispatch/`)."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig, parse_config
from gateway.dispatch.answers import BufferedResponse, route_headers
from gateway.dispatch.attempt import timed_out, upstream_headers
from gateway.dispatch.failures import Failures, after_failure
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.steps import PoolStep, choose_pool, decide, engine_body
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestRecord
from gateway.routing.features import RoutingRequest
from gateway.routing.pool_policies import PoolPolicies
from gateway.streaming import AttemptFailed, Lease, Outcome


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(small: dict[str, Any] | None = None, large: dict[str, Any] | None = None) -> GatewayConfig:
    """Two pools, cheapest first: `small` (8k context, workers a, b) and `large` (128k, worker c)."""
    return parse_config({"pools": [
        {"name": "small", "engine": "vllm", "max_context_tokens": 8192,
         "workers": ["http://a:1", "http://b:1"], **(small or {})},
        {"name": "large", "engine": "sglang", "max_context_tokens": 131072,
         "workers": ["http://c:1"], **(large or {})},
    ], "health": {"passive_failures": 1, "ejection_base": 5}}, environ={})


def setup(small: dict[str, Any] | None = None,
          large: dict[str, Any] | None = None) -> tuple[WorkerRegistry, list[PoolConfig], Clock]:
    clock = Clock()
    cfg = config(small, large)
    return WorkerRegistry(cfg, clock=clock), list(cfg.pools), clock


def request(prompt: int = 100, stream: bool = False) -> RoutingRequest:
    return RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=prompt, output_tokens=None, stream=stream,
                          modalities=frozenset({"text"}), estimate_method="bytes")


def ids(workers: list[Worker]) -> list[str]:
    return [w.url for w in workers]


def occupy(registry: WorkerRegistry, worker: Worker) -> None:
    """One request in flight on `worker` (what an attempt's Lease counts)."""
    worker.in_flight += 1
    registry.gates[worker.pool].acquired()


# -- choose the pool and its candidates with room --------------------------------------------------

def test_routes_in_the_first_pool_among_its_untried_workers() -> None:
    registry, pools, _ = setup()
    step, pool, workers = choose_pool(registry, pools[0], pools, set())
    assert (step, pool.name, ids(workers)) == (PoolStep.ROUTE, "small", ["http://a:1", "http://b:1"])
    a = registry.pools["small"][0]
    step, pool, workers = choose_pool(registry, pools[0], pools, {a})
    assert (step, pool.name, ids(workers)) == (PoolStep.ROUTE, "small", ["http://b:1"])


def test_a_pool_without_candidates_spills_over_as_unavailable_then_is_exhausted() -> None:
    registry, pools, _ = setup()
    tried = set(registry.pools["small"])
    step, pool, _ = choose_pool(registry, pools[0], pools, tried)
    assert (step, step.value, pool.name) == (PoolStep.UNAVAILABLE, "unavailable", "large")
    tried |= set(registry.pools["large"])
    assert choose_pool(registry, pools[1], pools, tried)[0] is PoolStep.EXHAUSTED


def test_ejected_workers_are_no_candidates_and_spillover_off_exhausts_the_pool() -> None:
    registry, pools, clock = setup(small={"spillover": False})
    for worker in registry.pools["small"]:
        registry.request_failed(worker, "HTTP 500")  # passive_failures 1: ejected for 5 s
    step, pool, _ = choose_pool(registry, pools[0], pools, set())
    assert (step, pool.name) == (PoolStep.EXHAUSTED, "small")
    clock.now += 5.01  # half-open again
    assert choose_pool(registry, pools[0], pools, set())[0] is PoolStep.ROUTE


def test_only_workers_with_room_are_candidates() -> None:
    registry, pools, _ = setup(small={"max_in_flight_per_worker": 1})
    occupy(registry, registry.pools["small"][0])
    step, pool, workers = choose_pool(registry, pools[0], pools, set())
    assert (step, pool.name, ids(workers)) == (PoolStep.ROUTE, "small", ["http://b:1"])


def test_a_full_pool_spills_over_as_saturated_to_a_later_pool_with_room_else_waits() -> None:
    registry, pools, _ = setup(small={"max_in_flight": 1}, large={"max_in_flight": 1})
    occupy(registry, registry.pools["small"][0])
    step, pool, _ = choose_pool(registry, pools[0], pools, set())
    assert (step, step.value, pool.name) == (PoolStep.SATURATED, "saturated", "large")
    occupy(registry, registry.pools["large"][0])
    step, pool, _ = choose_pool(registry, pools[0], pools, set())
    assert (step, pool.name) == (PoolStep.WAIT, "small")


def test_a_full_pool_without_spillover_waits_even_when_a_later_one_has_room() -> None:
    registry, pools, _ = setup(small={"max_in_flight": 1, "spillover": False})
    occupy(registry, registry.pools["small"][1])
    step, pool, _ = choose_pool(registry, pools[0], pools, set())
    assert (step, pool.name) == (PoolStep.WAIT, "small")


# -- the decision ------------------------------------------------------------------------------------

def test_decide_takes_the_policy_of_the_pool_and_sees_load_and_prefix_matches() -> None:
    pools_of = {"small": {"policy": "least_load"},
                "large": {"policy": "prefix_affinity", "policy_params": {"min_match_tokens": 10}}}
    registry, _, _ = setup(**pools_of)
    policies = PoolPolicies(config(**pools_of))
    a, b = registry.pools["small"]
    occupy(registry, a)
    decision = decide(policies.policy("small"), request(), [a, b], {})
    assert (decision.worker.url, decision.reason) == ("http://b:1", "least_load")
    c = registry.pools["large"][0]
    matched = decide(policies.policy("large"), request(prompt=1000), [c], {"http://c:1": 0.5})
    assert (matched.worker.url, matched.reason) == ("http://c:1", "affinity")
    unmatched = decide(policies.policy("large"), request(prompt=10), [c], {"http://c:1": 0.5})  # 5 tokens < 10
    assert unmatched.reason == "no_match"


# -- the engine body -------------------------------------------------------------------------------

def test_engine_body_is_encoded_once_per_form() -> None:
    registry, (small, large), _ = setup()
    a, b = registry.pools["small"]
    c = registry.pools["large"][0]
    payload = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}
    bodies: dict[tuple[str, bool, bool, bool], bytes] = {}
    first = engine_body(bodies, payload, "chat", small, "served-a", a, False)
    assert engine_body(bodies, payload, "chat", small, "served-a", b, False) is first  # same engine kind: cached
    assert b'"served-a"' in first
    other = engine_body(bodies, payload, "chat", large, "served-c", c, True)
    assert b'"served-c"' in other and b"include_usage" in other
    assert len(bodies) == 2


def test_engine_body_strips_engine_control_fields_unless_the_pool_allows_the_kv_ones() -> None:
    registry, (small, _), _ = setup()
    a = registry.pools["small"][0]
    control = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 5600},
               "bootstrap_host": "10.6.6.6", "bootstrap_port": 8998, "bootstrap_room": 7}
    payload = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "request_id": "resp_x",
               "rid": "r1", **control}
    allowing = small.model_copy(update={"allow_kv_transfer_fields": True})
    stripped = orjson.loads(engine_body({}, payload, "chat", small, "served-a", a, False))
    assert stripped == {"model": "served-a", "messages": payload["messages"]}
    allowed = orjson.loads(engine_body({}, payload, "chat", allowing, "served-a", a, False))
    assert allowed == {"model": "served-a", "messages": payload["messages"], **control}  # never the ids


# -- what a failed attempt leads to ------------------------------------------------------------------

def ledger(registry: WorkerRegistry) -> Ledger:
    """A chat request's ledger in pool `small`, its verdicts going to `registry`."""
    book = Ledger("chat", "r", None, GatewayMetrics(), registry)
    book.record.pool = "small"
    return book


def test_too_long_goes_to_the_larger_pool_once_then_answers_the_engines_error() -> None:
    registry, pools, _ = setup()
    a = registry.pools["small"][0]
    failure = AttemptFailed(Outcome.TOO_LONG, "too long", 400, b'{"error": {"message": "too long"}}')
    nxt = after_failure(ledger(registry), failure, a, pools[0], pools, request(), False, Failures())
    assert isinstance(nxt, PoolConfig) and nxt.name == "large"
    c = registry.pools["large"][0]
    answer = after_failure(ledger(registry), failure, c, pools[1], pools, request(), True, Failures())
    assert isinstance(answer, BufferedResponse) and answer.status == 400
    assert b"context_length_exceeded" in answer.body and b'"messages"' in answer.body


def test_an_engines_4xx_is_answered_and_held_against_nobody() -> None:
    registry, pools, _ = setup()
    a = registry.pools["small"][0]
    failure = AttemptFailed(Outcome.CLIENT_ERROR, "bad", 422, b'{"error": {"message": "bad temperature"}}')
    answer = after_failure(ledger(registry), failure, a, pools[0], pools, request(), False, Failures())
    assert isinstance(answer, BufferedResponse) and answer.status == 422
    assert a in registry.candidates("small")


def test_refused_credentials_and_a_generation_timeout_are_final() -> None:
    registry, pools, _ = setup()
    a = registry.pools["small"][0]
    with pytest.raises(UpstreamError, match="credentials"):
        after_failure(ledger(registry), AttemptFailed(Outcome.AUTH_ERROR, "401", 401), a, pools[0], pools, request(),
                      False, Failures())
    answered = AttemptFailed(Outcome.TIMEOUT, "no first content", answered=True)
    with pytest.raises(UpstreamTimeout) as caught:
        after_failure(ledger(registry), answered, a, pools[0], pools, request(), False, Failures())
    assert caught.value.headers == {"x-should-retry": "false"}
    # a stream's timeout, or one before headers, is tried elsewhere in the same pool
    same = after_failure(ledger(registry), answered, a, pools[0], pools, request(stream=True), False, Failures())
    assert same is pools[0]


def test_a_429_backs_its_worker_off_and_is_remembered_as_the_shortest_busy() -> None:
    registry, pools, _ = setup()
    a, b = registry.pools["small"]
    failures = Failures()
    for worker, wait in ((a, 30.0), (b, 2.0)):
        step = after_failure(ledger(registry), AttemptFailed(Outcome.STATUS_429, "429", 429, retry_after=wait), worker,
                             pools[0], pools, request(), False, failures)
        assert step is pools[0]
    assert registry.candidates("small") == []
    assert failures.busy is not None and failures.busy.retry_after == 2.0


def test_a_5xx_two_workers_give_alike_is_the_requests_fault_and_charged_to_neither() -> None:
    registry, pools, _ = setup()
    a, b = registry.pools["small"]
    failures = Failures()
    first = AttemptFailed(Outcome.STATUS_5XX, "500", 500, b'{"error": "bad input id 1234abcd9876"}')
    second = AttemptFailed(Outcome.STATUS_5XX, "500", 500, b'{"error": "bad input id 99zz88yy7766"}')
    assert after_failure(ledger(registry), first, a, pools[0], pools, request(), False, failures) is pools[0]
    answer = after_failure(ledger(registry), second, b, pools[0], pools, request(), False, failures)
    assert isinstance(answer, BufferedResponse) and answer.status == 500
    assert (b"x-should-retry", b"false") in answer.headers
    failures.charge(ledger(registry))
    assert registry.candidates("small") == [a, b]  # passive_failures 1: a charge would have ejected


def test_a_5xx_then_a_different_one_charges_the_first_worker() -> None:
    registry, pools, _ = setup()
    a, b = registry.pools["small"]
    failures = Failures()
    after_failure(ledger(registry), AttemptFailed(Outcome.STATUS_5XX, "500", 500, b"out of memory"), a, pools[0], pools,
                  request(), False, failures)
    assert registry.candidates("small") == [a, b]  # held until the next attempt tells
    after_failure(ledger(registry), AttemptFailed(Outcome.STATUS_5XX, "500", 500, b"disk full"), b, pools[0], pools,
                  request(), False, failures)
    assert registry.candidates("small") == [b]
    failures.charge(ledger(registry))
    assert registry.candidates("small") == []


def test_route_headers_name_pool_attempts_worker_and_reason() -> None:
    done = RequestRecord(request_id="r", api="chat", pool="small", attempts=2, worker="small/1", reason="affinity",
                         estimated_prompt_tokens=12, estimate_method="bytes")
    assert dict(route_headers(done)) == {
        b"x-kimi-gateway-pool": b"small", b"x-kimi-gateway-attempts": b"2", b"x-kimi-gateway-worker": b"small/1",
        b"x-kimi-gateway-route-reason": b"affinity", b"x-kimi-gateway-estimated-prompt-tokens": b"12; method=bytes"}


# -- the attempt's own parts -----------------------------------------------------------------------

def test_upstream_headers_carry_the_request_id_and_the_pools_credential_only() -> None:
    registry, pools, _ = setup(large={"api_key": "sk-engine"})
    a, c = registry.pools["small"][0], registry.pools["large"][0]
    book = ledger(registry)
    first = book.record
    first.attempts = 1
    headers = upstream_headers(pools[0], a, book)
    assert headers == {"content-type": "application/json", "x-request-id": f"{first.engine_request_id}-1"}
    assert re.fullmatch("[0-9a-f]{32}-1", headers["x-request-id"])  # the gateway's id, never the client's "r"
    first.attempts = 2
    assert upstream_headers(pools[0], a, book)["x-request-id"] == f"{first.engine_request_id}-2"  # per attempt
    again = upstream_headers(pools[1], c, ledger(registry))
    assert again["authorization"] == "Bearer sk-engine" and again["x-request-id"][:32] != first.engine_request_id


@pytest.mark.parametrize(("moved", "answered", "outcome", "detail", "was_answered"), [
    (True, False, Outcome.MOVED, "health probe failed", False),
    (True, True, Outcome.MOVED, "health probe failed", False),  # a probe's verdict wins over the wait
    (False, False, Outcome.TIMEOUT, "no response headers within 2.5s", False),
    (False, True, Outcome.TIMEOUT, "no first content within 30.0s", True),
])
def test_a_wait_that_ran_out_names_what_was_missing(moved: bool, answered: bool, outcome: Outcome, detail: str,
                                                      was_answered: bool) -> None:
    failure = timed_out(moved, answered, 2.5, 30.0)
    assert (failure.outcome, failure.answered) == (outcome, was_answered)
    assert detail in failure.detail


def test_a_lease_holds_one_slot_until_released_once_whoever_owns_it() -> None:
    registry, _, _ = setup(small={"max_in_flight": 1})
    a = registry.pools["small"][0]
    gate = registry.gates["small"]
    metrics = GatewayMetrics()
    lease = Lease(a, metrics, gate)
    assert (a.in_flight, gate.in_flight) == (1, 1)
    assert gate.with_room([a]) == []
    lease.release()
    lease.release()
    assert (a.in_flight, gate.in_flight) == (0, 0)
    assert metrics.registry.get_sample_value("kimi_gateway_in_flight", {"pool": "small", "worker": a.id}) == 0
