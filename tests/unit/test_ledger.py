"""The request's ledger (`gateway/dispatch/ledger.py`) without a socket: how each fact changes the
record, the metrics it writes, the passive-health verdicts it issues, the access-log line and the
quota it settles at the end."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import orjson
import pytest

from gateway.auth.guard import AuthGuard
from gateway.auth.keys import KeyRing, Principal
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.params import AuthConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import parse_config
from gateway.dispatch.ledger import Ledger
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestOutcome
from gateway.routing.features import RoutingRequest

REQUEST = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=40, output_tokens=100, stream=True,
                         modalities=frozenset({"text"}), estimate_method="bytes")


def registry() -> WorkerRegistry:
    """One pool `p` of two workers; one failed request ejects a worker."""
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1", "http://b:1"]}],
                           "health": {"passive_failures": 1}}, environ={})
    return WorkerRegistry(config)


def ledger(metrics: GatewayMetrics | None = None, workers: WorkerRegistry | None = None) -> Ledger:
    return Ledger("chat", "r1", "alice", metrics or GatewayMetrics(), workers or registry())


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def workers_of(book: Ledger) -> tuple[Worker, Worker]:
    a, b = book._registry.pools["p"]
    return a, b


# -- the endpoint's facts ------------------------------------------------------------------------

def test_an_error_answer_names_the_outcome_error_only_when_no_cause_was_named() -> None:
    book = ledger()
    book.answered_with_error(429, "too many")
    assert (book.record.outcome, book.record.status, book.record.error) == (RequestOutcome.ERROR, 429, "too many")
    capped = ledger()
    capped.timed_out()
    capped.answered_with_error(504)
    assert (capped.record.outcome, capped.record.status, capped.record.error) == (RequestOutcome.TIMEOUT, 504, None)
    fine = ledger()
    fine.answered(200)
    assert (fine.record.outcome, fine.record.status) == (RequestOutcome.OK, 200)


def test_a_hang_up_is_recorded_once_with_its_first_stage() -> None:
    book = ledger()
    book.client_gone("before_response")
    book.client_gone("mid_stream")
    assert (book.record.outcome, book.record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT, "before_response")


def test_shutdown_cut_answers_its_status_only_before_the_response_started() -> None:
    before, during = ledger(), ledger()
    during.accepted(200)
    before.cut_by_shutdown(response_started=False)
    during.cut_by_shutdown(response_started=True, status=500)
    assert (before.record.outcome, before.record.status) == (RequestOutcome.SHUTTING_DOWN, 503)
    assert (during.record.outcome, during.record.status) == (RequestOutcome.SHUTTING_DOWN, 200)


def test_a_relay_cut_at_the_cap_is_a_timeout_with_a_504_only_before_it_started() -> None:
    started, unstarted = ledger(), ledger()
    started.accepted(200)
    started.relay_cut_by_cap("over the cap", True, 504)
    unstarted.relay_cut_by_cap("over the cap", False, 504)
    assert (started.record.outcome, started.record.status, started.record.error) == (RequestOutcome.TIMEOUT, 200,
                                                                                     "over the cap")
    assert unstarted.record.status == 504


# -- attempts ---------------------------------------------------------------------------------------

def test_an_attempts_start_failure_and_acceptance_are_counted_and_marked() -> None:
    metrics = GatewayMetrics()
    book = ledger(metrics)
    a, b = workers_of(book)
    book.in_pool("p", REQUEST)
    book.attempt_started("p", a, "least_load", None)
    assert (book.record.attempts, book.record.worker, book.record.reason, book.open_attempt) == (1, a.id,
                                                                                                 "least_load", a)
    book.attempt_failed("p", a, "client_error")
    assert book.open_attempt is None and book.record.engine_refused and not book.record.reached_engine
    book.attempt_started("p", b, "affinity", "client_error")
    book.attempt_accepted("p", b, 0.75)
    assert book.record.reached_engine and book.record.attempts == 2 and book.record.worker == b.id
    assert sample(metrics, "kimi_gateway_upstream_attempts_total", pool="p", worker=a.id, outcome="client_error") == 1
    assert sample(metrics, "kimi_gateway_upstream_attempts_total", pool="p", worker=b.id, outcome="ok") == 1
    assert sample(metrics, "kimi_gateway_retries_total", pool="p", cause="client_error") == 1
    assert sample(metrics, "kimi_gateway_route_decisions_total", pool="p", reason="affinity") == 1
    assert sample(metrics, "kimi_gateway_affinity_match_ratio_count", pool="p") == 1
    assert sample(metrics, "kimi_gateway_estimated_prompt_tokens_sum", pool="p", method="bytes") == 40


def test_a_timeout_or_protocol_error_means_the_engine_may_have_worked_on_it() -> None:
    book = ledger()
    a, _ = workers_of(book)
    book.attempt_started("p", a, "least_load", None)
    book.attempt_failed("p", a, "timeout")
    assert book.record.reached_engine and not book.record.engine_refused


def test_the_cap_cutting_an_unanswered_stream_holds_it_against_the_worker_and_a_buffered_one_not() -> None:
    metrics = GatewayMetrics()
    stream = ledger(metrics)
    stream.parsed(REQUEST)  # a stream
    a, b = workers_of(stream)
    stream.attempt_started("p", a, "least_load", None)
    stream.cut_by_cap()
    assert stream.record.outcome is RequestOutcome.TIMEOUT and stream.record.reached_engine
    assert a.ejected_until > 0 and a.last_error == "no response headers within the overall cap"
    assert sample(metrics, "kimi_gateway_upstream_attempts_total", pool="p", worker=a.id, outcome="timeout") == 1
    answered = ledger(metrics, stream._registry)
    answered.parsed(REQUEST)
    answered.attempt_started("p", b, "least_load", None)
    answered.headers_arrived(b)  # a streaming engine that sent its headers is working on it
    answered.cut_by_cap()
    assert b.ejected_until == 0 and b.answered_at > 0
    idle = ledger()
    idle.cut_by_cap()  # no attempt running: only the outcome
    assert idle.record.outcome is RequestOutcome.TIMEOUT and not idle.record.reached_engine


def test_a_hang_up_counts_against_a_silent_worker_only_after_the_clients_patience() -> None:
    book = ledger()
    a, _ = workers_of(book)
    book.attempt_started("p", a, "least_load", None)
    book.client_gone("before_response")
    book.hang_up_verdict(patience=60.0)  # the client gave up sooner: held against nobody
    assert a.consecutive_failures == 0 and a.ejected_until == 0
    book.hang_up_verdict(patience=0.0)
    assert a.ejected_until > 0 and "hung up" in (a.last_error or "")


def test_a_hang_up_during_a_pd_prefill_counts_against_the_prefill_worker_until_it_answered() -> None:
    book = ledger()
    decode, prefill = workers_of(book)
    book.attempt_started("p", decode, "pd", None)
    book.prefill_chosen(prefill)
    book.prefill_sent(prefill)
    book.headers_arrived(decode)  # the decode leg answered; the prefill leg did not
    book.client_gone("before_response")
    book.hang_up_verdict(patience=0.0)
    assert prefill.ejected_until > 0 and decode.ejected_until == 0
    assert book.record.prefill_worker == prefill.id
    again = ledger()
    decode, prefill = workers_of(again)
    again.attempt_started("p", decode, "pd", None)
    again.prefill_sent(prefill)
    again.prefill_answered(prefill)
    again.headers_arrived(decode)
    again.client_gone("before_response")
    again.hang_up_verdict(patience=0.0)  # both answered: nobody was silent
    assert prefill.ejected_until == 0 and decode.ejected_until == 0


def test_verdicts_reach_the_registry() -> None:
    book = ledger()
    a, b = workers_of(book)
    book.worker_failed(a, "broken answer")
    assert a.ejected_until > 0
    book.worker_succeeded(a)
    assert a.ejections == 0
    book.worker_throttled(b, 5.0)
    assert b.busy_until > 0
    book.worker_unreachable(b, "connection refused")
    assert b.last_error == "connection refused"


def test_upstream_headers_carry_the_gateways_own_id_per_attempt() -> None:
    book = ledger()
    a, _ = workers_of(book)
    book.attempt_started("p", a, "least_load", None)
    first = book.upstream_headers("p", a)["x-request-id"]
    book.attempt_started("p", a, "least_load", "timeout")
    second = book.upstream_headers("p", a)["x-request-id"]
    base = book.record.engine_request_id
    assert base is not None and base != "r1" and (first, second) == (f"{base}-1", f"{base}-2")


def test_the_first_byte_is_noted_once_and_told_to_its_watcher() -> None:
    book = ledger()
    seen: list[float] = []
    book.watch_first_byte(seen.append)
    book.first_byte()
    at = book.record.first_byte_at
    book.first_byte()
    assert at is not None and seen == [at] and book.record.first_byte_at == at


def test_a_stream_keeps_earlier_usage_when_it_reports_none_and_a_broken_one_says_why() -> None:
    book = ledger()
    book.usage({"prompt_tokens": 1, "completion_tokens": 2})
    book.stream_usage(None)
    assert book.record.usage == {"prompt_tokens": 1, "completion_tokens": 2}
    book.stream_usage({"prompt_tokens": 3, "completion_tokens": 4})
    book.stream_broken("reset mid-stream")
    assert (book.record.usage, book.record.outcome, book.record.error) == (
        {"prompt_tokens": 3, "completion_tokens": 4}, RequestOutcome.UPSTREAM_ERROR, "reset mid-stream")


def test_pd_phases_and_leg_failures_are_observed_per_pool() -> None:
    metrics = GatewayMetrics()
    book = ledger(metrics)
    book.pd_routed("p", "least_load", "affinity")
    book.leg_failed("p", "prefill", "timeout")
    now = time.perf_counter()
    book.record.first_byte_at = now + 0.5
    book.pd_phases("p", now - 1.0, now)
    assert sample(metrics, "kimi_gateway_pd_route_decisions_total", pool="p", phase="decode", reason="affinity") == 1
    assert sample(metrics, "kimi_gateway_pd_leg_failures_total", pool="p", phase="prefill", outcome="timeout") == 1
    assert sample(metrics, "kimi_gateway_pd_prefill_seconds_sum", pool="p") == pytest.approx(1.0)
    assert sample(metrics, "kimi_gateway_pd_kv_handoff_seconds_sum", pool="p") == pytest.approx(0.5)


def test_a_migration_is_noted_for_the_access_log_and_counted() -> None:
    metrics = GatewayMetrics()
    book = ledger(metrics)
    a, b = workers_of(book)
    book.migration_started(a, "reset", 12, 1)
    book.continuation_started(b)
    book.continuation_ended("p", b, "ok")
    book.migration_ended("p", "migrated", b)
    book.migration_prefilled("p", 52)
    assert book.record.migration == {"from": a.id, "why": "reset", "kept_tokens": 12, "count": 1, "to": b.id,
                                     "outcome": "migrated", "prefill_tokens": 52}
    assert (book.record.worker, book.record.reason, book.record.attempts) == (b.id, "migration", 1)
    assert sample(metrics, "kimi_gateway_migrations_total", pool="p", outcome="migrated") == 1
    assert sample(metrics, "kimi_gateway_migration_prefill_tokens_total", pool="p") == 52
    refused = ledger(metrics)
    refused.migration_refused("p", a, "n > 1")
    assert refused.record.migration == {"from": a.id, "outcome": "refused", "why": "n > 1"}


# -- the end ------------------------------------------------------------------------------------------

def test_finish_writes_the_metrics_and_the_access_line_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    metrics = GatewayMetrics()
    book = ledger(metrics)
    a, _ = workers_of(book)
    book.parsed(REQUEST)
    book.in_pool("p", REQUEST)
    book.attempt_started("p", a, "least_load", None)
    book.upstream_headers("p", a)
    book.attempt_accepted("p", a, None)
    book.accepted(200)
    book.first_byte()
    book.stream_usage({"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}})
    book.stream_broken("reset mid-stream")
    book.finish()
    book.finish()
    counted = {"api": "chat", "pool": "p", "status_class": "5xx"}  # a 200 stream that broke counts as a 502
    assert sample(metrics, "kimi_gateway_requests_total", **counted, model="kimi-k3") == 1
    assert sample(metrics, "kimi_gateway_ttft_seconds_count", pool="p", model="kimi-k3") == 1
    assert sample(metrics, "kimi_gateway_tpot_seconds_count", pool="p", model="kimi-k3") == 1
    assert sample(metrics, "kimi_gateway_tokens_total", pool="p", kind="cached", model="kimi-k3") == 8
    assert sample(metrics, "kimi_gateway_tokens_total", pool="p", kind="completion", model="kimi-k3") == 5
    [line] = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert {k: line[k] for k in ("event", "request_id", "api", "key", "model", "pool", "worker", "reason", "attempts",
                                 "status", "outcome", "stream", "estimated_prompt_tokens", "estimate", "error")} == {
        "event": "request", "request_id": "r1", "api": "chat", "key": "alice", "model": "kimi-k3", "pool": "p",
        "worker": a.id,
        "reason": "least_load", "attempts": 1, "status": 200, "outcome": "upstream_error", "stream": True,
        "estimated_prompt_tokens": 40, "estimate": "bytes", "error": "reset mid-stream"}
    assert line["engine_request_id"] == book.record.engine_request_id and "prefill_worker" not in line
    assert line["ttft_s"] is not None and line["duration_s"] >= line["ttft_s"]


def test_a_client_that_hung_up_is_logged_and_counted_as_499() -> None:
    metrics = GatewayMetrics()
    book = ledger(metrics)
    book.accepted(200)
    book.client_gone("mid_stream")
    book.finish()
    assert sample(metrics, "kimi_gateway_requests_total", api="chat", pool="none", status_class="4xx",
                  model="none") == 1
    assert sample(metrics, "kimi_gateway_client_disconnects_total", pool="none", stage="mid_stream") == 1


class Settles:
    """An AuthGuard's settle calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int | None]] = []

    async def settle(self, reservation: Any, used_tokens: int | None) -> None:
        self.calls.append(("settle", reservation, used_tokens))

    def settle_soon(self, reservation: Any, used_tokens: int | None) -> None:
        self.calls.append(("soon", reservation, used_tokens))


class Held:
    tokens = 500


@pytest.mark.anyio
async def test_a_held_quota_is_settled_now_or_at_the_finish_by_what_the_engine_used() -> None:
    guard, reservation = Settles(), Held()
    now = ledger()
    now.hold_quota(guard, reservation, REQUEST)
    await now.settle_quota(failed=True)  # an error before any engine worked on it: all back
    assert guard.calls == [("settle", reservation, None)]
    later = ledger()
    later.hold_quota(guard, reservation, REQUEST)
    later.attempt_accepted("p", workers_of(later)[0], None)
    later.stream_usage({"prompt_tokens": 40, "completion_tokens": 7})
    later.finish()
    assert guard.calls[-1] == ("soon", reservation, 47)
    unheld = ledger()
    await unheld.settle_quota(failed=False)
    unheld.finish()
    assert len(guard.calls) == 2


@pytest.mark.anyio
async def test_a_real_guard_settles_a_finished_streams_reservation_once() -> None:
    guard = AuthGuard(AuthConfig(), KeyRing([]), MemoryRateLimiter(clock=lambda: 30.0), GatewayMetrics())
    alice = Principal("alice", frozenset({"user"}), 10, 100)
    reservation = await guard.check_quota(alice, 90)
    assert reservation is not None
    book = ledger()
    book.hold_quota(guard, reservation, REQUEST)
    book.attempt_accepted("p", workers_of(book)[0], None)
    book.stream_usage({"prompt_tokens": 10, "completion_tokens": 10})
    book.finish()
    await asyncio.sleep(0)  # settle_soon's task
    await asyncio.sleep(0)
    assert reservation.settled
    assert await guard.check_quota(alice, 80) is not None  # 20 used + 80 fits the 100 only after the settle


class Noted:
    """A response store's `note_context` calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def note_context(self, response_id: str, tokens: int) -> None:
        self.calls.append((response_id, tokens))


def test_a_stored_responses_size_is_noted_from_the_usage_its_stream_reported() -> None:
    store = Noted()
    book = ledger()
    book.response_stored(store, "resp_1")
    book.stream_usage({"prompt_tokens": 2040, "completion_tokens": 7})
    book.finish()
    book.finish()
    assert store.calls == [("resp_1", 2047)]
    cut = ledger()  # a stream cut before its usage came: the store keeps its estimate
    cut.response_stored(store, "resp_2")
    cut.client_gone("mid_stream")
    cut.finish()
    zero = ledger()  # a prompt counted as 0 is no count
    zero.response_stored(store, "resp_3")
    zero.stream_usage({"prompt_tokens": 0, "completion_tokens": 7})
    zero.finish()
    assert store.calls == [("resp_1", 2047)]


def test_a_follow_ups_estimate_holds_its_stored_history() -> None:
    book = ledger()
    book.parsed(REQUEST)
    book.history_counted(replace(REQUEST, prompt_tokens=40 + 2047))
    assert book.record.estimated_prompt_tokens == 2087


def test_the_model_label_is_the_resolved_model_or_a_known_adapter_never_another_name() -> None:
    metrics = GatewayMetrics()
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"], "lora_adapters": ["sql-lora"]}]}, environ={})
    workers = WorkerRegistry(config)
    for model, adapter in (("kimi-k3", None), ("sql-lora", "sql-lora"), ("gone-lora", "gone-lora")):
        book = ledger(metrics, workers)
        book.parsed(replace(REQUEST, model=model, adapter=adapter))
        book.in_pool("p")
        book.accepted(200)
        book.finish()
    assert sample(metrics, "kimi_gateway_requests_total", api="chat", pool="p", status_class="2xx",
                  model="kimi-k3") == 1
    assert sample(metrics, "kimi_gateway_requests_total", api="chat", pool="p", status_class="2xx",
                  model="sql-lora") == 1
    # an adapter no pool declares and no worker lists (any more) adds no series: it counts as `none`
    assert sample(metrics, "kimi_gateway_requests_total", api="chat", pool="p", status_class="2xx",
                  model="none") == 1
    assert sample(metrics, "kimi_gateway_request_duration_seconds_count", pool="p", model="sql-lora") == 1
    assert "gone-lora" not in metrics.render()[0].decode()
