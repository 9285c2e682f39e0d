"""AppState: everything one gateway process shares, built once at start-up (no globals)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from gateway.affinity.hashing import PrefixHasher
from gateway.affinity.redis_store import RedisAffinityStore
from gateway.affinity.response_store import ResponseStore, build_response_store
from gateway.affinity.store import AffinityStore, MemoryAffinityStore
from gateway.auth.guard import AuthGuard
from gateway.backends.client import UpstreamClient, build_control_client
from gateway.backends.control import pool_headers
from gateway.backends.discovery import DnsDiscovery
from gateway.backends.drains import DrainBoard
from gateway.backends.h1 import H1Pool
from gateway.backends.health import HealthChecker
from gateway.backends.load import LoadScraper
from gateway.backends.lora_loader import LoraLoader
from gateway.backends.lora_slots import LoraSlots
from gateway.backends.periodic import Periodic
from gateway.backends.registry import WorkerRegistry
from gateway.config import GatewayConfig
from gateway.flow.admission import FlowControl
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import StatusWindow
from gateway.observability.tracing import Tracing
from gateway.parsing import ParsePool
from gateway.redact import Redactor
from gateway.routing.image_fetch import ImageFetcher
from gateway.routing.pool_policies import PoolPolicies
from gateway.routing.prefill import PrefillEstimator
from gateway.routing.tokens import TokenEstimator

SWEEP_EVERY_S = 1.0
"""Seconds between looks for retired workers whose requests all finished."""


@dataclass(slots=True)
class AppState:
    """Config, the upstream clients, workers, router, estimator, affinity, metrics, background tasks."""

    config: GatewayConfig
    upstream: UpstreamClient
    """Generation requests to the engines (backends/h1.py; see backends/client.py for why)."""
    http: httpx.AsyncClient
    """LoRA adapter loads, stored responses, the Mooncake bootstrap query (`build_control_client`)."""
    control: H1Pool
    """The health probes' and load scrapes' keep-alive connections (`backends/control.py`)."""
    registry: WorkerRegistry
    policies: PoolPolicies
    estimator: TokenEstimator
    metrics: GatewayMetrics
    health: HealthChecker
    lora: LoraLoader
    load: LoadScraper
    drains: DrainBoard
    """Operator drains (admin API), shared through Redis when `redis_url` is set."""
    hasher: PrefixHasher | None = None
    affinity: AffinityStore | None = None
    responses: ResponseStore | None = None
    """Stored Responses API response id -> owning worker (gateway/affinity/response_store.py)."""
    auth: AuthGuard | None = None
    """API keys, scopes and per-key quotas; None when `auth.enabled` is false."""
    images: ImageFetcher | None = None
    tracing: Tracing | None = None
    """OpenTelemetry exporter; None while `tracing.otlp_endpoint` is unset."""
    """Measures client image URLs (own httpx client); None when `image_fetch.enabled` is false."""
    prefill: PrefillEstimator = field(default_factory=PrefillEstimator)
    """Each worker's queued prefill tokens and learned prefill rate, for cost-aware policies
    (gateway/routing/prefill.py); empty while no pool uses one."""
    flow: FlowControl = field(init=False)
    """Flows and the queues of the pools with flow control on (gateway/flow/)."""
    parse_pool: ParsePool = field(init=False)
    """Where large request bodies are parsed (`gateway/parsing.py`)."""
    started_unix: int = 0
    draining: bool = False
    """True once shutdown began (`begin_draining`): `/ready` answers 503 from then on."""
    config_path: str | None = None
    """The config file, read again on a reload (SIGHUP, `POST /admin/reload`; gateway/serving/reload.py)."""
    status: StatusWindow = field(init=False)
    """Recent deltas of `metrics` for the status page (`GET /admin/status`)."""
    discovery: DnsDiscovery = field(init=False)
    """Pools' workers from DNS (`discover:`); no loops when no pool discovers."""
    sweeper: Periodic = field(init=False)
    """Forgets retired workers once their requests finished (WorkerRegistry.sweep)."""
    reload_lock: asyncio.Lock = field(init=False)

    def __post_init__(self) -> None:
        self.status = StatusWindow(self.metrics)
        self.parse_pool = ParsePool(self.config)
        self.flow = FlowControl(self.registry, self.metrics)
        self.discovery = DnsDiscovery(self.registry, self.config.discovery, self.config.pools)
        self.registry.watchers.extend([self.health, self.load, self.prefill, self.flow])
        self.sweeper = Periodic("retired-worker sweep", SWEEP_EVERY_S, self._sweep)
        self.reload_lock = asyncio.Lock()

    async def _sweep(self) -> None:
        self.registry.sweep()

    @classmethod
    def build(cls, config: GatewayConfig, metrics_dir: str | None = None,
              config_path: str | None = None) -> AppState:
        """Build the state (no I/O yet: an unreachable Redis does not block start-up).

        `metrics_dir`: prometheus_client's multiprocess directory when several processes serve
        (gateway/process/supervisor.py), else None. `config_path`: the file `config` came from (reloads).
        """
        keep_alive = min(p.upstream_keep_alive for p in config.pools)
        http = build_control_client(config.timeouts, keep_alive)
        control = H1Pool(keep_alive)
        metrics = GatewayMetrics(metrics_dir)
        registry = WorkerRegistry(config, metrics)
        hasher: PrefixHasher | None = None
        affinity: AffinityStore | None = None
        if config.affinity.enabled:
            hasher = PrefixHasher(config.affinity)
            if config.redis_url:
                affinity = RedisAffinityStore(config.redis_url, config.affinity, metrics)
            else:
                affinity = MemoryAffinityStore(config.affinity.ttl_seconds, config.affinity.memory_max_entries)
        images = ImageFetcher(config.image_fetch, metrics) if config.image_fetch.enabled else None
        upstream = UpstreamClient(config.timeouts, {p.name: p.upstream_keep_alive for p in config.pools},
                                  Redactor.of(config), config.max_decoded_bytes)
        drains = DrainBoard(registry, config.redis_url, config.affinity.key_prefix)
        health = HealthChecker(registry, control, config.health, metrics, config.pools,
                               config.pool_served_names(), config.pool_reserved_names(), drains=drains)
        slots = LoraSlots(registry, config.redis_url, config.affinity.key_prefix)
        return cls(config=config, upstream=upstream, http=http, control=control, registry=registry,
                   policies=PoolPolicies(config),
                   estimator=TokenEstimator(config.estimation), metrics=metrics,
                   health=health,
                   lora=LoraLoader(registry, http, config.timeouts.response_header, pool_headers(config.pools),
                                   slots, health.read_adapters),
                   load=LoadScraper(registry, control, config.load, metrics, config.pools),
                   drains=drains,
                   hasher=hasher, affinity=affinity,
                   responses=build_response_store(config.redis_url, config.responses, metrics),
                   auth=AuthGuard.build(config, metrics),
                   images=images, tracing=Tracing(config.tracing) if config.tracing.otlp_endpoint else None,
                   started_unix=int(time.time()), config_path=config_path)

    async def start(self) -> None:
        await self.upstream.start()
        self.health.loop.start()
        if self.config.load.enabled:
            self.load.loop.start()
        self.discovery.start()
        self.sweeper.start()
        if self.affinity is not None:
            await self.affinity.start()
        if self.responses is not None:
            await self.responses.start()
        if self.auth is not None:
            await self.auth.start()
        await self.drains.start()
        if self.lora.slots is not None:
            await self.lora.slots.start()

    def begin_draining(self) -> None:
        """Shutdown began: `/ready` answers 503 so load balancers take this replica out of rotation.

        Nothing else changes: requests that still arrive (the load balancer has not noticed yet)
        are served normally, and in-flight streams keep going. Safe to call from a signal handler
        (one attribute write).
        """
        self.draining = True

    async def stop(self) -> None:
        await self.drains.stop()
        if self.lora.slots is not None:
            await self.lora.slots.stop()
        await self.discovery.stop()
        await self.sweeper.stop()
        await self.health.loop.stop()
        await self.load.loop.stop()
        if self.affinity is not None:
            await self.affinity.stop()
        if self.responses is not None:
            await self.responses.stop()
        if self.auth is not None:
            await self.auth.stop()
        if self.images is not None:
            await self.images.aclose()
        await self.upstream.aclose()
        await self.http.aclose()
        self.control.close()
        self.parse_pool.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # a blocking flush of the last spans
