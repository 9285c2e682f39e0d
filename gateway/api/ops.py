"""Operations endpoints: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import os

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.api.schemas import Health, Ready
from gateway.http_answers import JSONResponse
from gateway.state import AppState


def _state(request: Request) -> AppState:
    return request.state.service.state


async def health(request: Request) -> JSONResponse:
    """`GET /health`: the process is alive (200 always); `pid` tells serving processes apart."""
    return JSONResponse({"status": "ok", "pid": os.getpid()})


async def ready(request: Request) -> JSONResponse:
    """`GET /ready`: 200 when this replica can route, else 503; the body names the pools that cannot.

    "Can route" is `readiness.pools` (ReadinessConfig): by default at least one pool has a usable
    worker, so one pool's restart does not take every replica out of the load balancer (its requests
    spill over or get 503 with `Retry-After`); `all` asks for every pool, a list for the named ones.
    `unready_pools` always lists every pool with no usable worker, ready or not.

    Open to all (load balancers probe it); the per-worker snapshots (`pools`) are left out when
    auth is on, since they are what `GET /admin/workers` guards with the admin scope.

    Also 503 with `"draining": true` once shutdown began, so load balancers stop sending here
    while in-flight streams finish (`/health` stays 200: the process is still alive).
    """
    state = _state(request)
    unready = state.registry.unready_pools()
    routable = state.config.readiness.is_ready([pool.name for pool in state.config.pools], unready)
    ok = routable and not state.draining
    body: dict[str, object] = {"ready": ok, "draining": state.draining, "unready_pools": unready}
    if state.auth is None:  # with auth on, worker details are for admin keys (`GET /admin/workers`)
        body["pools"] = {name: [w.snapshot() for w in workers] for name, workers in state.registry.pools.items()}
    return JSONResponse(body, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    """`GET /metrics`: Prometheus text exposition of this process's collectors."""
    payload, content_type = _state(request).metrics.render()
    return Response(payload, media_type=content_type)


def router() -> APIRouter:
    """The ops routes (open to all: probes and scrapers carry no key), for `create_app`."""
    ops = APIRouter(tags=["operations"])
    ops.add_api_route("/health", health, methods=["GET"], response_model=Health, summary="Liveness")
    ops.add_api_route("/ready", ready, methods=["GET"], response_model=Ready, summary="Readiness",
                      responses={503: {"model": Ready, "description": "The pools `readiness.pools` asks for "
                                                                       "have no usable worker (by default: no pool "
                                                                       "has one), or shutdown began (`draining`)."}})
    ops.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse,
                      summary="Prometheus metrics", responses={200: {
                          "description": "Prometheus text exposition format 0.0.4.",
                          "content": {"text/plain": {"schema": {"type": "string"}}}}})
    return ops
