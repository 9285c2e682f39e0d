"""Policies: table-driven choices among candidate workers."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from pydantic import ValidationError

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate
from gateway.routing.registry import POLICIES, build_policy

REQUEST = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=10_000, output_tokens=None, stream=False,
                         modalities=frozenset({"text"}), estimate_method="bytes")


def pool(loads: tuple[float, ...], matches: tuple[float, ...] | None = None,
         kv: tuple[float | None, ...] | None = None) -> list[Candidate]:
    """Candidates w0..wN with loads (requests), affinity matches (share of the prompt) and KV usage."""
    matches = matches or (0.0,) * len(loads)
    kv = kv or (None,) * len(loads)
    return [Candidate(Worker("p", i, f"http://w{i}:1", ENGINES["vllm"]), load, kv[i], matches[i],
                      int(matches[i] * REQUEST.prompt_tokens)) for i, load in enumerate(loads)]


def chosen(policy_name: str, candidates: list[Candidate], params: dict[str, object] | None = None,
           request: RoutingRequest = REQUEST) -> tuple[int, str]:
    decision = build_policy(policy_name, params).select(request, candidates)
    return decision.worker.index, decision.reason


@pytest.mark.parametrize(("loads", "expected"), [
    ((0,), 0),
    ((3, 1, 2), 1),
    ((5, 5, 0), 2),
    ((0, 9, 9), 0),
])
def test_least_load_takes_the_fewest(loads: tuple[int, ...], expected: int) -> None:
    assert chosen("least_load", pool(loads)) == (expected, "least_load")


def test_least_load_spreads_ties() -> None:
    policy = build_policy("least_load")
    candidates = pool((0, 0, 0))
    assert Counter(policy.select(REQUEST, candidates).worker.index for _ in range(30)) == {0: 10, 1: 10, 2: 10}


def test_round_robin_cycles() -> None:
    policy = build_policy("round_robin")
    candidates = pool((9, 0, 0))
    assert [policy.select(REQUEST, candidates).worker.index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_power_of_two_never_takes_the_busier_of_its_pair() -> None:
    policy = build_policy("power_of_two", {"seed": 7})
    candidates = pool((10, 0, 5, 1))
    picks = Counter(policy.select(REQUEST, candidates).worker.index for _ in range(400))
    assert 0 not in picks  # the busiest worker loses every pair it is in
    assert picks[1] > picks[3] > picks[2]


@pytest.mark.parametrize(("session", "reason"), [("alice", "session"), (None, "no_session")])
def test_session_is_sticky_and_survives_removing_another_worker(session: str | None, reason: str) -> None:
    request = replace(REQUEST, session_key=session)
    candidates = pool((0, 0, 0, 0))
    first = chosen("session", candidates, request=request)
    assert first[1] == reason
    if session:
        assert all(chosen("session", candidates, request=request) == first for _ in range(5))
        others = [c for c in candidates if c.worker.index != (first[0] + 1) % 4]
        assert chosen("session", others, request=request) == first


def test_sessions_spread_over_workers() -> None:
    candidates = pool((0, 0, 0, 0))
    spread = Counter(chosen("session", candidates, request=replace(REQUEST, session_key=f"user-{i}"))[0]
                     for i in range(400))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 60


# prefix_affinity: (loads, matches, kv usage, params) -> (worker, reason)
AFFINITY_CASES = [
    pytest.param((0, 0, 0), (0.0, 0.0, 0.0), None, {}, (None, "no_match"), id="cache miss: nobody matches"),
    pytest.param((2, 0, 1), (0.0, 0.0, 0.0), None, {}, (1, "no_match"), id="cache miss goes to the least loaded"),
    pytest.param((3, 0, 0), (0.9, 0.0, 0.2), None, {}, (0, "affinity"), id="longest prefix wins"),
    pytest.param((3, 0, 0), (0.5, 0.0, 0.8), None, {}, (2, "affinity"), id="the longer of two matches"),
    pytest.param((20, 2, 3), (0.9, 0.0, 0.0), None, {}, (1, "load_guard"), id="overloaded affinity worker"),
    pytest.param((10, 2, 3), (0.9, 0.0, 0.0), None, {}, (0, "affinity"), id="within the absolute threshold"),
    pytest.param((30, 20, 25), (0.9, 0.0, 0.0), None, {}, (0, "affinity"), id="within the relative threshold"),
    pytest.param((1, 0, 0), (0.9, 0.0, 0.0), (0.99, 0.3, 0.4), {}, (1, "load_guard"), id="KV cache full"),
    pytest.param((0, 3, 3), (0.9, 0.0, 0.0), (0.99, 0.3, 0.4), {}, (1, "load_guard"),
                 id="KV cache full on the least loaded worker: another one"),
    pytest.param((1, 0, 0), (0.9, 0.0, 0.0), (0.99, 0.99, 0.99), {}, (0, "affinity"), id="every KV cache full"),
    pytest.param((0, 0, 0), (0.05, 0.0, 0.0), None, {}, (None, "no_match"),
                 id="hot prefix: only a shared system prompt matches (500 tokens < 1024)"),
    pytest.param((0, 0, 0), (0.3, 0.0, 0.0), None, {"min_match_ratio": 0.5}, (None, "no_match"),
                 id="below min_match_ratio"),
    pytest.param((1, 0, 0), (0.1, 0.0, 0.0), None, {"min_match_tokens": 1000}, (0, "affinity"),
                 id="a match of exactly min_match_tokens counts"),
    pytest.param((1, 0, 0), (0.0999, 0.0, 0.0), None, {"min_match_tokens": 1000}, (None, "no_match"),
                 id="one token short of min_match_tokens does not"),
]


@pytest.mark.parametrize(("loads", "matches", "kv", "params", "expected"), AFFINITY_CASES)
def test_prefix_affinity(loads: tuple[float, ...], matches: tuple[float, ...], kv: tuple[float | None, ...] | None,
                         params: dict[str, object], expected: tuple[int | None, str]) -> None:
    index, reason = chosen("prefix_affinity", pool(loads, matches, kv), params)
    assert reason == expected[1]
    if expected[0] is not None:
        assert index == expected[0]


def test_hot_prefix_in_every_request_does_not_melt_one_worker() -> None:
    # Every request shares a long prefix held by w0; as w0's load grows the guard sends work elsewhere.
    policy = build_policy("prefix_affinity")
    loads = [0.0, 0.0, 0.0, 0.0]
    for _ in range(200):
        matches = (0.9, 0.0, 0.0, 0.0)
        decision = policy.select(REQUEST, pool(tuple(loads), matches))
        loads[decision.worker.index] += 1
    # w0 stays within the guard's bounds (1.5x the least loaded, or 8 requests more); the rest share evenly.
    assert loads[0] <= max(1.5 * min(loads), min(loads) + 8) + 1
    assert max(loads[1:]) - min(loads[1:]) <= 1
    assert loads[0] > loads[1]


def test_registry_and_params_validation() -> None:
    assert set(POLICIES) == {"prefix_affinity", "least_load", "power_of_two", "round_robin", "session", "ttft_cost"}
    with pytest.raises(ValueError, match="known: "):
        build_policy("nope")
    with pytest.raises(ValidationError):
        build_policy("prefix_affinity", {"balance_rel": 0.5})
    with pytest.raises(ValidationError):
        build_policy("least_load", {"anything": 1})


def test_worker_load_follows_this_replicas_requests_between_scrapes() -> None:
    worker = Worker("p", 0, "http://w:1", ENGINES["vllm"])
    worker.in_flight = 2
    assert worker.load() == 2  # no scrape yet: only what this replica sees
    worker.engine_running, worker.engine_waiting, worker.in_flight_at_scrape = 5.0, 1.0, 2
    assert worker.load() == 6  # the engine's own view includes our 2
    worker.in_flight = 4       # two more started since the scrape
    assert worker.load() == 8
    worker.in_flight = 0       # all of ours finished since the scrape
    assert worker.load() == 4
