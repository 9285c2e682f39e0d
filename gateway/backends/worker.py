"""A worker: one engine server URL inside a pool, with its runtime state."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from gateway.backends.answer_marks import AnswerMarks
from gateway.backends.engine_kinds import EngineSpec


@dataclass(eq=False, slots=True)
class Worker:
    """One engine server. `id` (`pool/index`) is what headers, logs and metric labels show.

    Mutable state is owned by the app's WorkerRegistry and touched only on the event loop:
    `in_flight` counts this replica's open upstream requests; `healthy` is the verdict of probes
    and refused connections; `ejected_until` / `busy_until` (monotonic seconds) keep an outlier
    or a worker that answered 429 out of new requests until then; `draining` (set by an operator
    through the admin API) keeps it out of new requests while its in-flight ones finish;
    `misconfigured` (the reason, from the prober's `/v1/models` check) keeps it out of every request
    until a later check finds it serving the pool's model name and max context;
    `adapters` are the LoRA adapter names its `/v1/models` listed at the last check (None until one
    was read: then a pool's declared `lora_adapters` are taken on trust); `on_demand` those of them its
    pool loads on demand (name -> (path, time.monotonic() s of the load, `registry.UNKNOWN_LOAD`
    when another replica or process loaded it)): the only ones the gateway may unload
    (`WorkerRegistry.set_adapters`); `adapter_in_flight` / `adapter_used_at` this process's requests
    naming each adapter on it now and when one last started or ended (time.monotonic() s), kept by
    the leg's `Lease` (gateway/streaming.py; shared with other replicas by
    gateway/backends/lora_slots.py).
    `retired` marks a worker discovery or a reload removed (out of its pool, finishing its requests).
    `role` is None for an aggregated pool's worker, "prefill" or "decode" in a prefill/decode pool
    (`bootstrap_port`: a SGLang / vLLM Mooncake prefill worker's bootstrap server port).
    `answered_at`: when it last sent response headers for any request (a wedged engine accepts
    requests and answers none; a client hang-up is held against it only when it answered nothing
    since that request was sent); `answers` its latest answers by size (`answer_marks.py`), which
    its silent peers are compared with.
    """

    pool: str
    index: int
    url: str
    engine: EngineSpec
    role: str | None = None
    bootstrap_port: int | None = None
    pd_engine_id: str | None = None  # a vLLM Mooncake prefill worker's engine id (its bootstrap `GET /query`)
    healthy: bool = True
    draining: bool = False
    retired: bool = False
    in_flight: int = 0
    consecutive_failures: int = 0
    failed_probes: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    busy_until: float = 0.0
    last_error: str | None = None
    misconfigured: str | None = None
    models_checked_at: float | None = None
    adapters: frozenset[str] | None = None  # LoRA adapters its /v1/models listed last; None: never read
    on_demand: dict[str, tuple[str, float]] = field(default_factory=dict)
    adapter_in_flight: dict[str, int] = field(default_factory=dict)
    adapter_used_at: dict[str, float] = field(default_factory=dict)
    unloaded: dict[str, float] = field(default_factory=dict)  # adapters this gateway unloaded here: name -> when
    engine_running: float | None = None
    engine_waiting: float | None = None
    kv_usage: float | None = None
    in_flight_at_scrape: int = 0
    scraped_at: float = 0.0  # time.monotonic() s when the last load scrape that updated the engine fields was sent
    answered_at: float = 0.0  # time.perf_counter() s of its last response headers (any request): alive then
    answers: AnswerMarks = field(default_factory=AnswerMarks)

    def load(self) -> float:
        """Requests on the engine, in requests: its own running + waiting at the last scrape,
        corrected by how this replica's in-flight count moved since (started minus finished, not
        yet visible there), and never below this replica's in-flight count (all there is when the
        engine exports no load metrics)."""
        if self.engine_running is None:
            return float(self.in_flight)
        engine = self.engine_running + (self.engine_waiting or 0.0) + self.in_flight - self.in_flight_at_scrape
        return max(engine, float(self.in_flight))

    def serves_adapter(self, adapter: str, declared: Collection[str]) -> bool:
        """Whether a request for LoRA `adapter` may come here: its `/v1/models` listed it, or none
        was read yet and its pool declares it (`declared`: the pool's `lora_adapters`)."""
        return adapter in self.adapters if self.adapters is not None else adapter in declared

    def in_service(self, now: float) -> bool:
        """Healthy, correctly configured, not drained and not ejected at `now` (time.monotonic() s)."""
        return self.healthy and self.misconfigured is None and not self.draining and self.ejected_until <= now

    def state(self, now: float) -> str:
        """One word for status pages: `unhealthy`, `misconfigured`, `ejected`, `draining` or
        `healthy`, in that order of precedence (a drained worker that also fails its probes shows
        `unhealthy`)."""
        if not self.healthy:
            return "unhealthy"
        if self.misconfigured is not None:
            return "misconfigured"
        if self.ejected_until > now:
            return "ejected"
        return "draining" if self.draining else "healthy"

    @property
    def id(self) -> str:
        return f"{self.pool}/{self.index}"

    @property
    def label(self) -> str:
        """The id for log lines, with a PD worker's role: `pd/0 (prefill)`."""
        return self.id if self.role is None else f"{self.pool}/{self.index} ({self.role})"

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view for /ready and the admin API.

        `load`, `engine_running` and `engine_waiting` are requests, `kv_usage` a fraction (0..1),
        `ejected_for_s` / `busy_for_s` the seconds left of an ejection / a 429 back-off (0 when
        none); `role` is None, "prefill" or "decode" (a PD pool's); the engine fields are None
        until the first scrape of its `/metrics`; `misconfigured` is why the worker gets no
        traffic (its `/v1/models` disagrees with the pool), else None.
        """
        now = time.monotonic()
        return {"id": self.id, "pool": self.pool, "index": self.index, "url": self.url, "engine": self.engine.kind,
                "role": self.role,
                "state": self.state(now), "retired": self.retired, "healthy": self.healthy, "draining": self.draining,
                "in_flight": self.in_flight, "load": self.load(), "engine_running": self.engine_running,
                "engine_waiting": self.engine_waiting, "kv_usage": self.kv_usage, "ejections": self.ejections,
                "ejected": self.ejected_until > now, "ejected_for_s": round(max(self.ejected_until - now, 0.0), 3),
                "busy_for_s": round(max(self.busy_until - now, 0.0), 3),
                "consecutive_failures": self.consecutive_failures, "failed_probes": self.failed_probes,
                "last_error": self.last_error, "misconfigured": self.misconfigured}
