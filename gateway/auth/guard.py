"""`AuthGuard`: what the request path asks about the caller — who is it, may it, is it within quota.

Built once in `AppState` when `auth.enabled`; None otherwise (everything is open). The errors are
OpenAI's (https://platform.openai.com/docs/guides/error-codes):

- 401 `invalid_api_key` for a missing, malformed or unknown key (type `invalid_request_error`, as OpenAI);
- 403 `insufficient_permissions` for a key without the scope a route needs;
- 404 `model_not_found` for a model the key may not use (`check_model`, `errors.ModelNotPermitted`),
  exactly what OpenAI answers for a model the key has no access to and byte for byte what the
  gateway answers for a name no model has (the name as sent, at the same step), so a key learns
  nothing of the models beyond its own;
- 429 `rate_limit_exceeded`, `type` `requests` or `tokens` as OpenAI sends it, with `Retry-After`
  (seconds) and OpenAI's wording ("Rate limit reached ... on tokens per min (TPM): Limit L, Used U,
  Requested R. Please try again in Ns."); a request larger than its key's whole token limit gets
  OpenAI's "Request too large" 429 with `x-should-retry: false` (the OpenAI SDKs then do not retry);
  a 429 and a served request of a limited key carry its remaining budget as OpenAI's
  `x-ratelimit-*` or Anthropic's `anthropic-ratelimit-*` headers (`standing.RateLimitStanding`);
- 503 `rate_limit_unavailable` with `Retry-After` when Redis cannot answer and `fail_mode: closed`,
  and whatever `fail_mode` says when the gateway itself was too busy to ask Redis in time
  (`RateLimitBusy`: every connection taken for the wait deadline, `gateway/redis_gate.py`).

A quota check returns a `Reservation`; the request path settles it when the request ends
(`settle`: to the tokens used, or all of it back when no engine worked on the request). A key's
limits on the request's model (`model_limits`) are checked with its own, in the same `check_quota`
(one more limiter call, under the limiter name `keys.model_key`), and settled with them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.auth.access import allowed_models, canonical, model_names, model_not_found_message
from gateway.auth.keys import KeyRing, Principal, Scope, bearer_token, key_id
from gateway.auth.limits import MemoryRateLimiter, RateLimiter, Verdict
from gateway.auth.params import AuthConfig
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.auth.standing import RateLimitStanding
from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    ModelNotPermitted,
    PermissionDenied,
    RateLimitBusy,
    RateLimited,
    RateLimitUnavailable,
)
from gateway.observability.metrics import GatewayMetrics

log = logging.getLogger("gateway.auth")

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."  # never echo the key, not even masked
PER_MIN = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


@dataclass(slots=True)
class Reservation:
    """What the quota checks counted for one request: `requests` requests (1, or 0 when
    `AuthGuard.count_request` counted it on arrival: that Reservation is `counted`) and `tokens`
    tokens in the limiter's fixed window number `window`; `settled` once `AuthGuard.settle` took
    its part back. `model`: what the key's limits on the request's model counted (a Reservation of
    its per-model Principal), settled as this one is."""

    principal: Principal
    tokens: int
    window: int
    settled: bool = False
    requests: int = 1
    counted: Reservation | None = None
    model: Reservation | None = None


class AuthGuard:
    """Authentication (key ring), authorization (scopes) and per-key quotas (a rate limiter)."""

    def __init__(self, config: AuthConfig, keys: KeyRing, limiter: RateLimiter, metrics: GatewayMetrics) -> None:
        self.config = config
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        # `key` label of the open /metrics: a key id unless names are configured to show.
        self.metric_labels = {key.name: key.name if config.metric_key_names else key_id(key.sha256)
                              for key in config.keys}
        self._settling: set[asyncio.Task[None]] = set()  # settles started from sync code (`settle_soon`)

    @classmethod
    def build(cls, config: GatewayConfig, metrics: GatewayMetrics) -> AuthGuard | None:
        """The guard for `config` (no I/O): limits in Redis when `redis_url` is set, else in-process.
        None when auth is disabled."""
        auth = config.auth
        if not auth.enabled:
            return None
        limiter: RateLimiter = (RedisRateLimiter(config.redis_url, auth, metrics) if config.redis_url
                                else MemoryRateLimiter())
        names = model_names(config)
        keys = KeyRing(auth.keys, names)
        for key in auth.keys:
            allowed = allowed_models(key.models, names)
            for entry in key.model_limits:
                if allowed is not None and canonical(entry, names) not in allowed:
                    log.warning("auth.keys %s: model_limits names %r, which its models leave out: moot",
                                key.name, entry)
        return cls(auth, keys, limiter, metrics)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `Authorization` header value. Raises InvalidApiKey (401)."""
        token = bearer_token(authorization)
        if token is None:
            self.metrics.auth_failure("missing")
            raise InvalidApiKey(MISSING_KEY, headers={"www-authenticate": "Bearer"})
        principal = self.keys.lookup(token)
        if principal is None:
            self.metrics.auth_failure("invalid")
            raise InvalidApiKey(WRONG_KEY, headers={"www-authenticate": 'Bearer error="invalid_token"'})
        return principal

    def authenticate_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> Principal:
        """The principal of an ASGI request's headers (lower-case names): the key of its
        `Authorization: Bearer` or `x-api-key` header. Raises InvalidApiKey (401), also for more
        than one such header with different values: a proxy that kept the other one would see
        another caller."""
        values = [value for name, value in headers if name == b"authorization"]
        # Anthropic's SDKs send the key as `x-api-key` (https://docs.claude.com/en/api/overview):
        # the same keys, as if it came as a bearer token.
        api_keys = [b"Bearer " + value for name, value in headers if name == b"x-api-key"]
        if len(values) > 1 or len(api_keys) > 1 or (values and api_keys and values != api_keys):
            self.metrics.auth_failure("invalid")
            what = "Authorization" if len(values) > 1 else "x-api-key" if len(api_keys) > 1 else \
                "Authorization or x-api-key"
            count = len(values) if len(values) > 1 else len(api_keys) if len(api_keys) > 1 else 2
            raise InvalidApiKey(f"Send one {what} header; this request has {count}.",
                                headers={"www-authenticate": 'Bearer error="invalid_request"'})
        values = values or api_keys
        return self.authenticate(values[0].decode("latin-1") if values else None)

    def authorize(self, principal: Principal, scope: Scope) -> None:
        """Raises PermissionDenied (403) unless the principal has `scope`."""
        if not principal.has(scope):
            self.metrics.auth_failure("forbidden")
            raise PermissionDenied(f"You have insufficient permissions for this operation. Missing scope: {scope}.")

    def check_model(self, principal: Principal, model: str, sent: str | None = None) -> None:
        """Raises ModelNotPermitted (404 `model_not_found`, OpenAI's answer for a model the key has no
        access to, in every byte the answer of a model that does not exist) unless the key may use
        `model`, the request's resolved name (its model's canonical name or its LoRA adapter's:
        `RoutingRequest.model`); the message names `sent`, the name as the client sent it (an alias
        must not name its model), else `model`. Counted as `refused_model`. The proxied APIs check
        while parsing (`BodyParser.validate`), before any estimate, so that a refusal costs the
        gateway no more work than an unknown name does; call this as early on any other route."""
        if not principal.may_use(model):
            self.refused_model()
            raise ModelNotPermitted(model_not_found_message(sent or model), model=model, param="model")

    def refused_model(self) -> None:
        """Count a request refused for a model its key may not use, in
        `kimi_gateway_auth_failures_total{reason="model"}`."""
        self.metrics.auth_failure("model")

    async def count_request(self, principal: Principal,
                            standing: RateLimitStanding | None = None) -> Reservation | None:
        """Count one request against the key's request limit only (no tokens), as soon as the request
        arrives: before its body is parsed, measured or its image URLs fetched, so a request that
        turns out invalid or too long still costs its sender one request. Returns the Reservation
        to hand to `check_quota` (None when nothing was counted). Raises as `check_quota`; the
        decision is noted in `standing` (the request's rate-limit headers), as `check_quota`'s."""
        if principal.requests_per_minute is None:
            return None
        window = await self._acquire(principal, 0, 1, standing=standing)
        return None if window is None else Reservation(principal, 0, window)

    async def count_counting(self, principal: Principal) -> None:
        """Count one `POST /v1/messages/count_tokens` request against the key's own limit for them
        (`Principal.count_tokens_per_minute`), apart from its other limits: Anthropic does not bill
        token counting and limits it by requests per minute, separately from message creation
        (https://docs.claude.com/en/docs/build-with-claude/token-counting). It costs the engine a
        tokenizer pass, no generation, so it takes no token quota (a client counting before each
        send would otherwise pay twice). It still counts against `requests_per_minute` like any
        request (`count_request`). Never given back. Raises as `check_quota`."""
        if principal.count_tokens_per_minute is None:
            return
        counter = Principal(f"{principal.name}/count_tokens", principal.scopes, principal.count_tokens_per_minute)
        await self._acquire(counter, 0, 1, principal.name)

    async def check_quota(self, principal: Principal, tokens: int, requests: int = 1,
                          counted: Reservation | None = None, model: str | None = None,
                          counting: bool = False, standing: RateLimitStanding | None = None) -> Reservation | None:
        """Count `requests` requests (1; 0 when `count_request` already counted it, whose Reservation
        is `counted`) of `tokens` tokens (estimated prompt + requested output) against the key's
        limits, then (`model`: the request's resolved model name) one request of those tokens against
        the key's limits on that model (`model_limits`; `counting`: a count_tokens request, also
        against that model's count_tokens limit): the Reservation to settle when the request ends
        (it settles `counted` and the model's too), None when nothing was counted (a key without
        limits, or the limiter down and `fail_mode: open`). A refusal by the model's limits gives
        the key's tokens just reserved back. Raises RateLimited (429), or RateLimitUnavailable (503)
        when the limiter cannot answer and `fail_mode` is `closed`. Every decision is noted in
        `standing` (None: not wanted), and a 429 carries the rate-limit headers it then renders."""
        reservation = counted
        if principal.limited and (requests or principal.tokens_per_minute is not None):
            window = await self._acquire(principal, tokens, requests, standing=standing)
            if window is not None:
                reservation = Reservation(principal, tokens, window, requests=requests, counted=counted)
        limits = principal.model_limits.get(model) if model is not None else None
        if limits is None:
            return reservation
        try:
            per_model = await self._check_model_quota(principal, limits, model or "", tokens, counting, standing)
        except GatewayError:
            if reservation is not None and reservation is not counted and reservation.tokens:
                await self.limiter.refund(principal, reservation.window, 0, reservation.tokens)
            raise
        if per_model is None:
            return reservation
        if reservation is None:
            return per_model
        reservation.model = per_model
        return reservation

    async def _check_model_quota(self, principal: Principal, limits: Principal, model: str, tokens: int,
                                 counting: bool, standing: RateLimitStanding | None = None) -> Reservation | None:
        """One request of `tokens` tokens (none without a token limit on the model) against key
        `principal`'s `limits` on `model`, after that model's count_tokens limit for a count_tokens
        request (`counting`, never given back, as the key's own: `count_counting`). The Reservation
        (None: not counted; `standing`: as `check_quota`'s). Raises as `check_quota`."""
        if counting and limits.count_tokens_per_minute is not None:
            counter = Principal(f"{limits.name}/count_tokens", limits.scopes, limits.count_tokens_per_minute)
            await self._acquire(counter, 0, 1, principal.name, model)
        if not limits.limited:
            return None
        charged = tokens if limits.tokens_per_minute is not None else 0
        window = await self._acquire(limits, charged, 1, principal.name, model, standing)
        return None if window is None else Reservation(limits, charged, window)

    async def _acquire(self, principal: Principal, tokens: int, requests: int, label: str | None = None,
                       model: str | None = None, standing: RateLimitStanding | None = None) -> int | None:
        """The limiter's window number the charge was counted in; None when it was not counted
        (`label`, `model`, `standing`: as `_acquired`'s). Raises RateLimitBusy when the gateway could
        not finish the check."""
        try:
            verdict = await self.limiter.acquire(principal, tokens, requests)
        except RateLimitBusy:
            self.metrics.rate_limit_unanswered("refused")
            raise
        return self._acquired(principal, verdict, label, model, standing)

    def _acquired(self, principal: Principal, verdict: Verdict | None, label: str | None = None,
                  model: str | None = None, standing: RateLimitStanding | None = None) -> int | None:
        """`_acquire`'s answer for the limiter's `verdict` on `principal` (`label`: the key name its
        metrics go under, when another than the principal's; `model`: the model whose limits
        `principal` holds, None for the key's own; `standing`: where the decision is noted, and
        whose headers a refusal carries)."""
        if verdict is not None and standing is not None:
            standing.note(principal, verdict)
        if verdict is None:
            if self.config.fail_mode == "open":
                self.metrics.rate_limit_unanswered("allowed")
                return None
            self.metrics.rate_limit_unanswered("refused")
            retry = max(1, math.ceil(self.config.redis_retry_after))
            raise RateLimitUnavailable("Rate limits cannot be checked right now; please try again shortly.",
                                       headers={"retry-after": str(retry)})
        if verdict.allowed:
            return verdict.window
        assert verdict.limit is not None
        key = self.metric_labels.get(label or principal.name, "unknown")
        self.metrics.rate_limit_refused(key, verdict.limit)
        if model is not None:
            self.metrics.model_rate_limit_refused(key, model, verdict.limit)
        refused = rate_limited(principal, verdict, label if model is not None else None, model)
        if standing is not None:
            refused.headers.update(standing.headers())
        raise refused

    async def settle(self, reservation: Reservation, used_tokens: int | None) -> None:
        """Settle a reservation once its request ended: charge `used_tokens` instead of the tokens
        reserved (more or less), or, with None (no engine worked on the request), take the request
        and all its tokens back. Once per reservation; never raises."""
        if reservation.settled:
            return
        reservation.settled = True
        if used_tokens is None:
            requests, tokens = reservation.requests, reservation.tokens
        else:  # a request-count-only reservation has no tokens to settle
            requests, tokens = 0, (reservation.tokens - used_tokens if reservation.tokens else 0)
        if requests or tokens:
            await self.limiter.refund(reservation.principal, reservation.window, requests, tokens)
        if reservation.counted is not None and used_tokens is None:
            await self.settle(reservation.counted, None)
        if reservation.model is not None:
            await self.settle(reservation.model, used_tokens)

    def settle_soon(self, reservation: Reservation, used_tokens: int | None) -> None:
        """`settle` from synchronous code on the event loop (a request's end): runs as a task that
        `stop()` waits for."""
        if reservation.settled:
            return
        task = asyncio.get_running_loop().create_task(self.settle(reservation, used_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def start(self) -> None:
        await self.limiter.start()

    async def stop(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self.limiter.stop()


def rate_limited(principal: Principal, verdict: Verdict, key: str | None = None,
                 model: str | None = None) -> RateLimited:
    """The 429 for a refused verdict, worded as OpenAI words it (key `key`, else the principal's
    name; with `model`, a refusal by the key's limits on that model: "for MODEL for API key K",
    as OpenAI names the model whose limit was reached)."""
    kind = verdict.limit or "requests"
    name = key or principal.name
    what = f"for API key {name} on {PER_MIN[kind]}" if model is None else \
        f"for {model[:200]} for API key {name} on {PER_MIN[kind]}"
    if math.isinf(verdict.retry_after):
        return RateLimited(
            f"Request too large {what}: Limit {verdict.limit_value}, Requested {verdict.requested}. "
            "The input or output tokens must be reduced in order to run successfully.",
            kind, headers={"x-should-retry": "false"})
    retry = max(1, math.ceil(verdict.retry_after))
    return RateLimited(
        f"Rate limit reached {what}: Limit {verdict.limit_value}, Used {verdict.used}, "
        f"Requested {verdict.requested}. Please try again in {verdict.retry_after:.3g}s.",
        kind, headers={"retry-after": str(retry)})
