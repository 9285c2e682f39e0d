"""A key's remaining rate-limit budget, as the response headers OpenAI's and Anthropic's APIs send it.

The limiters report the key's use with each decision (`limits.Verdict.counts`); `RateLimitStanding`
collects what one request's checks saw (the key's own limits and its limits on the request's model,
`model_limits`) and renders, per limit kind a key has (`requests`, `tokens`), the tightest one: the
one with the least left, since that is the one that refuses the next request first.

OpenAI's names and formats (https://platform.openai.com/docs/guides/rate-limits, "Rate limits in
headers"), on the OpenAI-shaped APIs:

    x-ratelimit-limit-requests: 60          the limit, per minute
    x-ratelimit-remaining-requests: 59      what one more request may still cost now
    x-ratelimit-reset-requests: 1m59.5s     time until the use is back to 0 (Go's duration format)
    x-ratelimit-limit-tokens / -remaining-tokens / -reset-tokens

Anthropic's (https://docs.claude.com/en/api/rate-limits, "Response headers"), on `/v1/messages`
and `/v1/messages/count_tokens`, the reset as an RFC 3339 time (UTC, whole seconds, rounded up):

    anthropic-ratelimit-requests-limit / -remaining / -reset: 2026-01-01T12:01:00Z
    anthropic-ratelimit-tokens-limit / -remaining / -reset

(one token limit covers prompt and output here, so no `-input-tokens-` / `-output-tokens-` ones).
The remaining budget is the sliding-window estimate of `limits.py` (`limits.standing`); a key's
requests are counted as they arrive and its tokens reserved before routing, so a successful answer
shows the budget after its own charge, and a 429 the budget that refused it (with `retry-after`).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from gateway.auth.keys import Principal
from gateway.auth.limits import LimitKind, Verdict, standing
from gateway.dialects.names import RateLimitHeaderStyle

KINDS: tuple[LimitKind, ...] = ("requests", "tokens")

OPENAI_HEADERS = tuple(f"x-ratelimit-{what}-{kind}" for kind in KINDS for what in ("limit", "remaining", "reset"))
ANTHROPIC_HEADERS = tuple(f"anthropic-ratelimit-{kind}-{what}" for kind in KINDS
                          for what in ("limit", "remaining", "reset"))
RATE_LIMIT_HEADERS = OPENAI_HEADERS + ANTHROPIC_HEADERS
"""Every header name this module may send (a browser may read them: `middleware.EXPOSED_HEADERS`)."""


def duration(seconds: float) -> str:
    """`seconds` as Go's `time.Duration` prints it, OpenAI's format for the reset headers, rounded up
    to the millisecond: `0s`, `17ms`, `1.5s`, `6m0s`, `1m59.5s`."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rfc3339(unix: float) -> str:
    """The UTC time `unix` (seconds, rounded up to the second) in RFC 3339: `2026-01-01T12:01:00Z`."""
    return datetime.fromtimestamp(math.ceil(unix), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RateLimitStanding:
    """What one request's quota checks saw of its key's limits (`note`), as response headers in
    `style` (`headers`). Empty (no headers) for a key without limits or when the limiter did not answer."""

    __slots__ = ("_seen", "style")

    def __init__(self, style: RateLimitHeaderStyle = "openai") -> None:
        self.style = style
        self._seen: dict[tuple[str, LimitKind], tuple[int, int, float]] = {}
        """(limiter name, kind) -> (limit, remaining, reset seconds), the latest decision's."""

    def note(self, principal: Principal, verdict: Verdict) -> None:
        """Take in a decision on `principal`'s limits (the key's own, or its limits on one model)."""
        counts = verdict.counts
        if counts is None:
            return
        limits: tuple[tuple[LimitKind, int | None, float, float], ...] = (
            ("requests", principal.requests_per_minute, counts.prev_requests, counts.requests),
            ("tokens", principal.tokens_per_minute, counts.prev_tokens, counts.tokens))
        for kind, limit, prev, cur in limits:
            if limit is not None:
                remaining, reset = standing(limit, prev, cur, counts.elapsed, counts.window)
                self._seen[(principal.name, kind)] = (limit, remaining, reset)

    def tightest(self, kind: LimitKind) -> tuple[int, int, float] | None:
        """(limit, remaining, reset seconds) of the `kind` limit with the least left (None: none seen)."""
        seen = [value for (_, k), value in self._seen.items() if k == kind]
        return min(seen, key=lambda v: (v[1], -v[2])) if seen else None

    def headers(self, now: float | None = None) -> dict[str, str]:
        """The rate-limit headers (lower-case names) in this standing's style; `now`: the wall clock
        (seconds since the epoch) the Anthropic reset times count from."""
        out: dict[str, str] = {}
        for kind in KINDS:
            seen = self.tightest(kind)
            if seen is None:
                continue
            limit, remaining, reset = seen
            if self.style == "anthropic":
                at = rfc3339((datetime.now(UTC).timestamp() if now is None else now) + reset)
                out.update({f"anthropic-ratelimit-{kind}-limit": str(limit),
                            f"anthropic-ratelimit-{kind}-remaining": str(remaining),
                            f"anthropic-ratelimit-{kind}-reset": at})
            else:
                out.update({f"x-ratelimit-limit-{kind}": str(limit), f"x-ratelimit-remaining-{kind}": str(remaining),
                            f"x-ratelimit-reset-{kind}": duration(reset)})
        return out

    def header_list(self) -> list[tuple[bytes, bytes]]:
        """`headers()` as an answer's raw header list."""
        return [(k.encode(), v.encode()) for k, v in self.headers().items()]
