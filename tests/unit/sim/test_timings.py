"""The simulator's compact request timings (gateway/sim/timings.py): the bounded log and a record's
timing (its client id from the header or the body's tag)."""

from __future__ import annotations

import pytest

from gateway.sim.timings import TAG_FIELD, SimTiming, TimingLog
from gateway.sim.worker_state import SimRequestRecord


def _timing(i: int) -> SimTiming:
    return SimTiming(i, "/v1/chat/completions", None, f"t-{i}", float(i), None, None, None, 200, False, 10, 0, 10, 1)


def test_log_keeps_the_last_n_and_counts_the_dropped() -> None:
    log = TimingLog(2)
    for i in range(5):
        log.add(_timing(i))
    snap = log.snapshot()
    assert (snap["capacity"], snap["dropped"]) == (2, 3)
    assert [t["tag"] for t in snap["timings"]] == ["t-3", "t-4"]
    assert log.clear() == 2
    assert log.snapshot() == {"capacity": 2, "dropped": 0, "timings": []}


def test_log_of_zero_keeps_nothing() -> None:
    log = TimingLog(0)
    log.add(_timing(1))
    assert log.snapshot() == {"capacity": 0, "dropped": 0, "timings": []}
    with pytest.raises(ValueError):
        TimingLog(-1)


def test_record_timing_takes_the_header_and_the_tag() -> None:
    record = SimRequestRecord(7, "/v1/chat/completions", {"x-request-id": "gw-1"}, {TAG_FIELD: "replay-3"},
                              received_at=1.0, admitted_at=1.5, first_byte_at=2.0, finished_at=3.0, status=200,
                              prompt_tokens=100, cached_tokens=60, prefill_tokens=40, completion_tokens_sent=5)
    t = record.timing()
    assert (t.id, t.request_id, t.tag) == (7, "gw-1", "replay-3")
    assert (t.received_at, t.admitted_at, t.first_byte_at, t.finished_at) == (1.0, 1.5, 2.0, 3.0)
    assert (t.prompt_tokens, t.cached_tokens, t.prefill_tokens, t.completion_tokens) == (100, 60, 40, 5)
    bare = SimRequestRecord(8, "/v1/completions", {}, "not json", received_at=1.0).timing()
    assert (bare.request_id, bare.tag, bare.admitted_at) == (None, None, None)
    assert SimRequestRecord(9, "/v1/completions", {}, {TAG_FIELD: 3}, received_at=1.0).timing().tag is None
