"""A request's outcome is a bounded enum; the status it is counted under follows from it (how the
outcome is set: tests/unit/test_ledger.py)."""

from __future__ import annotations

import pytest

from gateway.observability.record import RequestOutcome, counted_status


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
