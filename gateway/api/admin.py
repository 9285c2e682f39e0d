"""Admin API and the live status page.

Routes (each JSON one depends on `scope_check("admin")`, or `scope_check("drain")` for the four
worker routes `kimi-gateway drain` calls, which a key with either scope may call: 401/403 with auth
on, open with it off; errors are raised as GatewayError and answered by the app's handler):

- `GET /admin/workers`: every pool and its workers' state (`Worker.snapshot()`).
- `GET /admin/workers/{pool}/{index}`: one worker.
- `POST /admin/workers/{pool}/{index}/drain` / `.../undrain`: take a worker out of new requests
  (its in-flight streams finish) / put it back; idempotent; answer the worker's new state.
  Worker ids are `pool/index` as in headers and metric labels, addressed as a resource the way
  SGLang's gateway (`/workers/{id}`) and Dynamo's drain/resume API do.
- `POST /admin/reload`: read the config file again and apply its pools and discovery
  (gateway/serving/reload.py, as SIGHUP does); answers what changed, or 400 `invalid_config` with the
  reason while the running config stays (409 `no_config_file` for a gateway built without a file).
- `GET /admin/status`: pools and workers plus recent traffic (`StatusWindow`), for the page.
- `GET /dashboard`: the status page (`static/dashboard.html`). The HTML holds no data and is
  public; everything it shows comes from `/admin/status`, which needs the admin key. A browser
  cannot add a Bearer header to a page load, so the page asks for the key, keeps it in
  `sessionStorage` (this tab only, gone when it closes, never in a URL or cookie) and sends it as
  `Authorization: Bearer` with each fetch. A strict Content-Security-Policy (only this page's own
  inline script and style, by hash; fetches to this origin only) keeps injected script from
  reading the key; the page also writes worker data as text, never as HTML.

Drain state lives in this gateway process (like health and ejections) and, with Redis, is shared by
every process and replica (gateway/backends/drains.py); without Redis, drain the worker on each.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from importlib import resources
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from gateway.api.schemas import DrainedWorker, ReloadResult, Status, WorkerDetail, WorkerList, error_responses
from gateway.auth.middleware import scope_check
from gateway.backends.worker import Worker
from gateway.errors import Conflict, InvalidRequest, NotFound, PermissionDenied
from gateway.http_answers import JSONResponse
from gateway.state import AppState


def _state(request: Request) -> AppState:
    return request.state.service.state


def pools_view(state: AppState) -> list[dict[str, object]]:
    """Every configured pool, in config (cost) order, with its workers' snapshots.

    Shape: `[{"name", "engine", "max_context_tokens", "policy", "disaggregation", "ready", "workers":
    [snapshot], "retiring": [snapshot], "discovery": DnsDiscovery.status or None}]`; a PD pool's
    `policy` is its prefill policy and `disaggregation` is `{"mode", "prefill_policy", "decode_policy"}`
    (None for an aggregated pool), its workers' snapshots carry their `role`; `ready` is false when no
    worker (of either role) is healthy, undrained and not ejected; `retiring` lists removed workers (discovery, a
    reload) whose requests are still finishing.
    """
    registry = state.registry
    unready = set(registry.unready_pools())
    return [{"name": pool.name, "engine": pool.engine, "max_context_tokens": pool.max_context_tokens,
             "policy": pool.policy if pool.disaggregation is None else pool.disaggregation.prefill_policy,
             "disaggregation": None if pool.disaggregation is None else {
                 "mode": pool.disaggregation.mode, "prefill_policy": pool.disaggregation.prefill_policy,
                 "decode_policy": pool.disaggregation.decode_policy},
             "ready": pool.name not in unready,
             "workers": [w.snapshot() for w in registry.pools.get(pool.name, ())],
             "retiring": [w.snapshot() for w in registry.retiring if w.pool == pool.name],
             "discovery": state.discovery.status.get(pool.name) if pool.discover is not None else None}
            for pool in state.config.pools]


def _worker(request: Request, pool: str, index: str) -> Worker:
    """The worker named by the path's `pool` and `index`; NotFound (404) when there is none."""
    worker = _state(request).registry.find(pool, int(index)) if index.isascii() and index.isdigit() else None
    if worker is None:
        known = ", ".join(w.id for w in _state(request).registry)
        raise NotFound(f"No worker {pool}/{index}; workers are {known}.", code="worker_not_found")
    return worker


async def list_workers(request: Request) -> JSONResponse:
    """`GET /admin/workers`: `{"pools": pools_view(state)}`."""
    return JSONResponse({"pools": pools_view(_state(request))})


async def get_worker(request: Request, pool: str, index: str) -> JSONResponse:
    """`GET /admin/workers/{pool}/{index}`: the worker's snapshot and `fleet_in_flight` (`{"in_flight",
    "reporters"}` over every replica's processes, from Redis; null without it): what
    `kimi-gateway drain` waits on; 404 `worker_not_found`."""
    worker = _worker(request, pool, index)
    fleet = await _state(request).drains.fleet_in_flight(worker)
    return JSONResponse({**worker.snapshot(), "fleet_in_flight": None if fleet is None else
                         {"in_flight": fleet.in_flight, "reporters": fleet.reporters}})


def _host_port(origin: str) -> str:
    """`scheme://host[:port]` → `host:port` (lower case, IPv6 in brackets, the scheme's default port
    filled in); "" for anything else (`null`, a path, a bad port), which matches nothing."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return ""
    host = parts.hostname
    if not host or port is None or parts.path not in ("", "/"):
        return ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _own_origins(request: Request) -> set[str]:
    """`host:port` of the pages allowed to change admin state: the listening address (and localhost
    when it is loopback), the configured `host` and `admin_origins`. Not the request's `Host`: a
    DNS-rebinding page gets its own name there."""
    config = _state(request).config
    allowed = {_host_port(origin) for origin in config.admin_origins}
    server = request.scope.get("server")
    if server:
        port = server[1]
        names = {str(server[0]).lower()}
        if config.host not in ("0.0.0.0", "::", ""):
            names.add(config.host.lower().strip("[]"))
        if names & {"127.0.0.1", "::1", "localhost"}:
            names |= {"localhost", "127.0.0.1", "::1"}
        allowed |= {f"[{name}]:{port}" if ":" in name else f"{name}:{port}" for name in names}
    return allowed


def _cross_origin(request: Request) -> bool:
    """True for a request a browser sent from another site's page. State changes refuse it: with
    auth off a `POST` is a CORS "simple request", sent cross-origin without a preflight, so any
    page an operator opens could otherwise drain workers (curl and scripts send no `Origin`)."""
    origin = request.headers.get("origin")
    if origin is None:
        return False
    return _host_port(origin) not in _own_origins(request)


def _refuse_cross_origin(request: Request) -> None:
    """PermissionDenied (403 `cross_origin_refused`) for a state change sent from another site's page."""
    if _cross_origin(request):
        raise PermissionDenied("Admin changes are refused from another site's page (its Origin is not this "
                               "gateway's address nor in admin_origins).", code="cross_origin_refused")


async def _set_draining(request: Request, pool: str, index: str, draining: bool) -> JSONResponse:
    _refuse_cross_origin(request)
    worker = _worker(request, pool, index)
    store = await _state(request).drains.set_draining(worker, draining)
    return JSONResponse({**worker.snapshot(), "shared": store == "redis", "store": store})


async def drain(request: Request, pool: str, index: str) -> JSONResponse:
    """`POST /admin/workers/{pool}/{index}/drain`: no new requests go to the worker; those in
    flight finish. Answers its snapshot (`"draining": true`), `"shared"`: true when every serving
    process and replica follows (Redis, gateway/backends/drains.py), false when only this process
    does, and `"store"` (`DrainStore`): "redis", "redis_down" (configured, the write failed: undone
    by the next sync once Redis answers) or "local" (no Redis); 404 `worker_not_found`."""
    return await _set_draining(request, pool, index, True)


async def undrain(request: Request, pool: str, index: str) -> JSONResponse:
    """`POST /admin/workers/{pool}/{index}/undrain`: the worker takes new requests again; answers as
    `drain` does."""
    return await _set_draining(request, pool, index, False)


async def reload(request: Request) -> JSONResponse:
    """`POST /admin/reload`: re-read the config file and apply it (gateway/serving/reload.py). Answers
    `{"reloaded": true, "changes": [line], "restart_required": [section]}`; 400 `invalid_config`
    with the reason when the file is unreadable or invalid (the running config stays); 409
    `no_config_file` when the gateway was built from a config object, not a file."""
    from gateway.serving.reload import ReloadRefused, reload_config  # late: reload imports the state

    _refuse_cross_origin(request)
    if _state(request).config_path is None:
        raise Conflict("There is no config file to reload: this gateway was not started from one.",
                       code="no_config_file")
    try:
        result = await reload_config(_state(request))
    except ReloadRefused as exc:
        raise InvalidRequest(f"The new config was refused; the running one stays: {exc}",
                             code="invalid_config") from None
    return JSONResponse(result.as_dict())


async def status(request: Request) -> JSONResponse:
    """`GET /admin/status`: what the status page shows, in one JSON object.

    `{"time_unix", "started_unix", "shutting_down", "ready", "pools": pools_view,
    "recent": StatusWindow.recent}` (see `gateway.observability.status` for the recent figures).
    """
    state = _state(request)
    pools = pools_view(state)
    return JSONResponse({"time_unix": round(time.time(), 3), "started_unix": state.started_unix,
                         "shutting_down": state.draining,
                         "ready": state.config.readiness.is_ready([p["name"] for p in pools],
                                                                  [p["name"] for p in pools if not p["ready"]])
                         and not state.draining, "pools": pools,
                         "recent": state.status.recent(p.name for p in state.config.pools)})


def _csp_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


class DashboardPage:
    """`GET /dashboard`: the status page (public HTML; its data needs the admin key, see above).

    Read once from the package (`gateway/api/static/dashboard.html`) with a Content-Security-Policy
    that allows exactly its inline script and style (CSP Level 2 hash sources).
    """

    def __init__(self) -> None:
        html = resources.files("gateway.api").joinpath("static/dashboard.html").read_text(encoding="utf-8")
        scripts = " ".join(_csp_hash(s) for s in re.findall(r"<script>(.*?)</script>", html, re.S))
        styles = " ".join(_csp_hash(s) for s in re.findall(r"<style>(.*?)</style>", html, re.S))
        self.body = html.encode()
        self.headers = {
            "content-security-policy": f"default-src 'none'; script-src {scripts}; style-src {styles}; "
                                       "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                                       "frame-ancestors 'none'",
            "cache-control": "no-store", "referrer-policy": "no-referrer",
            "x-frame-options": "DENY"}

    async def serve(self, request: Request) -> Response:
        return Response(self.body, media_type="text/html; charset=utf-8", headers=self.headers)


def routers() -> list[APIRouter]:
    """The admin routes (admin scope; the worker routes drain scope) and the status page's
    (public), for `create_app`."""
    admin = APIRouter(tags=["admin"], dependencies=[Depends(scope_check("admin"))],
                      responses=error_responses(401, 403))
    drains = APIRouter(tags=["admin"], dependencies=[Depends(scope_check("drain"))],
                       responses=error_responses(401, 403))
    worker = error_responses(404)
    change = error_responses(403, 404)
    drains.add_api_route("/admin/workers", list_workers, methods=["GET"], response_model=WorkerList,
                         summary="Every pool and its workers")
    drains.add_api_route("/admin/workers/{pool}/{index}", get_worker, methods=["GET"], response_model=WorkerDetail,
                         summary="One worker", responses=worker)
    drains.add_api_route("/admin/workers/{pool}/{index}/drain", drain, methods=["POST"],
                         response_model=DrainedWorker, summary="Stop sending new requests to a worker",
                         responses=change)
    drains.add_api_route("/admin/workers/{pool}/{index}/undrain", undrain, methods=["POST"],
                         response_model=DrainedWorker, summary="Send new requests to a worker again",
                         responses=change)
    admin.add_api_route("/admin/reload", reload, methods=["POST"], response_model=ReloadResult,
                        summary="Re-read the config file", responses=error_responses(400, 403, 409))
    admin.add_api_route("/admin/status", status, methods=["GET"], response_model=Status,
                        summary="What the status page shows")
    page = APIRouter(tags=["admin"])
    page.add_api_route("/dashboard", DashboardPage().serve, methods=["GET"], response_class=HTMLResponse,
                       summary="The status page (public HTML; its data needs the admin key)")
    return [drains, admin, page]
