"""A worker: one engine server URL inside a pool, with its runtime state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.engines import EngineSpec


@dataclass(eq=False, slots=True)
class Worker:
    """One engine server. `id` (`pool/index`) is what headers, logs and metric labels show.

    Mutable state is owned by the app's WorkerRegistry and touched only on the event loop:
    `in_flight` counts this replica's open upstream requests; `healthy` is the last verdict of
    probes and passive failures.
    """

    pool: str
    index: int
    url: str
    engine: EngineSpec
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None

    @property
    def id(self) -> str:
        return f"{self.pool}/{self.index}"

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view for /ready and admin listings."""
        return {"id": self.id, "url": self.url, "engine": self.engine.kind, "healthy": self.healthy,
                "in_flight": self.in_flight, "last_error": self.last_error}
