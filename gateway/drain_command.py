"""`kimi-gateway drain`: take one engine instance out of every gateway replica before it restarts.

Made for a Kubernetes `preStop` hook on an engine pod (`exec: [kimi-gateway, drain, ...]`): a pod
knows its own address, not its index in a pool, so `--worker` takes the worker's URL as the
gateway's config or DNS discovery has it (`http://10.1.2.3:8000`) or its index. Steps:

1. `GET {gateway}/admin/workers` finds the worker in `--pool` (by index, else by URL: scheme, host
   and port compared, a trailing `/` ignored; failing that, scheme, port and a resolved address, so
   `http://$(POD_IP):8000` finds a worker the gateway knows by its DNS name);
2. `POST {gateway}/admin/workers/{pool}/{index}/drain`, through the first `--gateway` URL that takes
   it (one that does not answer, e.g. a headless Service's address of a starting or crash-looping
   replica, is skipped): no new requests go to it; with Redis the drain is shared (`"shared": true`),
   every replica and serving process follows within ~1 s (gateway/backends/drains.py); without Redis
   (or with Redis unreachable) only the replica that answered drains, so the drain is then sent to
   every other `--gateway` URL too, again at each poll to one that does not show the worker
   draining (with a shared drain too, once `FLEET_SETTLE_S` passed: an undrain that ran late);
3. polls until the worker has no request in flight anywhere, or `--wait` seconds pass: with a
   shared drain, `GET /admin/workers/{pool}/{index}`'s `fleet_in_flight` (every serving process of
   every replica reports its count on a drained worker through Redis each second; counted once
   `FLEET_SETTLE_S` passed since the drain), so one Service URL is enough; and in any case
   `GET /admin/workers` on every `--gateway` given (each replica's own URL, or with
   `--every-address` each address a name resolves to, e.g. a headless Service), each of which must
   show the worker draining with 0 in flight. Only the URLs that answer count: one that never
   answered, or where nothing listens any more (connection refused: its process, and with it its
   requests, is gone), is skipped; one that answered before and now fails otherwise (a timeout, an
   HTTP error) counts as not idle and is asked again. Each URL's problem is reported once (again
   only when it changes or after it answered), not at every poll.

Without Redis each replica counts only its own in-flight requests and drains alone: give every
replica's URL (`--every-address`); with `processes: N`, `/admin/workers` shows the process that
answered. A replica that cannot reach Redis neither sees the drain nor reports (shared drains'
limit: it keeps sending the worker requests).

`--undrain` puts the worker back (`POST .../undrain` on every `--gateway` URL that answers, so
replicas without Redis follow too) and exits: the drain is kept in Redis by worker id, so an engine
back at the same URL takes no traffic until undrained or until a gateway saw the drained engine go
and a new one answer (gateway/backends/drains.py). Run it when the engine pod starts: the gateway's
health probes hold traffic back until the engine is healthy. The undrain is in force (exit 0) when
some replica shared it through Redis, or, with no Redis configured, when every replica that answered
took it; one kept only where Redis is configured but down (the answer's `"store": "redis_down"`) is
not: Redis still holds the drain and the replicas take it back once Redis answers, so it exits 1 and
is to be run again.

Exit status: 0 once every answering replica reports the worker drained and idle (with `--undrain`:
once the undrain is in force); 1 on an error (no gateway URL taking the drain, a refused key, an
unknown pool or worker) or when `--wait` ran out with requests still in flight or a gateway that
answered before failing the polls (the last counts are printed; such a gateway is asked again at the
next poll). Progress goes to stderr. The key (the `drain` scope suffices, `admin` works too) is read
from the environment variable `--admin-key-env` names (never from the command line, which `ps` shows).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

DEFAULT_ADMIN_KEY_ENV = "KIMI_GATEWAY_ADMIN_KEY"
FLEET_SETTLE_S = 2.5
"""Seconds after a shared drain before the fleet's reports count: two drain syncs (1 s apart,
gateway/backends/drains.py) of every process, so each has seen the drain and reported since."""
UNREACHABLE = -1
"""`DrainResult.in_flight` of a gateway that did not answer its last poll (it counts as not idle)."""


class DrainError(Exception):
    """The drain could not be done; the message says why (printed, exit 1)."""


@dataclass(frozen=True)
class DrainResult:
    """What `drain_worker` did: the worker's id (`pool/index`), whether the drain is shared through
    Redis, and the in-flight count each polled gateway URL reported last (all 0 when `idle`)."""

    worker_id: str
    shared: bool
    in_flight: dict[str, int]
    idle: bool


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, lower case, the scheme's default port filled in."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port


def _addresses(host: str, port: int | None) -> set[str]:
    """The addresses `host` resolves to (itself for an address); empty when it does not resolve."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def find_worker(pools: list[dict[str, Any]], pool: str, worker: str, *, retiring: bool = False,
                resolve: bool = False) -> dict[str, Any]:
    """The snapshot of `worker` (an index, or a URL) in pool `pool` of a `GET /admin/workers` answer's
    `pools`; with `retiring` also among its removed workers still finishing requests. A URL matches
    by scheme, host and port (a trailing `/` ignored); with `resolve`, when none does, by scheme, port
    and a shared resolved address. Raises DrainError naming the pool's workers when there is no such
    pool or worker."""
    view = next((p for p in pools if p["name"] == pool), None)
    if view is None:
        raise DrainError(f"the gateway has no pool {pool!r} (pools: {', '.join(p['name'] for p in pools)})")
    workers: list[dict[str, Any]] = view["workers"] + (view.get("retiring") or [] if retiring else [])
    if worker.isascii() and worker.isdigit():
        found = [w for w in workers if w["index"] == int(worker)]
    else:
        wanted = _origin(worker)
        path = urlsplit(worker.strip()).path.rstrip("/")
        found = [w for w in workers if _origin(w["url"]) == wanted and urlsplit(w["url"]).path.rstrip("/") == path]
        if not found and resolve:  # e.g. the pod's IP for a worker the gateway knows by its DNS name
            mine = _addresses(wanted[1], wanted[2])
            found = [w for w in workers if _origin(w["url"])[0::2] == wanted[0::2]
                     and mine & _addresses(_origin(w["url"])[1], wanted[2])]
    if not found:
        known = ", ".join(f"{w['index']}: {w['url']}" for w in workers) or "none"
        raise DrainError(f"pool {pool} has no worker {worker} (its workers: {known})")
    return found[0]


def every_address(url: str) -> list[str]:
    """`url` once per address its host resolves to (IPv6 in brackets), for a name that stands for
    every replica (a headless Service); an IP address stays as it is. Raises DrainError when the
    name does not resolve."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return [url]
    except ValueError:
        pass
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DrainError(f"{host} does not resolve ({exc})") from None
    addresses = sorted({str(info[4][0]) for info in infos})
    netloc = parts.netloc.rpartition("@")[2]
    return [urlunsplit(parts._replace(netloc=netloc.replace(host, f"[{a}]" if ":" in a else a, 1)))
            for a in addresses]


class Unanswered(DrainError):
    """No HTTP answer came from the address (refused, no route, a timeout, a dropped connection);
    `refused`: nothing listens there (its process is gone, and with it its requests)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class Refused(DrainError):
    """The gateway refused the key (HTTP 401/403): the same at every replica, so it ends the command."""


def _call(client: httpx.Client, method: str, url: str) -> dict[str, Any]:
    try:
        answer = client.request(method, url)
    except httpx.TransportError as exc:
        raise Unanswered(f"{method} {url} failed: {exc.__class__.__name__}: {exc}",
                         refused=isinstance(exc, httpx.ConnectError)) from None
    except httpx.HTTPError as exc:
        raise DrainError(f"{method} {url} failed: {exc.__class__.__name__}: {exc}") from None
    if answer.status_code in (401, 403):
        raise Refused(f"{method} {url}: HTTP {answer.status_code}: the gateway wants a key with the drain (or "
                      "admin) scope in the variable --admin-key-env names")
    if answer.status_code != 200:
        raise DrainError(f"{method} {url}: HTTP {answer.status_code}: {answer.text[:300]}")
    body: dict[str, Any] = answer.json()
    return body


class _Notes:
    """Says each address's problem once, and again only when it changes or after the address
    answered (a dead address polled every `interval_s` is one line, not one a poll)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.last: dict[str, str] = {}

    def failed(self, base: str, exc: DrainError, then: str) -> None:
        key = "unanswered" if isinstance(exc, Unanswered) else str(exc)
        if self.last.get(base) != key:
            self.last[base] = key
            self.say(f"{exc}; {then}")

    def answered(self, base: str) -> None:
        if self.last.pop(base, None) is not None:
            self.say(f"{base} answers again")


def _first_drain(client: httpx.Client, gateways: list[str], pool: str, worker: str,
                 notes: _Notes) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Drain `worker` through the first address of `gateways` that takes it: (that address, the
    worker's snapshot there, the drain's answer). An address that does not answer (or answers
    another error than a refused key or an unknown pool or worker) is noted and skipped; raises
    DrainError when none took the drain."""
    problems: list[str] = []
    for gateway in gateways:
        base = gateway.rstrip("/")
        try:
            pools = _call(client, "GET", base + "/admin/workers")["pools"]
        except Refused:
            raise
        except DrainError as exc:
            notes.failed(base, exc, "trying the next address" if gateway != gateways[-1] else "no address left")
            problems.append(str(exc))
            continue
        target = find_worker(pools, pool, worker, resolve=True)
        try:
            drained = _call(client, "POST", f"{base}/admin/workers/{pool}/{target['index']}/drain")
        except Refused:
            raise
        except DrainError as exc:
            notes.failed(base, exc, "trying the next address" if gateway != gateways[-1] else "no address left")
            problems.append(str(exc))
            continue
        notes.answered(base)
        return base, target, drained
    raise DrainError(problems[0] if len(problems) == 1 else "no gateway took the drain: " + "; ".join(problems))


def drain_worker(gateways: list[str], pool: str, worker: str, *, wait_s: float, interval_s: float = 0.5,
                 admin_key: str | None = None, timeout_s: float = 5.0,
                 log: Callable[[str], None] | None = None) -> DrainResult:
    """Drain `worker` (index or URL) of `pool` through the first URL in `gateways` that takes it and
    wait up to `wait_s` seconds until every URL in `gateways` that answers reports it draining with 0
    in flight, polling every `interval_s` (module doc: which addresses count). `admin_key` is sent as
    `Authorization: Bearer`; each call may take `timeout_s` seconds. `log` (a callable taking one
    line) hears progress. Raises DrainError (module doc)."""
    say: Callable[[str], None] = log or (lambda line: None)
    notes = _Notes(say)
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    with httpx.Client(headers=headers, timeout=timeout_s) as client:
        first, target, drained = _first_drain(client, gateways, pool, worker, notes)
        index, url = target["index"], target["url"]
        shared = bool(drained.get("shared"))
        drained_at = time.monotonic()
        say(f"drained {drained['id']} ({url}) " + ("on every replica (shared through Redis)" if shared else
                                                   "on the replica that answered only: it has no shared Redis"))
        answered_once = {first}
        deadline = time.monotonic() + wait_s
        counts: dict[str, int] = {}
        while True:
            counts = {}
            answering: list[str] = []
            skipped = 0
            for gateway in gateways:
                base = gateway.rstrip("/")
                try:
                    pools = _call(client, "GET", base + "/admin/workers")["pools"]
                except DrainError as exc:
                    # Never answered, or nothing listens there any more: no request of it runs on the worker.
                    if base not in answered_once or (isinstance(exc, Unanswered) and exc.refused):
                        notes.failed(base, exc, "skipped while it does not answer")
                        skipped += 1
                    else:  # it answered before (a network hiccup, a slow replica): not idle yet
                        notes.failed(base, exc, "asking again")
                        counts[base] = UNREACHABLE
                    continue
                notes.answered(base)
                answered_once.add(base)
                answering.append(base)
                try:
                    snapshot = find_worker(pools, pool, url, retiring=True)
                except DrainError:  # removed there (discovery, a reload) with nothing left to finish
                    counts[base] = 0
                    continue
                # not yet draining there (the ~1 s Redis sync): it may still take new requests
                draining = snapshot["draining"] or snapshot["retired"]
                # no shared drain reaches it, or the shared one was lifted since (an undrain that ran late)
                if not draining and (not shared or time.monotonic() - drained_at >= FLEET_SETTLE_S):
                    try:
                        _call(client, "POST", f"{base}/admin/workers/{pool}/{snapshot['index']}/drain")
                    except DrainError as exc:
                        notes.failed(base, exc, "asking again")
                counts[base] = snapshot["in_flight"] if draining else max(snapshot["in_flight"], 1)
            if not answering:
                counts["every address (none answered)"] = UNREACHABLE
            elif shared:
                fleet = _fleet_in_flight(client, answering, pool, index, drained_at)
                counts[f"{answering[0]} (every replica, through Redis)"] = fleet
            if not any(counts.values()):
                say(f"{drained['id']}: 0 requests in flight on {len(answering)} gateway(s)"
                    + (" and every replica reporting through Redis" if shared else "")
                    + (f" ({skipped} address(es) not answering, skipped)" if skipped else ""))
                return DrainResult(drained["id"], shared, counts, idle=True)
            if time.monotonic() >= deadline:
                say(f"{drained['id']}: still in flight after {wait_s:g} s: "
                    + ", ".join(f"{g} {'unreachable' if n == UNREACHABLE else n}" for g, n in counts.items() if n))
                return DrainResult(drained["id"], shared, counts, idle=False)
            time.sleep(min(interval_s, max(deadline - time.monotonic(), 0.0)))


def _fleet_in_flight(client: httpx.Client, gateways: list[str], pool: str, index: int, drained_at: float) -> int:
    """The fleet's in-flight count on the drained worker (`fleet_in_flight` of `GET /admin/workers/
    {pool}/{index}`: every process's report through Redis) from the first of `gateways` that answers,
    UNREACHABLE when none does, and at least 1 until `FLEET_SETTLE_S` passed since the drain (every
    process has seen it and reported since) or while no process reported."""
    for gateway in gateways:
        try:
            fleet = _call(client, "GET", f"{gateway}/admin/workers/{pool}/{index}").get("fleet_in_flight")
            break
        except DrainError:
            continue
    else:
        return UNREACHABLE
    if fleet is None:  # this replica answers without Redis now: the per-gateway counts are all there is
        return 0
    settled = time.monotonic() - drained_at >= FLEET_SETTLE_S and fleet["reporters"] > 0
    return int(fleet["in_flight"]) if settled else max(int(fleet["in_flight"]), 1)


def undrain_worker(gateways: list[str], pool: str, worker: str, *, admin_key: str | None = None,
                   timeout_s: float = 5.0, log: Callable[[str], None] | None = None) -> bool:
    """Put `worker` (index or URL) of `pool` back into service through every URL in `gateways` that
    answers (`POST .../undrain`; an address that does not answer is noted once and skipped). True
    when the undrain is in force: some replica shared it through Redis, or none has Redis configured
    and every replica that answered took it itself. False when none took it, a replica answering
    refused it, or it was kept only where Redis is configured but down (Redis still holds the drain,
    and each replica takes it back from there once Redis answers). `log` hears each outcome."""
    say: Callable[[str], None] = log or (lambda line: None)
    notes = _Notes(say)
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    taken: list[dict[str, Any]] = []
    failed = False
    with httpx.Client(headers=headers, timeout=timeout_s) as client:
        for gateway in gateways:
            base = gateway.rstrip("/")
            try:
                target = find_worker(_call(client, "GET", base + "/admin/workers")["pools"], pool, worker,
                                     resolve=True)
                answer = _call(client, "POST", f"{base}/admin/workers/{pool}/{target['index']}/undrain")
            except Unanswered as exc:
                notes.failed(base, exc, "skipped")
                continue
            except DrainError as exc:
                say(str(exc))
                failed = True
                continue
            taken.append(answer)
            shared = bool(answer.get("shared"))
            say(f"undrained {answer['id']} ({answer['url']}) "
                + ("on every replica (shared through Redis)" if shared else f"on {base} only"
                   + ("; Redis is configured there but did not answer" if answer.get("store") == "redis_down"
                      else "")))
    if any(answer.get("shared") for answer in taken):
        return True
    if not taken:
        say("error: no gateway took the undrain")
        return False
    if any(answer.get("store") == "redis_down" for answer in taken):
        say("error: the undrain is not shared: Redis, which holds the drain, did not answer (the replicas "
            "would take the drain back from it); run it again")
        return False
    if failed:
        say("error: a replica that answered did not take the undrain")
        return False
    return True


def run_drain(gateways: list[str], pool: str, worker: str, *, wait_s: float, interval_s: float,
              admin_key_env: str, resolve_every_address: bool, undrain: bool = False) -> int:
    """The `kimi-gateway drain` command (`undrain`: `--undrain`): the exit status (module doc);
    progress on stderr."""
    def say(line: str) -> None:
        print(f"kimi-gateway drain: {line}", file=sys.stderr, flush=True)

    admin_key = os.environ.get(admin_key_env) or None
    try:
        targets = [u for g in gateways for u in (every_address(g) if resolve_every_address else [g])]
        if undrain:
            return 0 if undrain_worker(targets, pool, worker, admin_key=admin_key, log=say) else 1
        result = drain_worker(targets, pool, worker, wait_s=wait_s, interval_s=interval_s,
                              admin_key=admin_key, log=say)
    except DrainError as exc:
        say(f"error: {exc}")
        return 1
    return 0 if result.idle else 1
