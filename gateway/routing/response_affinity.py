"""Where a Responses API follow-up must go: the worker that stores the response it names.

A request with `previous_response_id`, and `GET/DELETE/POST …/cancel /v1/responses/{id}`, can only
be served by the engine process that created that response (its history lives in that process's
memory). `owner_of` finds that worker from the response store (gateway/affinity/response_store.py)
and the registry, bypassing the pool's policy (no other worker could serve it) but not its health:

- unknown id, or another tenant's: (never seen, `store: false`, expired after `responses.store_ttl`, or created
  through an engine that stores nothing), or stored by another API key: **404**
  `response_not_found`, as OpenAI answers an unknown id; the client's SDK raises NotFoundError and
  does not retry. Ownership (auth on): the store records the name of the key that created each
  response; only that key, or a key with the `admin` scope (the operators', who may already drain
  and reload the gateway), may continue, read, delete or cancel it. Another key gets exactly the
  unknown id's answer (same status, code, message; counted as `unknown`), so ids do not leak
  whether they exist. A response recorded without an owner (created while auth was off) is then
  open to admin keys only. With auth off nothing is checked.
- the owning worker is no longer configured or discovered (scaled away, removed by a reload):
  **404** `response_worker_gone`. Its process memory, and the stored response with it, is gone for
  good: a retry can never succeed, and OpenAI's SDKs retry 5xx but not 404. The message says to
  resend the conversation without `previous_response_id`.
- the owning worker is known but out of service (failing health probes, ejected, misconfigured,
  backing off after a 429): **503** `response_worker_unavailable` with `Retry-After`: it may come
  back with its memory (a network blip, an overload), so a retry is worth it (the SDKs retry 503).
  A draining worker still serves its own follow-ups: the history is nowhere else.

- the shared store (Redis) does not answer: **503** `response_store_unavailable` (retryable).

Each outcome counts in
`kimi_gateway_response_affinity_total{result=hit|unknown|worker_gone|worker_unavailable|store_error}`.

Context length: the stored history is on the engine, so a follow-up goes to its owner whatever its
pool's context (the new input alone must still fit some pool), and an engine's "too long" answer is
passed back as is (no larger pool holds the history).

Quota: the engine prefills the whole stored conversation before the new input, so `follow_up_of`
also answers its size, as the store keeps it (`ResponseOwner.context_tokens`), for the key's
token reservation (`ProxyService.handle`).
"""

from __future__ import annotations

import math

from gateway.affinity.response_store import ResponseOwner, ResponseStore, ResponseStoreUnavailable
from gateway.auth.keys import Principal
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.errors import GatewayError
from gateway.observability.metrics import GatewayMetrics


class ResponseNotFound(GatewayError):
    """404 `response_not_found`: the gateway knows no stored response by that id."""

    status = 404
    error_type = "invalid_request_error"
    code = "response_not_found"


class ResponseWorkerGone(GatewayError):
    """404 `response_worker_gone`: the worker that stored the response left the gateway's pools."""

    status = 404
    error_type = "invalid_request_error"
    code = "response_worker_gone"


class ResponseWorkerUnavailable(GatewayError):
    """503 `response_worker_unavailable`: the worker that stores the response is out of service now."""

    status = 503
    error_type = "server_error"
    code = "response_worker_unavailable"


async def owner_of(response_id: str, param: str | None, store: ResponseStore | None, registry: WorkerRegistry,
                   pools: list[PoolConfig], metrics: GatewayMetrics,
                   principal: Principal | None = None) -> tuple[PoolConfig, Worker]:
    """The pool config and worker that store `response_id`, for the caller `principal` (None: auth
    off, no ownership check). `param` names the request field the id came from
    (`previous_response_id`, or None for a path). Raises ResponseNotFound (also for another key's
    response),
    ResponseWorkerGone, ResponseWorkerUnavailable, ResponseStoreUnavailable (module docstring) and
    counts the outcome."""
    pool, worker, _ = await _resolve(response_id, param, store, registry, pools, metrics, principal)
    return pool, worker


async def follow_up_of(response_id: str, store: ResponseStore | None, registry: WorkerRegistry,
                       pools: list[PoolConfig], metrics: GatewayMetrics,
                       principal: Principal | None = None) -> tuple[PoolConfig, Worker, int]:
    """`owner_of` for a request's `previous_response_id`, and the tokens of the stored conversation
    the engine prefills before its new input (`ResponseOwner.context_tokens`; 0 when the store does
    not know them: a record written before they were kept). Raises as `owner_of`."""
    pool, worker, owner = await _resolve(response_id, "previous_response_id", store, registry, pools, metrics,
                                         principal)
    return pool, worker, owner.context_tokens or 0


async def _resolve(response_id: str, param: str | None, store: ResponseStore | None, registry: WorkerRegistry,
                   pools: list[PoolConfig], metrics: GatewayMetrics,
                   principal: Principal | None) -> tuple[PoolConfig, Worker, ResponseOwner]:
    """`owner_of`, with the store's record of the response."""
    try:
        owner: ResponseOwner | None = await store.lookup(response_id) if store is not None else None
    except ResponseStoreUnavailable as exc:
        metrics.response_lookup("store_error")
        exc.param = param
        raise
    if owner is None or not may_use(principal, owner):
        metrics.response_lookup("unknown")
        what = "Previous response" if param else "Response"
        raise ResponseNotFound(f"{what} with id '{response_id[:256]}' not found.", param=param)
    pool = next((p for p in pools if p.name == owner.pool), None)
    worker = next((w for w in registry.pools.get(owner.pool, ()) if w.url == owner.worker_url), None)
    if pool is None or worker is None or worker.retired:
        metrics.response_lookup("worker_gone")
        raise ResponseWorkerGone(
            f"Response '{response_id[:256]}' was stored by a worker of pool {owner.pool} that is no longer part of "
            "this gateway; its stored conversation is lost. Send the conversation again as `input` without "
            "`previous_response_id`.", param=param)
    now = registry.clock()
    if not worker.healthy or worker.misconfigured is not None or worker.ejected_until > now or worker.busy_until > now:
        metrics.response_lookup("worker_unavailable")
        wait = max(worker.ejected_until, worker.busy_until) - now
        seconds = max(1, math.ceil(wait if wait > 0 else registry.health.interval))
        raise ResponseWorkerUnavailable(
            f"The worker that stores response '{response_id[:256]}' ({worker.id}) is {worker.state(now)} now; "
            f"try again in {seconds} s.", param=param, headers={"retry-after": str(seconds)})
    metrics.response_lookup("hit")
    return pool, worker, owner


def may_use(principal: Principal | None, owner: ResponseOwner) -> bool:
    """Whether `principal` may use the stored response `owner` describes (module docstring): auth
    off (None), the key that created it, or an admin key."""
    return principal is None or principal.name == owner.principal or principal.has("admin")
