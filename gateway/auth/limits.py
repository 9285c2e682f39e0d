"""Per-key rate limits: the sliding-window rule, the `RateLimiter` interface, the in-process limiter.

Two limits per key, both per minute: requests (`requests_per_minute`, each request costs 1) and
tokens (`tokens_per_minute`). Like OpenAI, a request is charged up front with its estimated prompt
tokens + the output tokens it asked for, else the first fitting pool's `default_output_tokens`
(https://platform.openai.com/docs/guides/rate-limits: "your rate limit is calculated as the
maximum of max_tokens and the estimated number of tokens based on the character count"). Unlike
a flat charge, the reservation is settled when the request ends (`RateLimiter.refund`, called by
`AuthGuard.settle`): down (or up) to what it used, and in full, request included, when it failed
before any engine worked on it, so clients retrying through an outage do not exhaust their key.
A settlement that arrives after its window slid out charges a debt to the current window (a
refund is then moot). For a key with a token limit the engine is sent the output limit that was
reserved (`ProxyService.handle`), so what a request generates stays within what it was charged.

Algorithm: a *sliding window counter* (the approximation Cloudflare and nginx-style limiters use).
Time is cut into fixed one-minute windows; the use over the last 60 s is estimated as

    previous window's count * (share of it still inside the last 60 s) + current window's count

A request passes only if that estimate + its cost stays within the limit, and then both of its
costs are added (a refused request costs nothing, so the Retry-After it gets stays true). The
gateway asks twice per request (`AuthGuard.count_request`, then `check_quota`): the request is
counted against the request limit as soon as it arrives, before its body is parsed or its image
URLs fetched (a body that turns out invalid or too long still cost its sender one request, so
such bodies cannot be sent for free); its tokens once they are estimated. Why this
and not the alternatives:

- a plain fixed window lets a client spend twice its limit across a window edge (all at 0:59, all
  again at 1:00); the weighted previous window smooths the edge away;
- a token bucket (GCRA) lets a full bucket plus a minute of refill through in the first minute,
  also up to twice the limit "per minute";
- an exact sliding log stores every request (unbounded per key) — here the state is five numbers
  per key, one small Redis hash, updated in one round trip.

The estimate assumes the previous window's use was spread evenly; the error is small in practice
(Cloudflare measured 0.003 % of requests wrongly allowed or refused) and never lets through more
than the limit within one fixed window. Retry-After is the exact time until the request would fit
if no other traffic arrived (a lower bound when the key keeps sending).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from gateway.auth.keys import Principal

WINDOW_S = 60.0
"""The window of `requests_per_minute` / `tokens_per_minute`, seconds. Limiters take another only in tests."""

LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class Counts:
    """A key's use as a limiter saw it when it decided: requests and tokens counted in the fixed
    window before the current one (`prev_*`) and in the current one (after this request's charge
    when it was allowed, before it when refused), `elapsed` seconds into the current window of
    `window` seconds. What `standing` reads a key's remaining budget from."""

    prev_requests: float
    requests: float
    prev_tokens: float
    tokens: float
    elapsed: float
    window: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """One quota decision.

    When refused: the limit that refused it (`requests` or `tokens`), that limit's value per window,
    the estimated use of the last window before this request (`used`), what this request needed
    (`requested`), and `retry_after`, seconds until it would fit (`math.inf`: never — the request
    alone is larger than the limit). When allowed by a limiter that counted it: `window`, the
    number of the fixed window it was counted in (what `RateLimiter.refund` takes back from).
    `counts`: the key's use the decision saw (None: the limiter did not say), for the rate-limit
    headers (`auth/standing.py`); not part of the verdict's equality.
    """

    allowed: bool
    limit: LimitKind | None = None
    limit_value: int = 0
    used: int = 0
    requested: int = 0
    retry_after: float = 0.0
    window: int | None = None
    counts: Counts | None = field(default=None, compare=False)


ALLOWED = Verdict(True)


def wait_seconds(limit: int | None, prev: float, cur: float, cost: int, elapsed: float, window: float) -> float:
    """Seconds until `cost` more fits under `limit` in the sliding window: 0 when it fits now,
    `math.inf` when it never will (`cost > limit`), 0 when there is no limit.

    `cur` is the use in the current fixed window, which started `elapsed` seconds ago, `prev` the use
    in the window before. `redis_limits.LUA` computes exactly this in milliseconds; keep them equal.
    """
    if limit is None:
        return 0.0
    if cost > limit:
        return math.inf
    if prev * (window - elapsed) / window + cur + cost <= limit:
        return 0.0
    if cur + cost <= limit:  # fits in this window once enough of the previous one slid out (prev > 0)
        return window - window * (limit - cur - cost) / prev - elapsed
    # Only in the next window, where this window's use becomes the previous one (cur > 0 here).
    return (window - elapsed) + max(0.0, window - window * (limit - cost) / cur)


def standing(limit: int, prev: float, cur: float, elapsed: float, window: float) -> tuple[int, float]:
    """(remaining, reset) of one limit of `limit` per window given the use `prev` and `cur` in the
    previous and current fixed window, `elapsed` seconds into the current one: `remaining`, what
    one more request may still cost now (the limit less the sliding estimate, at least 0), and
    `reset`, seconds until the estimate is back to 0 if nothing more is sent (the current window's
    use slides out at the end of the next window, the previous one's at the end of this one)."""
    used = prev * (window - elapsed) / window + cur
    remaining = max(0, math.floor(limit - used + 1e-9))
    reset = (window - elapsed) + window if cur > 0 else window - elapsed if prev > 0 else 0.0
    return remaining, reset


def decide(principal: Principal, tokens: int, prev: tuple[float, float], cur: tuple[float, float],
           elapsed: float, window: float, requests: int = 1) -> Verdict:
    """The verdict for `requests` requests (1, or 0 when only tokens are charged) of `tokens` tokens,
    given (requests, tokens) used in the previous and the current window. When both limits refuse,
    the one with the longer wait is reported. A cost of 0 always fits."""
    worst = ALLOWED
    checks: tuple[tuple[LimitKind, int | None, int], ...] = (
        ("requests", principal.requests_per_minute, requests), ("tokens", principal.tokens_per_minute, tokens))
    for i, (kind, limit, cost) in enumerate(checks):
        if cost <= 0:  # not charged this time (see `requests`); a lowered limit must not refuse it
            continue
        wait = wait_seconds(limit, prev[i], cur[i], cost, elapsed, window)
        if wait > 0 and wait > worst.retry_after:
            used = math.floor(prev[i] * (window - elapsed) / window + cur[i])
            worst = Verdict(False, kind, limit or 0, used, cost, wait)
    return worst


class RateLimiter(Protocol):
    """Per-key request and token limits. `acquire` raises only `errors.RateLimitBusy`."""

    async def acquire(self, principal: Principal, tokens: int, requests: int = 1) -> Verdict | None:
        """Check `requests` requests (1; 0 to charge tokens only) of `tokens` tokens against the key's
        limits and, if they pass, count them.

        None when the limiter could not answer (Redis down, timed out, circuit open: the
        implementation counts it); the caller then fails open or closed as configured. Raises
        `errors.RateLimitBusy` (503) when the gateway's own load kept it from an answer (no turn
        to Redis within its wait deadline): not an outage, so never failed open.
        """
        ...

    async def refund(self, principal: Principal, window: int, requests: int, tokens: int) -> None:
        """Take `requests` and `tokens` back from what fixed window number `window` counted (negative
        `tokens` add: a request that used more than it reserved). Counts never go below 0. When
        `window` is older than the one before the current window (a long stream, a background
        response), its reservation has already slid out: a refund is dropped, and a debt (negative
        `tokens`) is charged to the current window, so a late settlement is never lost. Never raises
        (a Redis failure is counted and the refund lost: the key stays charged, as without settling).
        """
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class _Windows:
    """One key's use: the current fixed window's number and (requests, tokens) in it and the one before."""

    index: int
    requests: float = 0.0
    tokens: float = 0.0
    prev_requests: float = 0.0
    prev_tokens: float = 0.0

    def roll(self, index: int) -> None:
        if index == self.index:
            return
        if index == self.index + 1:
            self.prev_requests, self.prev_tokens = self.requests, self.tokens
        else:
            self.prev_requests = self.prev_tokens = 0.0
        self.requests = self.tokens = 0.0
        self.index = index


class MemoryRateLimiter:
    """The limiter for a single replica (no `redis_url`): one `_Windows` per key name.

    Bounded by the number of configured keys. `clock` (seconds) and `window_s` are for tests.
    Never fails, so it never returns None.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window_s
        self._clock = clock
        self._keys: dict[str, _Windows] = {}

    async def acquire(self, principal: Principal, tokens: int, requests: int = 1) -> Verdict:
        now = self._clock()
        index = math.floor(now / self.window)
        elapsed = now - index * self.window
        windows = self._keys.get(principal.name)
        if windows is None:
            windows = self._keys[principal.name] = _Windows(index)
        windows.roll(index)
        verdict = decide(principal, tokens, (windows.prev_requests, windows.prev_tokens),
                         (windows.requests, windows.tokens), elapsed, self.window, requests)
        if verdict.allowed:
            windows.requests += requests
            windows.tokens += tokens
            verdict = Verdict(True, window=index)
        return replace(verdict, counts=Counts(windows.prev_requests, windows.requests, windows.prev_tokens,
                                              windows.tokens, elapsed, self.window))

    async def refund(self, principal: Principal, window: int, requests: int, tokens: int) -> None:
        index = math.floor(self._clock() / self.window)
        windows = self._keys.get(principal.name)
        if windows is None:
            if tokens >= 0:
                return
            windows = self._keys[principal.name] = _Windows(index)
        windows.roll(index)  # as acquire does: the settlement lands on the windows as they are now
        if window == index:
            windows.requests = max(0.0, windows.requests - requests)
            windows.tokens = max(0.0, windows.tokens - tokens)
        elif window == index - 1:
            windows.prev_requests = max(0.0, windows.prev_requests - requests)
            windows.prev_tokens = max(0.0, windows.prev_tokens - tokens)
        elif tokens < 0:  # a debt whose window is gone: charged to this one
            windows.tokens -= tokens

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._keys.clear()
