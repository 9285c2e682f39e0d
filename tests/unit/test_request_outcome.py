"""A request's outcome is a bounded enum; the status it is counted under follows from it."""

from __future__ import annotations

import pytest

from gateway.record import RequestOutcome, RequestRecord, counted_status


def test_an_error_answer_names_the_outcome_error_only_when_no_cause_was_named() -> None:
    record = RequestRecord(request_id="r", api="chat")
    assert record.outcome is RequestOutcome.OK
    record.answered_with_error(429)
    assert (record.outcome, record.status) == (RequestOutcome.ERROR, 429)
    timed_out = RequestRecord(request_id="r", api="chat", outcome=RequestOutcome.TIMEOUT)
    timed_out.answered_with_error(504)
    assert (timed_out.outcome, timed_out.status) == (RequestOutcome.TIMEOUT, 504)


def test_a_hang_up_is_recorded_once_with_its_first_stage() -> None:
    record = RequestRecord(request_id="r", api="chat")
    record.client_gone("before_response")
    record.client_gone("mid_stream")
    assert (record.outcome, record.disconnect_stage) == (RequestOutcome.CLIENT_DISCONNECT, "before_response")


def test_shutdown_cut_answers_503_only_before_the_response_started() -> None:
    before, during = RequestRecord(request_id="r", api="chat"), RequestRecord(request_id="r", api="chat", status=200)
    before.cut_by_shutdown(response_started=False)
    during.cut_by_shutdown(response_started=True)
    assert (before.outcome, before.status) == (RequestOutcome.SHUTTING_DOWN, 503)
    assert (during.outcome, during.status) == (RequestOutcome.SHUTTING_DOWN, 200)


@pytest.mark.parametrize(("status", "outcome", "counted"), [
    (200, RequestOutcome.OK, 200),
    (200, RequestOutcome.UPSTREAM_ERROR, 502),  # a stream that broke after its first byte
    (200, RequestOutcome.TIMEOUT, 504),          # a stream cut at the overall cap
    (200, RequestOutcome.SHUTTING_DOWN, 503),
    (499, RequestOutcome.CLIENT_DISCONNECT, 499),
    (400, RequestOutcome.ERROR, 400),
    (502, RequestOutcome.UPSTREAM_ERROR, 502),   # an error status stays itself
    (503, RequestOutcome.TIMEOUT, 503),
])
def test_counted_status(status: int, outcome: RequestOutcome, counted: int) -> None:
    assert counted_status(status, outcome) == counted


def test_outcomes_are_the_documented_bounded_set() -> None:
    assert {o.value for o in RequestOutcome} == {"ok", "error", "timeout", "upstream_error", "shutting_down",
                                                 "client_disconnect"}
