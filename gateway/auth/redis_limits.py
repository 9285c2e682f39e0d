"""Per-key rate limits in Redis, shared by every gateway replica (the rule: `limits.py`).

Key layout: one hash per API key, `{key_prefix}:{key name}` (the configured name, never the key),
with five fields: `w` (the current one-minute window's number, Redis time ÷ 60 s), `r` and `t`
(requests and tokens counted in it), `pr` and `pt` (the same in the window before). It expires two
windows after its last write, so an idle key costs nothing and the store holds at most one hash per
configured key (~150 bytes each), and one more, `{key_prefix}:{key name}/count_tokens`, for a key's
count_tokens requests (`AuthGuard.count_counting`); a key's limits on one model or LoRA adapter
(`auth.keys[].model_limits`) have theirs, `{key_prefix}:{key name}/model/{model}` (and
`.../count_tokens`), the model's canonical name as configured (`keys.model_key`): bounded by the
configured keys and the models their `model_limits` name, never a name a client sent.

Cost: one EVALSHA per limit a request is charged — HMGET + HSET + PEXPIRE of that one key inside a
Lua script, so the check and the count are atomic across replicas, in one round trip; a key with
both limits costs two (the request is counted on arrival, its tokens once estimated: `limits.py`) —
and one more (`REFUND_LUA`: HMGET + HSET + PEXPIRE) when the request ends using another amount
than it reserved (a debt whose window is gone is charged to the current one); the refunds of
requests that end while one is in flight are pipelined together (one round trip, plus the
pipeline's SCRIPT EXISTS, for up to `REFUND_BATCH`). At 1,000 requests/s
that is 1,000 small scripts/s, a few percent of one Redis core. The script reads Redis' own clock
(`TIME`), so replicas whose clocks disagree still agree on the windows. One key per script call
keeps it valid on Redis Cluster.

Failure policy (like the affinity store): a hard timeout per call (`auth.redis_timeout`) of the
call's own time: a deadline the event loop passed while busy with other work is extended
(`gateway/looplag.py`), so the gateway's own stalls are not read as a Redis outage; any error
or timeout returns None (the guard then fails open or closed, `auth.fail_mode`), is counted in
`kimi_gateway_redis_errors_total{op="rate_limit"}`, logged at most once per 10 s, and Redis is
skipped for `auth.redis_retry_after` seconds (a circuit breaker) before it is tried again. The
gateway's own load is no outage (issue 25 §1): at most `POOL_CONNECTIONS` checks are in flight
(`gateway/redis_gate.py`), more wait for a turn up to `redis_gate.WAIT_S` before their timeout
starts, and a check that gets no turn, or that expires while the loop is still lagging or while
other checks are queued for a turn (a burst: the loop reads its replies late), refuses that one
request with RateLimitBusy (503, whatever `fail_mode` says: passing it would let a
burst through its key's limit; no breaker, no Redis error). A command refused with `READONLY`
(a demoted primary) changed nothing and is resent once on a new connection (`DEMOTED_RETRY`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from gateway.auth.keys import Principal
from gateway.auth.limits import WINDOW_S, Counts, LimitKind, Verdict
from gateway.auth.params import AuthConfig
from gateway.errors import RateLimitBusy
from gateway.looplag import SOCKET_BACKSTOP_S, StoreTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.redis_client import DEMOTED_RETRY, close_redis, primary_known, redis_from_url
from gateway.redis_cluster import is_cluster_url
from gateway.redis_gate import WAIT_S, StoreBusy, StoreGate

log = logging.getLogger("gateway.auth")

LOG_EVERY_S = 10.0
POOL_CONNECTIONS = 128
"""Redis connections of one serving process's limiter, and so its checks in flight (`StoreGate`)."""
REFUND_BATCH = 64
"""Refunds sent in one pipeline at most (`RedisRateLimiter.refund`)."""

_WINDOWS_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local now_ms = tonumber(ARGV[5])
if not now_ms then
  local now = redis.call('TIME')
  now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local window = tonumber(ARGV[1])
local index = math.floor(now_ms / window)
local elapsed = now_ms - index * window
local s = redis.call('HMGET', KEYS[1], 'w', 'r', 't', 'pr', 'pt')
local r, t = tonumber(s[2]) or 0, tonumber(s[3]) or 0
local pr, pt = tonumber(s[4]) or 0, tonumber(s[5]) or 0
local w = tonumber(s[1])
if w ~= index then
  if w == index - 1 then pr, pt = r, t else pr, pt = 0, 0 end
  r, t = 0, 0
end
"""
"""The start both scripts share: ARGV[1] the window (ms), ARGV[5] the time in ms or "" (Redis' clock);
the key's hash read into the current window `index` and its counts, rolled as `limits._Windows.roll`."""

# KEYS[1]: the key's hash. ARGV: window (ms), requests limit, tokens limit (-1: no limit), tokens,
# optionally the time in ms (tests compare the script with limits.py on one clock; the gateway
# passes "", so the script reads Redis' clock), and optionally the requests charged (default 1; 0
# when only tokens are charged: `limits.decide`'s `requests`).
# Returns {allowed 0/1, wait ms (-1: never), limit kind, limit, used, requested, window number,
# then the key's counts: previous window's requests and tokens, the current window's (after this
# charge when allowed), ms elapsed in the current window} (`limits.Counts`).
# `wait` is limits.wait_seconds in milliseconds: keep the two equal.
LUA = _WINDOWS_NOW + """
local function wait(limit, prev, cur, cost)
  if limit < 0 or cost <= 0 then return 0 end
  if cost > limit then return math.huge end
  if prev * (window - elapsed) / window + cur + cost <= limit then return 0 end
  if cur + cost <= limit then return window - window * (limit - cur - cost) / prev - elapsed end
  return (window - elapsed) + math.max(0, window - window * (limit - cost) / cur)
end
local tokens = tonumber(ARGV[4])
local requests = tonumber(ARGV[6]) or 1
local checks = {{'requests', tonumber(ARGV[2]), pr, r, requests}, {'tokens', tonumber(ARGV[3]), pt, t, tokens}}
local worst, kind, limit, used, requested = 0, '', 0, 0, 0
for _, c in ipairs(checks) do
  local ms = wait(c[2], c[3], c[4], c[5])
  if ms > 0 and ms > worst then
    worst, kind, limit, requested = ms, c[1], c[2], c[5]
    used = math.floor(c[3] * (window - elapsed) / window + c[4])
  end
end
if worst > 0 then
  if worst == math.huge then worst = -1 else worst = math.ceil(worst) end
  return {0, worst, kind, limit, used, requested, index, pr, r, pt, t, elapsed}
end
redis.call('HSET', KEYS[1], 'w', index, 'r', r + requests, 't', t + tokens, 'pr', pr, 'pt', pt)
redis.call('PEXPIRE', KEYS[1], 2 * window)
return {1, 0, '', 0, 0, 0, index, pr, r + requests, pt, t + tokens, elapsed}
"""

# KEYS[1]: the key's hash. ARGV: the window (ms), the window number the request was counted in,
# requests, tokens to take back (negative: a debt, the request used more than it reserved), and the
# time in ms ("" reads Redis' clock, as in LUA). The hash's windows are rolled to now first (as LUA
# does), so the settlement lands on `r`/`t` when the request's window is the current one, on
# `pr`/`pt` when it is the one before; when it is older its reservation has slid out of the sliding
# window: a refund is then moot and dropped, and a debt is charged to the current window (it is not
# lost with the window). Counts stay >= 0.
REFUND_LUA = _WINDOWS_NOW + """
local target, dr, dt = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if target == index then
  r, t = math.max(0, r - dr), math.max(0, t - dt)
elseif target == index - 1 then
  pr, pt = math.max(0, pr - dr), math.max(0, pt - dt)
elseif dt < 0 then
  t = t - dt
else
  return 0
end
redis.call('HSET', KEYS[1], 'w', index, 'r', r, 't', t, 'pr', pr, 'pt', pt)
redis.call('PEXPIRE', KEYS[1], 2 * window)
return 1
"""


class RedisRateLimiter:
    """The shared limiter. Construction does no I/O: an unreachable Redis never blocks start-up.

    `window_s` is the window of the per-minute limits; only tests change it, as they do `clock`
    (seconds; None, the gateway's choice: the script reads Redis' `TIME`), which lets a test start
    a window when it starts instead of sleeping past a window edge.
    """

    def __init__(self, url: str, config: AuthConfig, metrics: GatewayMetrics, window_s: float = WINDOW_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.window_ms = round(window_s * 1000)
        self._clock = clock
        self.gate = StoreGate(POOL_CONNECTIONS, WAIT_S)
        self.redis = redis_from_url(
            url, socket_connect_timeout=SOCKET_BACKSTOP_S, socket_timeout=SOCKET_BACKSTOP_S,
            retry=DEMOTED_RETRY, max_connections=POOL_CONNECTIONS, health_check_interval=0,
        )
        self.cluster = is_cluster_url(url)
        self._script = self.redis.register_script(LUA)
        self._refund = self.redis.register_script(REFUND_LUA)
        self._skip_until = 0.0
        self._last_log = 0.0
        self._refunds: list[tuple[str, list[int | str], asyncio.Future[None]]] = []  # queued: key, args, answered
        self._refunder: asyncio.Task[None] | None = None

    def key(self, name: str) -> str:
        """The Redis key of the API key called `name` (its configured name, not the key)."""
        return f"{self.config.key_prefix}:{name}"

    @property
    def available(self) -> bool:
        """False while the circuit breaker skips Redis after an error."""
        return time.monotonic() >= self._skip_until

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._skip_until = now + self.config.redis_retry_after
        self.metrics.redis_error("rate_limit")
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("redis rate limit check failed (%s: %s); failing %s for %.1fs", type(exc).__name__, exc,
                        self.config.fail_mode, self.config.redis_retry_after)

    async def acquire(self, principal: Principal, tokens: int, requests: int = 1) -> Verdict | None:
        if not self.available:
            return None
        rpm, tpm = principal.requests_per_minute, principal.tokens_per_minute
        reply = await self._run(self._script, principal, [self.window_ms, -1 if rpm is None else rpm,
                                                           -1 if tpm is None else tpm, tokens, self._now_ms(),
                                                           requests])
        if reply is None:
            return None
        allowed, wait_ms, kind, limit, used, requested, window = reply[:7]
        counts = None
        if len(reply) >= 12:  # Lua numbers reach Redis' reply as integers
            prev_requests, requests_now, prev_tokens, tokens_now, elapsed_ms = (int(v) for v in reply[7:12])
            counts = Counts(prev_requests, requests_now, prev_tokens, tokens_now, elapsed_ms / 1000,
                            self.window_ms / 1000)
        if allowed:
            return Verdict(True, window=int(window), counts=counts)
        retry_after = math.inf if wait_ms < 0 else wait_ms / 1000
        limit_kind: LimitKind = "tokens" if kind in (b"tokens", "tokens") else "requests"
        return Verdict(False, limit_kind, int(limit), int(used), int(requested), retry_after, counts=counts)

    async def _run(self, script: AsyncScript, principal: Principal, args: list[int | str]) -> Any:
        """`script`'s reply for `principal`'s key; None when Redis could not answer (counted, the
        breaker tripped: module doc). Raises RateLimitBusy when the gateway's own load kept the call
        from an answer: no turn within `WAIT_S`, the event loop still held at the deadline, or a
        timeout while other checks waited for a turn (a burst, whose replies the loop reads late)."""
        return await self._call(lambda: script(keys=[self.key(principal.name)], args=args))

    async def _call(self, call: Callable[[], Awaitable[Any]], crowded: bool = False) -> Any:
        """`call()`'s answer under the gate, the timeout and the breaker, as `_run` says. `crowded`:
        the call carries several requests' commands (a pipeline), whose replies the loop reads
        behind each other: its timeout is the gateway's own load, as one while others wait for a turn."""
        try:
            async with self.gate:
                if not self.available:  # Redis failed while this call waited for its turn
                    return None
                await primary_known(self.redis)  # with Sentinel, after a quiet spell: where the primary is now
                started = time.perf_counter()
                timer = StoreTimeout(self.config.redis_timeout)
                try:
                    async with timer:
                        reply = await call()
                except (RedisError, OSError, TimeoutError) as exc:
                    queued = self.gate.queued_behind(exc) or (crowded and isinstance(exc, (TimeoutError,
                                                                                          RedisTimeout)))
                    if not timer.expired_late and not queued:
                        self._failed(exc)
                        return None
                    why = (f"{self.gate.waiting} more checks queued" if self.gate.waiting else
                           "a pipeline of several requests' calls" if queued else "the event loop was still busy")
                    self._busy(f"{why} at the {self.config.redis_timeout:g} s deadline "
                               f"after {time.perf_counter() - started:.3f} s")
                    raise self._busy_error() from None
        except StoreBusy as exc:
            self._busy(str(exc))
            raise self._busy_error() from None
        self.metrics.redis_call("rate_limit", time.perf_counter() - started)
        return reply

    def _busy(self, why: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("rate limit check not answered: %s; refusing that request with 503 (Redis is not "
                        "blamed, the limits stay on)", why)

    @staticmethod
    def _busy_error() -> RateLimitBusy:
        return RateLimitBusy("The gateway is too busy to check rate limits right now; please try again shortly.",
                             headers={"retry-after": "1"})

    def _now_ms(self) -> str:
        """The script's time argument: "" (Redis' clock) unless a test gave a clock."""
        return "" if self._clock is None else str(math.floor(self._clock() * 1000))

    async def refund(self, principal: Principal, window: int, requests: int, tokens: int) -> None:
        """As `RateLimiter.refund`; returns once Redis answered (or could not). The refunds of
        requests ending meanwhile go out together: one pipeline of `REFUND_LUA` calls, at most
        `REFUND_BATCH` of them, while the one before it is in flight (`_send_refunds`)."""
        if not self.available:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._refunds.append((self.key(principal.name),
                              [self.window_ms, window, requests, tokens, self._now_ms()], done))
        if self._refunder is None or self._refunder.done():
            self._refunder = asyncio.create_task(self._send_refunds(), name="rate-limit-refunds")
        await asyncio.shield(done)  # a settle cancelled meanwhile still gives its tokens back

    async def _send_refunds(self) -> None:
        """Send the queued refunds, a batch a round trip, until none is left; each caller is told
        when its batch is answered (or failed: counted and logged by `_call`, the keys stay charged)."""
        try:
            while self._refunds:
                batch, self._refunds = self._refunds[:REFUND_BATCH], self._refunds[REFUND_BATCH:]
                try:
                    if self.available:
                        with contextlib.suppress(RateLimitBusy):  # logged by _call
                            await self._call(functools.partial(self._pipeline_refunds, batch),
                                             crowded=len(batch) > 1)
                finally:
                    for *_, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:  # cancelled: nobody waits for refunds that will not be sent
            left, self._refunds = self._refunds, []
            for *_, done in left:
                if not done.done():
                    done.set_result(None)

    async def _pipeline_refunds(self, batch: list[tuple[str, list[int | str], asyncio.Future[None]]]) -> None:
        """`batch` in one pipeline of `REFUND_LUA` calls (on Redis Cluster with the script's text, as
        EVAL: a cluster pipeline loads no script). The pipeline makes sure the script is on
        its server first (SCRIPT EXISTS, then LOAD when it is not); a server that lost it between
        the two (a failover) answers NoScriptError, and the batch is sent once more, as the
        affinity store's writes are (`gateway/affinity/redis_store.py`)."""
        for attempt in (1, 2):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key, args, _ in batch:
                        if self.cluster:  # a cluster pipeline loads no script: its text
                            pipe.eval(REFUND_LUA, 1, key, *args)
                        else:
                            await self._refund(keys=[key], args=args, client=pipe)
                    await pipe.execute()
                return
            except NoScriptError:
                if attempt == 2:
                    raise

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        if self._refunder is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._refunder
        await close_redis(self.redis, "rate-limit")
