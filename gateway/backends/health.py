"""Active health probes: every worker's engine probe endpoint (`engine_kinds.PROBES`: one that
answers at once without generating, e.g. SGLang's `/ready`, not its generating `/health`), on an
interval, in the background."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from gateway.backends.control import ControlError, control_get, pool_headers
from gateway.backends.drains import DrainBoard
from gateway.backends.h1 import H1Pool
from gateway.backends.load import parse_start_time
from gateway.backends.models_check import (
    CHECKED_ENGINES,
    MODELS_PATH,
    UnreadableModels,
    listed_adapter_roots,
    models_verdict,
)
from gateway.backends.params import HealthConfig
from gateway.backends.periodic import FollowsWorkers, PeriodicEach
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.observability.metrics import GatewayMetrics

log = logging.getLogger("gateway.health")


class HealthChecker(FollowsWorkers[Worker]):
    """Probes each worker every `interval` s, each on its own loop (a slow worker delays no other),
    on its engine kind's probe endpoint (`EngineSpec.probe`).

    A probe fails on a non-200, on no complete answer within `timeout` s plus the endpoint's own
    answer time (`HealthProbe.timeout`; connect, headers and
    body together), on a body over `max_body_bytes`, or on a transport error; the failure's real
    cause (e.g. a host name that does not resolve, a refused connection, a refused key) becomes
    the worker's `last_error`. Probes carry the pool's `api_key`. A worker that passes a probe is
    healthy again, so a restarted engine rejoins by itself.

    With `verify_models`, a passing probe is followed by a read of the worker's `/v1/models` (same
    deadline, cap and key; gateway/backends/models_check.py judges it) when the worker was never
    checked, has just recovered, is misconfigured, or was last checked `models_refresh` s ago. A
    `/v1/models` that answers nothing usable leaves the verdict as it was and is read again at the
    next probe; one refusing the pool's key (401/403) is a misconfiguration. The LoRA adapters the
    list names become the worker's `adapters` (requests naming one may go there).

    With `drains`, each probe that passes, or fails because nothing serves at the worker's address
    (`ControlError.gone`), is told to the DrainBoard, which lifts a drain once a new engine
    answers where the drained one was (gateway/backends/drains.py). A passing probe of a drained
    worker is followed by a read of its `/metrics` for the engine process' start time (same
    deadline and cap); when that read gets no answer, the probe is not told to the DrainBoard.
    """

    def __init__(self, registry: WorkerRegistry, client: H1Pool, config: HealthConfig,
                 metrics: GatewayMetrics, pools: Iterable[PoolConfig],
                 served_names: Mapping[str, tuple[str, ...]],
                 reserved: Mapping[str, frozenset[str]] | None = None, drains: DrainBoard | None = None) -> None:
        pools = list(pools)
        self.registry = registry
        self.drains = drains
        self.client = client
        self.config = config
        self.metrics = metrics
        self.headers = pool_headers(pools)
        self.expected = _expected(pools, served_names)
        self.reserved: Mapping[str, frozenset[str]] = reserved or {}
        self._models_notes: dict[str, str] = {}
        self.loop = PeriodicEach("health probe", config.interval, list(registry), self.probe, label=lambda w: w.id)

    def set_pools(self, pools: Iterable[PoolConfig], served_names: Mapping[str, tuple[str, ...]],
                  reserved: Mapping[str, frozenset[str]] | None = None) -> None:
        """The pools' credentials and expected served names (pool -> the names of its models, as
        `GatewayConfig.pool_served_names` gives them), the model names no adapter listed there may
        take (`GatewayConfig.pool_reserved_names`) and max context after a reload; the
        workers of a pool whose expectation changed are checked again at their next probe (a
        fixed pool's misconfigured workers come back, a matching one that no longer matches goes)."""
        pools = list(pools)
        self.headers = pool_headers(pools)
        expected = _expected(pools, served_names)
        changed = {name for name, value in expected.items() if self.expected.get(name) != value}
        self.expected = expected
        self.reserved = reserved or {}
        for worker in self.registry:
            if worker.pool in changed:
                worker.models_checked_at = None

    async def probe(self, worker: Worker) -> bool:
        """One probe; updates the worker's state and metrics; returns the verdict."""
        reason: str | None = None
        gone = False
        try:
            probe = worker.engine.probe
            answer = await control_get(self.client, worker.url + probe.path, self.headers.get(worker.pool, {}),
                                       probe.timeout(self.config.timeout), self.config.max_body_bytes)
            if answer.status in (401, 403):
                reason = (f"health probe answered HTTP {answer.status}: the worker refused the pool's "
                          "credentials (check the pool's api_key)")
            elif answer.status != 200:
                reason = f"health probe answered HTTP {answer.status}"
        except ControlError as exc:
            reason = f"health probe failed: {exc}"
            gone = exc.gone
        if self.drains is not None and (reason is None or gone):
            try:
                started = await self._start_time(worker) if reason is None and worker.draining else None
            except ControlError as exc:  # what this engine is stays unknown: judged at the next probe
                log.debug("worker %s: start time unread (%s)", worker.id, exc)
            else:
                await self.drains.engine_seen(worker, up=reason is None, started=started)
        if reason is None:
            recovered = not worker.healthy
            self.registry.probe_passed(worker)
            if self.config.verify_models and worker.engine.kind in CHECKED_ENGINES and \
                    self._models_due(worker, recovered):
                await self.check_models(worker)
        else:
            self.registry.probe_failed(worker, reason)
            worker.models_checked_at = None  # checked again once it answers (a restart may bring new flags)
        self.registry.expire_ejections()
        return reason is None

    async def _start_time(self, worker: Worker) -> float | None:
        """When the engine process serving `worker` started (unix s), from its `/metrics`
        (`load.parse_start_time`); None when it tells none (no such gauge, or `/metrics` answers
        other than 200). Raises ControlError when `/metrics` gave no answer (same deadline and cap
        as a probe)."""
        answer = await control_get(self.client, worker.url + "/metrics", self.headers.get(worker.pool, {}),
                                   self.config.timeout, self.config.max_body_bytes)
        if answer.status != 200:
            return None
        try:
            return parse_start_time(answer.body.decode("utf-8", "replace"))
        except ValueError:  # an exposition prometheus_client cannot parse tells nothing
            return None

    def _models_due(self, worker: Worker, recovered: bool) -> bool:
        checked = worker.models_checked_at
        return (recovered or checked is None or worker.misconfigured is not None
                or time.monotonic() - checked >= self.config.models_refresh)

    async def check_models(self, worker: Worker) -> None:
        """Read the worker's `/v1/models` and mark it misconfigured or not (see the class doc)."""
        expected = self.expected.get(worker.pool)
        if expected is None:  # retiring after a reload removed its pool: nothing to judge it by
            return
        served, max_context = expected
        asked = time.monotonic()
        try:
            answer = await control_get(self.client, worker.url + MODELS_PATH, self.headers.get(worker.pool, {}),
                                       self.config.timeout, self.config.max_body_bytes)
            if answer.status in (401, 403):
                verdict: str | None = (f"{MODELS_PATH} answered HTTP {answer.status}: the worker refused the "
                                       "pool's credentials (check the pool's api_key)")
            elif answer.status != 200:
                raise UnreadableModels(f"{MODELS_PATH} answered HTTP {answer.status}")
            else:
                verdict = models_verdict(answer.body, served, max_context)
                roots = listed_adapter_roots(answer.body, served, self.reserved.get(worker.pool, frozenset()))
                self.registry.set_adapters(worker, frozenset(roots), roots, asked)
        except (ControlError, UnreadableModels) as exc:
            note = str(exc) if isinstance(exc, UnreadableModels) else f"{MODELS_PATH} failed: {exc}"
            if self._models_notes.get(worker.id) != note:
                log.warning("worker %s: cannot check what it serves (%s); trying again at the next probe",
                            worker.id, note)
            self._models_notes[worker.id] = note
            return
        self._models_notes.pop(worker.id, None)
        worker.models_checked_at = time.monotonic()
        self.registry.set_misconfigured(worker, verdict)

    async def read_adapters(self, worker: Worker) -> None:
        """Read `worker`'s `/v1/models` for the LoRA adapters it has loaded now, and nothing else
        (its verdict on the served models stays `check_models`'): the LoRA loader's look before it
        plans a load, since another replica or serving process may have loaded or unloaded one
        there since the last check (gateway/backends/lora_loader.py). A failure leaves what was
        known (logged at debug level)."""
        expected = self.expected.get(worker.pool)
        if expected is None:
            return
        asked = time.monotonic()
        try:
            answer = await control_get(self.client, worker.url + MODELS_PATH, self.headers.get(worker.pool, {}),
                                       self.config.timeout, self.config.max_body_bytes)
            if answer.status != 200:
                raise UnreadableModels(f"{MODELS_PATH} answered HTTP {answer.status}")
            roots = listed_adapter_roots(answer.body, expected[0], self.reserved.get(worker.pool, frozenset()))
        except (ControlError, UnreadableModels) as exc:
            log.debug("worker %s: LoRA adapters not read before a load (%s)", worker.id, exc)
            return
        self.registry.set_adapters(worker, frozenset(roots), roots, asked)


def _expected(pools: list[PoolConfig],
              served_names: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[tuple[str, ...], int]]:
    """Pool name -> (the names its workers must list, its max context in tokens)."""
    return {p.name: (served_names[p.name], p.max_context_tokens) for p in pools}
