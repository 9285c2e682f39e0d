"""Policies: table-driven choices among candidate workers."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.backends.engines import ENGINES
from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest
from gateway.routing.registry import POLICIES, build_policy

REQUEST = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=10, output_tokens=None, stream=False,
                         modalities=frozenset({"text"}), estimate_method="bytes")


def workers(*in_flight: int) -> list[Worker]:
    return [Worker("p", i, f"http://w{i}:1", ENGINES["vllm"], in_flight=n) for i, n in enumerate(in_flight)]


@pytest.mark.parametrize(("loads", "expected"), [
    ((0,), 0),
    ((3, 1, 2), 1),
    ((5, 5, 0), 2),
    ((0, 9, 9), 0),
])
def test_least_load_takes_the_fewest_in_flight(loads: tuple[int, ...], expected: int) -> None:
    policy = build_policy("least_load")
    for _ in range(4):
        decision = policy.select(REQUEST, workers(*loads))
        assert (decision.worker.index, decision.reason) == (expected, "least_load")


def test_least_load_spreads_ties() -> None:
    policy = build_policy("least_load")
    pool = workers(0, 0, 0)
    assert Counter(policy.select(REQUEST, pool).worker.index for _ in range(30)) == {0: 10, 1: 10, 2: 10}


def test_round_robin_cycles() -> None:
    policy = build_policy("round_robin")
    pool = workers(9, 0, 0)
    assert [policy.select(REQUEST, pool).worker.index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_registry() -> None:
    assert set(POLICIES) >= {"least_load", "round_robin"}
    with pytest.raises(ValueError, match="known: "):
        build_policy("nope")
