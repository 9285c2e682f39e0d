"""The held requests' order (gateway/flow/queue.py): bands, start-time fair queuing across
tenants and their sub-flows, first come first served within a sub-flow."""

from __future__ import annotations

from collections import Counter

from gateway.flow.queue import FlowQueue


def drain(queue: FlowQueue[str]) -> list[str]:
    out = []
    while (item := queue.pop()) is not None:
        out.append(item)
    return out


def test_first_come_first_served_within_a_flow_and_empty_is_none() -> None:
    queue: FlowQueue[str] = FlowQueue()
    assert queue.pop() is None and queue.highest_band() is None
    for i in range(4):
        queue.push(0, "alice", "", f"a{i}", 1.0)
    assert queue.held == 4 and drain(queue) == ["a0", "a1", "a2", "a3"] and queue.held == 0


def test_a_flooding_tenant_does_not_delay_a_quiet_one_by_more_than_one_request() -> None:
    queue: FlowQueue[str] = FlowQueue()
    for i in range(100):
        queue.push(0, "alice", "", f"a{i}", 1.0)
    assert queue.pop() == "a0"
    queue.push(0, "bob", "", "b0", 1.0)       # arrives behind 99 of Alice's
    assert "b0" in drain(queue)[:2]


def test_equal_shares_while_both_are_backlogged_whatever_their_arrival() -> None:
    queue: FlowQueue[str] = FlowQueue()
    for i in range(30):
        queue.push(0, "alice", "", f"a{i}", 1.0)
    for i in range(10):
        queue.push(0, "bob", "", f"b{i}", 1.0)
    first = drain(queue)[:20]
    assert Counter(item[0] for item in first) == {"a": 10, "b": 10}


def test_shares_count_the_cost_tokens_not_requests() -> None:
    """Bob's requests are 4x Alice's: while both wait, Alice gets ~4 requests for each of Bob's."""
    queue: FlowQueue[str] = FlowQueue()
    for i in range(40):
        queue.push(0, "alice", "", f"a{i}", 1000.0)
        queue.push(0, "bob", "", f"b{i}", 4000.0)
    first = drain(queue)[:25]
    assert Counter(item[0] for item in first) == {"a": 20, "b": 5}


def test_higher_bands_first_then_fair_within_the_band() -> None:
    queue: FlowQueue[str] = FlowQueue()
    queue.push(0, "alice", "", "a0", 1.0)
    queue.push(-3, "batch", "", "x0", 1.0)
    queue.push(2, "bob", "", "b0", 1.0)
    queue.push(0, "carol", "", "c0", 1.0)
    queue.push(2, "bob", "", "b1", 1.0)
    assert queue.highest_band() == 2
    assert drain(queue) == ["b0", "b1", "a0", "c0", "x0"]


def test_sub_flows_share_their_tenants_share() -> None:
    """Alice's key spreads her requests over many sub-flows: Bob still gets half."""
    queue: FlowQueue[str] = FlowQueue()
    for i in range(20):
        queue.push(0, "alice", f"user{i}", f"a{i}", 1.0)
        queue.push(0, "bob", "", f"b{i}", 1.0)
    first = drain(queue)[:20]
    assert Counter(item[0] for item in first) == {"a": 10, "b": 10}


def test_fair_across_sub_flows_of_one_tenant() -> None:
    queue: FlowQueue[str] = FlowQueue()
    for i in range(6):
        queue.push(0, "team", "loud", f"l{i}", 1.0)
    queue.push(0, "team", "quiet", "q0", 1.0)
    assert drain(queue)[:2] == ["l0", "q0"]


def test_removed_items_leave_no_gap_and_empty_sub_flows_are_forgotten() -> None:
    queue: FlowQueue[str] = FlowQueue()
    queue.push(0, "alice", "u1", "a0", 1.0)
    queue.push(0, "alice", "u1", "a1", 1.0)
    queue.push(0, "bob", "u2", "b0", 1.0)
    assert queue.remove(0, "alice", "u1", "a0") and not queue.remove(0, "alice", "u1", "a0")
    assert queue.remove(0, "bob", "u2", "b0")
    assert queue.held == 1 and drain(queue) == ["a1"]
    assert not queue.remove(0, "nobody", "", "a1")
    band = queue._bands[0]
    assert all(not tenant.children for tenant in band.children.values())  # type: ignore[attr-defined]


def test_an_idle_tenant_gets_no_credit_for_its_idle_time() -> None:
    """Bob was idle while Alice was served 50 times; back, he alternates with her (no 50 in a row)."""
    queue: FlowQueue[str] = FlowQueue()
    for i in range(50):
        queue.push(0, "alice", "", f"a{i}", 1.0)
        assert queue.pop() == f"a{i}"
    for i in range(50, 60):
        queue.push(0, "alice", "", f"a{i}", 1.0)
    for i in range(5):
        queue.push(0, "bob", "", f"b{i}", 1.0)
    assert [item[0] for item in drain(queue)[:6]] == ["b", "a", "b", "a", "b", "a"]
