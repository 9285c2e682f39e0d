"""The worker registry: every pool's workers and their health, built once from config.

Two kinds of health, kept apart:
- active: probes of the engine's health path (HealthChecker) and refused connections set
  `healthy`; a passing probe restores it;
- passive (outlier ejection, as Envoy does it): `passive_failures` consecutive failed requests
  (5xx, timeouts, broken answers) eject a worker for `ejection_base` * 2^(ejections so far)
  seconds, capped at `ejection_max`. When the time is up the worker is a candidate again
  (half-open): one success closes the circuit and resets the back-off, one more failure ejects
  it again for twice as long. A passing probe does not end an ejection: an engine can answer
  `/health` and still fail every request.
A 429 keeps a worker out of new requests for its `Retry-After` (default 1 s) without counting as
a failure. A worker an operator drained (admin API) gets no new requests until undrained; its
in-flight requests finish as usual.

The worker set changes at run time (DNS discovery, a config reload: `configure`, `set_discovered`).
Each change swaps in new lists (never edited in place), so the request path reads a consistent set
without locks. A new worker is unhealthy until its first probe passes (a static worker known at
start-up begins healthy, as before). A removed worker is retired: no new requests; its in-flight
requests finish; once it has none `sweep` stops its probe and scrape loops (`WorkerWatcher`) and
removes its metric series. A removed URL that comes back while still retiring is the same worker
again. Indices are never reused within a pool, so a worker id names one engine for its lifetime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Protocol

from gateway.backends.capacity import PoolGate
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig
from gateway.observability.metrics import GatewayMetrics

log = logging.getLogger("gateway.health")

DEFAULT_RETRY_AFTER_S = 1.0
UNKNOWN_LOAD = float("-inf")
"""The load time (time.monotonic() s) of an on-demand adapter a worker lists that this process did
not load itself (`WorkerRegistry.set_adapters`): long ago, as far as this process knows."""


class WorkerWatcher(Protocol):
    """Told when a worker joins (`worker_added`) and when a retired one is gone (`worker_gone`):
    the health prober and the load scraper start and stop its loop."""

    def worker_added(self, worker: Worker) -> None: ...

    def worker_gone(self, worker: Worker) -> None: ...


class WorkerRegistry:
    """Pools → workers, their health and ejection state. Touched only on the event loop."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.health = config.health
        self.metrics = metrics
        self.clock = clock
        self.pools: dict[str, list[Worker]] = {}
        self.gates: dict[str, PoolGate] = {}
        """Every pool's gate; a removed pool's stays (requests still hold it; a few bytes a name)."""
        self.retiring: list[Worker] = []
        """Removed workers whose in-flight requests have not finished yet."""
        self.discovered: dict[str, list[str]] = {}
        """Pool → worker URLs its `discover` name resolved to last."""
        self.watchers: list[WorkerWatcher] = []
        # Per worker: how to move each in-flight attempt still waiting for response headers.
        self._header_waits: dict[Worker, set[Callable[[], None]]] = {}
        self._next_index: dict[str, int] = {}
        self._configs: dict[str, PoolConfig] = {}
        self._adapter_names: frozenset[str] | None = None  # `adapter_names`, until a worker or pool changes
        self.configure(config.pools, initial=True)

    def __iter__(self) -> Iterator[Worker]:
        for workers in self.pools.values():
            yield from workers

    def find(self, pool: str, index: int) -> Worker | None:
        """The worker `pool/index`, or None when there is no such pool or index."""
        return next((w for w in self.pools.get(pool, ()) if w.index == index), None)

    def candidates(self, pool: str, exclude: Collection[Worker] = (), role: str | None = None,
                   adapter: str | None = None) -> list[Worker]:
        """Workers of `pool` that may take a request now: healthy, not drained, not ejected, not
        told to back off by a 429, and not in `exclude` (already tried by this request). Empty
        for a pool a reload removed. `role` None: the workers whose answer a client gets (all of
        an aggregated pool's, a PD pool's decode workers); "prefill": a PD pool's prefill workers.
        `adapter`: only those serving that LoRA adapter (`Worker.serves_adapter`)."""
        now = self.clock()
        prefill = role == "prefill"
        workers = [w for w in self.pools.get(pool, ()) if (w.role == "prefill") is prefill and w.in_service(now)
                   and w.busy_until <= now and w not in exclude]
        if adapter is None:
            return workers
        config = self._configs.get(pool)
        declared = config.lora_adapters if config is not None else ()
        return [w for w in workers if w.serves_adapter(adapter, declared)]

    # --- LoRA adapters -------------------------------------------------------------------------

    def set_adapters(self, worker: Worker, adapters: frozenset[str], roots: Mapping[str, str | None] | None = None,
                     read_at: float | None = None) -> None:
        """The LoRA adapters `worker`'s `/v1/models` lists now (the prober's check, or the loader's
        look before a load); logged when they change. `roots`: each listed adapter's `root` (the path
        the engine loaded it from); `read_at`: when the list was asked for (time.monotonic() s): what
        this gateway loaded or unloaded there since is newer than the list and kept.

        Which loaded adapters are the gateway's to unload (`Worker.on_demand`) is the configuration's
        word, not one process's memory: every listed adapter that the worker's pool loads on demand,
        listed from the pool's path for it (or with no `root`), whichever replica or process loaded it,
        before or after a restart (its load time unknown here: `UNKNOWN_LOAD`), as a list read with
        `roots` shows them. One no longer listed
        (an engine restart, an operator's unload) or listed from another path (an operator's own load
        under that name) is not."""
        if read_at is not None:
            adapters = (adapters | {a for a, (_, at) in worker.on_demand.items() if at >= read_at}) - \
                {a for a, at in worker.unloaded.items() if at >= read_at}
            worker.unloaded = {a: at for a, at in worker.unloaded.items() if at >= read_at}
        for name, (path, _) in list(worker.on_demand.items()):
            root = (roots or {}).get(name)
            if name not in adapters or (root is not None and root != path):
                del worker.on_demand[name]
                log.info("worker %s: LoRA adapter %s is no longer an on-demand one of its pool (%s)", worker.id,
                         name, "not listed" if name not in adapters else f"listed from {root}")
        config = self._configs.get(worker.pool)
        if roots is not None and config is not None and config.lora_on_demand:  # a list read: its roots known
            for name in adapters:
                configured = config.adapter_path(name)
                root = roots.get(name)
                if configured is not None and name not in worker.on_demand and root in (None, configured):
                    worker.on_demand[name] = (configured, UNKNOWN_LOAD)
        if worker.adapters != adapters:
            log.info("worker %s serves LoRA adapters: %s", worker.id, ", ".join(sorted(adapters)) or "none")
            worker.adapters = adapters
            self._adapter_names = None

    def adapter_loaded(self, worker: Worker, adapter: str, path: str | None = None) -> None:
        """`worker` loaded LoRA `adapter` on the gateway's request (`LoraLoader`): it serves it, and
        its pool's declared ones until its `/v1/models` is read again. `path`: one of the pool's
        on-demand adapters, from there (the gateway's to unload, `Worker.on_demand`, loaded now);
        None: not the gateway's (served only)."""
        config = self._configs.get(worker.pool)
        known = worker.adapters if worker.adapters is not None else \
            frozenset(config.lora_adapters if config is not None else ())
        worker.unloaded.pop(adapter, None)
        if path is not None:
            now = time.monotonic()
            worker.on_demand[adapter] = (path, now)
            worker.adapter_used_at[adapter] = now
        self.set_adapters(worker, known | {adapter})

    def adapter_unloaded(self, worker: Worker, adapter: str) -> None:
        """The gateway unloaded (or is unloading: no new requests go there) LoRA `adapter` on `worker`."""
        worker.on_demand.pop(adapter, None)
        worker.adapter_used_at.pop(adapter, None)
        worker.unloaded[adapter] = time.monotonic()
        if worker.adapters is not None and adapter in worker.adapters:
            log.info("worker %s serves LoRA adapters: %s", worker.id,
                     ", ".join(sorted(worker.adapters - {adapter})) or "none")
            worker.adapters = worker.adapters - {adapter}
            self._adapter_names = None

    def adapter_names(self) -> frozenset[str]:
        """Every LoRA adapter a pool declares (`lora_adapters`) or a current worker listed last."""
        names = self._adapter_names
        if names is None:
            found = {a for config in self._configs.values() for a in config.lora_adapters}
            found |= {m.name for config in self._configs.values() for m in config.lora_on_demand}
            for worker in self:
                if worker.adapters:
                    found |= worker.adapters
            names = self._adapter_names = frozenset(found)
        return names

    def serves_adapter(self, pool: str, adapter: str) -> bool:
        """Whether `pool` declares LoRA `adapter` (or loads it on demand), or one of its workers listed
        it last and no pool configures it. Ownership is the configuration's: an adapter some pool
        declares is served by those pools only, so a worker elsewhere listing the same name (another
        tenant's engine, a copy under that name) never takes its requests."""
        config = self._configs.get(pool)
        if config is not None and _configures(config, adapter):
            return True
        if any(_configures(other, adapter) for other in self._configs.values()):
            return False
        return any(w.adapters is not None and adapter in w.adapters for w in self.pools.get(pool, ()))

    # --- membership: discovery and reload ------------------------------------------------------

    def configure(self, pools: Sequence[PoolConfig], initial: bool = False) -> list[str]:
        """Make the pools and their workers match `pools` (a reload); returns one line per change.

        A pool's workers are its `workers` plus, with `discover`, what its name resolved to last.
        Workers are matched by URL (and engine kind); the rest are retired. `initial`: the start-up
        set, whose workers begin healthy.
        """
        changes: list[str] = []
        for gone in [name for name in self.pools if name not in {p.name for p in pools}]:
            changes.append(f"pool {gone} removed")
            self._configs.pop(gone, None)
            self.discovered.pop(gone, None)
            changes += self._set_urls(gone, None, [], initial)
        for pool in pools:
            if pool.name not in self.gates:
                self.gates[pool.name] = PoolGate(pool)
                changes.append(f"pool {pool.name} added")
            elif self._configs.get(pool.name) != pool:
                self.gates[pool.name].configure(pool)
                changes.append(f"pool {pool.name} changed")
            self._configs[pool.name] = pool
            if pool.discover is None:
                self.discovered.pop(pool.name, None)
            urls = list(dict.fromkeys([*pool.workers, *self.discovered.get(pool.name, [])]))
            changes += self._set_urls(pool.name, pool, urls, initial, _roles(pool))
        self.pools = {p.name: self.pools.get(p.name, []) for p in pools}  # config (cost) order
        self._adapter_names = None
        return changes

    def set_discovered(self, pool: str, urls: Sequence[str]) -> list[str]:
        """The worker URLs `pool`'s DNS name resolves to now (beside its static `workers`)."""
        config = self._configs.get(pool)
        if config is None:
            return []
        self.discovered[pool] = list(urls)
        return self._set_urls(pool, config, list(dict.fromkeys([*config.workers, *urls])), False)

    def _set_urls(self, name: str, pool: PoolConfig | None, urls: list[str], initial: bool,
                  roles: dict[str, tuple[str, int | None]] | None = None) -> list[str]:
        """`roles`: URL -> (role, bootstrap port) of a PD pool's workers (they are its URLs)."""
        self._adapter_names = None  # workers come and go: their adapters with them
        engine = ENGINES[pool.engine] if pool is not None else None
        roles = roles or {}
        if roles:
            urls = list(roles)
        current = self.pools.get(name, [])

        def same(w: Worker) -> bool:  # the same engine kind in the same role: the same worker
            return w.engine is engine and (w.role, w.bootstrap_port) == roles.get(w.url, (None, None))

        keep = {w.url: w for w in current if same(w)}
        back = {w.url: w for w in self.retiring if w.pool == name and same(w)}
        workers: list[Worker] = []
        changes: list[str] = []
        for url in urls:
            worker = keep.get(url)
            if worker is None and (worker := back.get(url)) is not None:
                self.retiring.remove(worker)
                worker.retired = False
                changes.append(f"worker {worker.id} ({url}) back before it was gone")
            elif worker is None:
                assert engine is not None
                index = self._next_index.get(name, 0)
                self._next_index[name] = index + 1
                role, bootstrap_port = roles.get(url, (None, None))
                worker = Worker(name, index, url, engine, role, bootstrap_port, healthy=initial)
                if not initial:
                    worker.last_error = "not probed yet"
                if self.metrics is not None:  # the series exist from the start (alerts see a 0, not nothing)
                    self.metrics.worker_added(name, worker.id, role, initial)
                for watcher in self.watchers:
                    watcher.worker_added(worker)
                changes.append(f"worker {worker.id} ({url}{f', {role}' if role else ''}) added")
            workers.append(worker)
        for worker in current:
            if worker not in workers:
                worker.retired = True
                self.retiring.append(worker)
                changes.append(f"worker {worker.id} ({worker.url}) removed; {worker.in_flight} in flight finish")
        if workers != current:
            self.pools = {**self.pools, name: workers}
        if not initial:
            for line in changes:
                log.info("%s", line)
        return changes

    def sweep(self) -> list[Worker]:
        """Forget the retired workers with nothing in flight: their loops stop, their metric series
        go. Returns them."""
        done = [w for w in self.retiring if w.in_flight <= 0]
        if done:
            self.retiring = [w for w in self.retiring if w not in done]
        for worker in done:
            for watcher in self.watchers:
                watcher.worker_gone(worker)
            if self.metrics is not None:
                self.metrics.forget_worker(worker.id)
            log.info("worker %s (%s) is gone", worker.id, worker.url)
        return done

    # --- active health -------------------------------------------------------------------------

    def probe_failed(self, worker: Worker, reason: str) -> None:
        """A failed probe; `health.unhealthy_after` in a row make the worker unhealthy."""
        worker.failed_probes += 1
        worker.last_error = reason
        if worker.failed_probes >= self.health.unhealthy_after:
            self._set_healthy(worker, False, reason)

    def probe_passed(self, worker: Worker) -> None:
        worker.failed_probes = 0
        self._set_healthy(worker, True, None)

    def connect_failed(self, worker: Worker, reason: str) -> None:
        """The engine refused or dropped the connection: unhealthy until a probe passes."""
        worker.last_error = reason
        self._set_healthy(worker, False, reason)

    def peers_answered(self, worker: Worker, since: float, budget: float, stream: bool) -> bool:
        """Whether another worker of `worker`'s pool (and role) answered a request sent at or after
        `since` (perf_counter seconds) with an answer budget of at least `budget` seconds (for a
        non-streamed request, `stream` False: a whole answer; `AnswerMarks.answered_since`)."""
        return any(peer is not worker and peer.role == worker.role
                   and peer.answers.answered_since(since, budget, stream) for peer in self.pools.get(worker.pool, ()))

    def awaiting_headers(self, worker: Worker, move: Callable[[], None]) -> None:
        """An attempt on `worker` waits for its response headers; `move()` is called (once) if the
        worker turns unhealthy meanwhile: an engine that has not answered is not generating, so
        the attempt should go to another worker rather than wait out its timeout."""
        self._header_waits.setdefault(worker, set()).add(move)

    def headers_done(self, worker: Worker, move: Callable[[], None]) -> None:
        """The attempt registered with `move` got its headers, or ended: no more moving."""
        waits = self._header_waits.get(worker)
        if waits is not None:
            waits.discard(move)

    def _set_healthy(self, worker: Worker, healthy: bool, reason: str | None) -> None:
        if worker.healthy != healthy:
            log.warning("worker %s is now %s%s", worker.label, "healthy" if healthy else "unhealthy",
                        f" ({reason})" if reason else "")
            if not healthy:
                for move in self._header_waits.pop(worker, ()):
                    move()
        worker.healthy = healthy
        if healthy:
            worker.last_error = None
        if self.metrics is not None:
            self.metrics.worker_health(worker.pool, worker.id, healthy)

    def set_misconfigured(self, worker: Worker, reason: str | None) -> None:
        """The verdict of a `/v1/models` check: `reason` (in words) keeps the worker out of every
        request and of `/ready`'s count; None puts it back. Logged when it changes."""
        if worker.misconfigured != reason:
            if reason is None:
                log.warning("worker %s serves the pool's model and max context again", worker.id)
            else:
                log.warning("worker %s is misconfigured, no traffic: %s", worker.id, reason)
        worker.misconfigured = reason
        if self.metrics is not None:
            self.metrics.worker_misconfig(worker.pool, worker.id, reason is not None)

    # --- operator drain ------------------------------------------------------------------------

    def set_draining(self, worker: Worker, draining: bool) -> None:
        """Drain (True) or undrain (False) a worker; idempotent. A drained worker is left out of
        `candidates` and of `/ready`'s count, so a pool whose workers are all drained is not ready."""
        if worker.draining != draining:
            log.info("worker %s %s by an operator", worker.id, "drained" if draining else "undrained")
        worker.draining = draining
        if self.metrics is not None:
            self.metrics.worker_drain(worker.pool, worker.id, draining)

    # --- passive health: outlier ejection -------------------------------------------------------

    def request_failed(self, worker: Worker, reason: str) -> None:
        """A request failed on the worker's side (5xx, timeout, broken answer)."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        # Half-open after an ejection: a single failure is enough to eject again.
        threshold = 1 if worker.ejections else self.health.passive_failures
        if worker.consecutive_failures < threshold:
            return
        seconds = min(self.health.ejection_base * 2 ** worker.ejections, self.health.ejection_max)
        worker.ejected_until = self.clock() + seconds
        worker.ejections += 1
        worker.consecutive_failures = 0
        log.warning("worker %s ejected for %.1fs after %d consecutive failures (%s)", worker.label, seconds,
                    self.health.passive_failures, reason)
        if self.metrics is not None:
            self.metrics.worker_ejection(worker.pool, worker.id, True)

    def request_succeeded(self, worker: Worker) -> None:
        """A request succeeded: the failure streak and the ejection back-off start over."""
        worker.consecutive_failures = 0
        if worker.ejections:
            worker.ejections = 0
            if self.metrics is not None:
                self.metrics.worker_ejection(worker.pool, worker.id, False)

    def expire_ejections(self) -> None:
        """Set `kimi_gateway_worker_ejected` to 0 for workers whose ejection time is over (called by
        the prober: an ejection ends by the clock, not by an event)."""
        if self.metrics is None:
            return
        now = self.clock()
        for worker in self:
            if worker.ejections and worker.ejected_until <= now:
                self.metrics.worker_ejection(worker.pool, worker.id, False)

    def engine_id_learned(self, worker: Worker, engine_id: str) -> None:
        """`worker` (a vLLM Mooncake prefill worker) reported `engine_id` at its bootstrap server's
        `GET /query`: kept (`Worker.pd_engine_id`) for the decode legs that name it."""
        worker.pd_engine_id = engine_id

    def engine_id_stale(self, worker: Worker) -> None:
        """An attempt through `worker` failed: forget its engine id, read again next time (a
        restarted engine has a new one)."""
        worker.pd_engine_id = None

    def throttled(self, worker: Worker, retry_after: float | None) -> None:
        """A 429: no new requests to this worker for `retry_after` seconds (1 s when not given)."""
        worker.busy_until = self.clock() + (DEFAULT_RETRY_AFTER_S if retry_after is None else retry_after)

    def unready_pools(self) -> list[str]:
        """Pools with no healthy, correctly configured, undrained, non-ejected worker (for a PD
        pool: of either role)."""
        now = self.clock()
        return [name for name, workers in self.pools.items()
                if not all(any(w.in_service(now) for w in workers if w.role == role) for role in _pool_roles(workers))]


def _roles(pool: PoolConfig) -> dict[str, tuple[str, int | None]] | None:
    """URL -> (role, bootstrap port) of a PD pool's workers; None for an aggregated pool."""
    if pool.disaggregation is None:
        return None
    return {url: (role, port) for url, role, port in pool.pd_workers() if role is not None}


def _pool_roles(workers: Sequence[Worker]) -> set[str | None]:
    """The roles a pool's workers have ({None} for an aggregated pool, and for an empty one)."""
    return {w.role for w in workers} or {None}


def _configures(pool: PoolConfig, adapter: str) -> bool:
    """Whether `pool` declares LoRA `adapter` (`lora_adapters`) or loads it on demand (`lora_on_demand`)."""
    return adapter in pool.lora_adapters or pool.adapter_path(adapter) is not None
