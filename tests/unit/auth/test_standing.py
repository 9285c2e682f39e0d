"""The rate-limit headers' arithmetic and formats (`gateway/auth/standing.py`, `limits.standing`)."""

from __future__ import annotations

import pytest

from gateway.auth.keys import Principal
from gateway.auth.limits import Counts, Verdict, standing
from gateway.auth.standing import RateLimitStanding, duration, rfc3339


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.0004, "1ms"), (0.017, "17ms"), (1, "1s"), (1.5, "1.5s"), (59.9991, "1m0s"), (60, "1m0s"),
    (119.25, "1m59.25s"), (360, "6m0s")])
def test_durations_are_gos(seconds: float, text: str) -> None:
    assert duration(seconds) == text  # OpenAI's examples: "1s", "6m0s"; rounded up, never sooner than true


def test_reset_times_are_rfc3339_utc_rounded_up() -> None:
    assert rfc3339(1767268859.2) == "2026-01-01T12:01:00Z"


def test_remaining_and_reset_follow_the_sliding_window() -> None:
    # 10 s into a window, 60 used in the previous one (50 of it still counted) and 20 in this one
    assert standing(100, 60, 20, 10, 60) == (30, 50 + 60)
    assert standing(100, 60, 0, 10, 60) == (50, 50)  # only the previous window's use: gone at its end
    assert standing(100, 0, 0, 10, 60) == (100, 0)
    assert standing(100, 300, 0, 0, 60) == (0, 60)  # never below 0


def test_the_tightest_limit_of_each_kind_is_shown() -> None:
    key = Principal("k", frozenset({"user"}), 50, 1000)
    per_model = Principal("k/model/m", frozenset({"user"}), 2)
    noted = RateLimitStanding()
    noted.note(key, Verdict(True, window=1, counts=Counts(0, 1, 0, 100, 0, 60)))
    noted.note(per_model, Verdict(True, window=1, counts=Counts(0, 1, 0, 0, 0, 60)))
    assert noted.headers() == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1", "x-ratelimit-reset-requests": "2m0s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "2m0s"}
    anthropic = RateLimitStanding("anthropic")
    anthropic.note(key, Verdict(True, window=1, counts=Counts(0, 1, 0, 100, 0, 60)))
    assert anthropic.headers(now=1767268800) == {
        "anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "49",
        "anthropic-ratelimit-requests-reset": "2026-01-01T12:02:00Z", "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "900", "anthropic-ratelimit-tokens-reset": "2026-01-01T12:02:00Z"}
    assert RateLimitStanding().headers() == {}  # no limiter answer, no headers
