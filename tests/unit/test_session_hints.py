"""Session hints: which one a request's session key comes from, how it is bounded and scoped, and
how the affinity policies use the worker that served the session last."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.affinity.hashing import session_hash
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.worker import Worker
from gateway.config import parse_config
from gateway.parsing import BodyParser
from gateway.routing.features import SESSION_HINT_MAX, RoutingRequest, scoped_session, session_hint
from gateway.routing.policy import Candidate
from gateway.routing.registry import build_policy

CONFIG = parse_config({"pools": [
    {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1"], "max_context_tokens": 8192},
]}, environ={})
HI = [{"role": "user", "content": "hi"}]


def key_of(api: str, payload: dict[str, Any], header: str | None = None) -> str | None:
    parser = BodyParser(CONFIG)
    wire, model, _ = parser.validate(api, {"model": "kimi-k3", **payload})
    return parser.features(wire, model, header, None).session_key


@pytest.mark.parametrize(("api", "payload", "header", "expected"), [
    ("chat", {"messages": HI, "prompt_cache_key": "pck", "user": "u"}, "hdr", "hdr"),
    ("chat", {"messages": HI, "prompt_cache_key": "pck", "user": "u"}, None, "pck"),
    ("chat", {"messages": HI, "prompt_cache_key": 7, "user": "u"}, None, "u"),  # not a string: the engine judges it
    ("chat", {"messages": HI, "prompt_cache_key": "", "user": "u"}, None, "u"),
    ("chat", {"messages": HI, "user": "u"}, "x" * (SESSION_HINT_MAX + 1), "u"),  # over the cap: the next one
    ("chat", {"messages": HI}, None, None),
    ("completions", {"prompt": "hi", "prompt_cache_key": "pck", "user": "u"}, None, "pck"),
    ("responses", {"input": "hi", "prompt_cache_key": "pck", "user": "u"}, None, "pck"),
    ("responses", {"input": "hi", "user": "u"}, None, "u"),
    ("messages", {"max_tokens": 5, "messages": HI, "metadata": {"user_id": "user_abc_session_1"}}, None,
     "user_abc_session_1"),
    ("messages", {"max_tokens": 5, "messages": HI, "metadata": {"user_id": "user_abc"}}, "hdr", "hdr"),
])
def test_the_session_key_comes_from_the_first_usable_hint(api: str, payload: dict[str, Any], header: str | None,
                                                          expected: str | None) -> None:
    assert key_of(api, payload, header) == expected


def test_hints_are_bounded_and_scoped_to_the_api_key() -> None:
    assert session_hint(None, "a" * SESSION_HINT_MAX) == "a" * SESSION_HINT_MAX
    assert session_hint("a" * (SESSION_HINT_MAX + 1)) is None
    alice, bob = scoped_session("conv-1", "alice"), scoped_session("conv-1", "bob")
    anyone = scoped_session("conv-1", None)
    assert len({alice, bob, anyone}) == 3
    assert alice == scoped_session("conv-1", "alice") and len(alice) == 32
    assert session_hash(alice) != session_hash(bob)
    assert len(scoped_session("x" * SESSION_HINT_MAX, "alice")) == 32


REQUEST = RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=10_000, output_tokens=None, stream=False,
                         modalities=frozenset({"text"}), estimate_method="bytes", session_key="s")


def candidates(loads: tuple[float, ...], session: int, matches: tuple[float, ...] | None = None) -> list[Candidate]:
    matches = matches or (0.0,) * len(loads)
    return [Candidate(Worker("p", i, f"http://w{i}:1", ENGINES["vllm"]), load, None, matches[i],
                      int(matches[i] * REQUEST.prompt_tokens), session=i == session)
            for i, load in enumerate(loads)]


@pytest.mark.parametrize(("loads", "matches", "expected"), [
    ((0, 0, 0), None, (2, "session")),  # no prefix anywhere: the session's worker
    ((3, 0, 0), None, (2, "session")),  # a little busier than the rest is no reason to move
    ((0, 0, 20), None, (0, "no_match")),  # the load guard holds against it: least loaded instead
    ((0, 0, 0), (0.0, 0.5, 0.0), (1, "affinity")),  # a real cached prefix beats the hint
    ((0, 0, 0), (0.0, 0.05, 0.0), (2, "session")),  # a match under min_match_tokens (1,024) is none
])
def test_prefix_affinity_sends_an_unmatched_turn_to_its_sessions_worker(
        loads: tuple[float, ...], matches: tuple[float, ...] | None, expected: tuple[int, str]) -> None:
    decision = build_policy("prefix_affinity").select(REQUEST, candidates(loads, 2, matches))
    assert (decision.worker.index, decision.reason) == expected


def test_ttft_cost_breaks_a_tie_without_owner_for_the_sessions_worker() -> None:
    policy = build_policy("ttft_cost")
    decision = policy.select(REQUEST, candidates((0, 0, 0), 1))
    assert (decision.worker.index, decision.reason) == (1, "session")
    busy = [c if c.worker.index != 1 else Candidate(c.worker, c.load, None, queued_tokens=50_000, session=True)
            for c in candidates((0, 0, 0), 1)]
    assert policy.select(REQUEST, busy).reason == "no_match"  # its wait is far longer: not a tie
