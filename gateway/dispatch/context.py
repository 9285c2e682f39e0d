"""One request's dispatch: what all its attempts share and what the attempts so far left behind."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dialects.names import Api
from gateway.dispatch.failures import Failures
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.steps import BodyKey
from gateway.flow.admission import Flow, Pass
from gateway.parsing import Payload
from gateway.routing.features import RoutingRequest
from gateway.state import AppState
from gateway.streaming import AttemptFailed


@dataclass(slots=True)
class Dispatch:
    """The state of one request's way through the pools (one object per request, no task).

    `pools` are the fitting pools smallest first and `pool` the one it is in now; `tried` the
    workers that failed it; `ledger` its accountant; `matches` pool -> worker URL -> the share of the prompt that worker
    holds (one affinity lookup per pool); `bodies` the engine bodies encoded so far
    (`steps.engine_body`); `queue_deadline` (event-loop seconds) is set when it first waits for a
    slot; `last` is the latest failed attempt and `too_long_retried` whether an engine's "too long"
    already moved it to a larger pool.
    """

    state: AppState
    api: Api
    payload: Payload
    request: RoutingRequest
    ledger: Ledger
    pools: list[PoolConfig]
    pool: PoolConfig
    failures: Failures = field(default_factory=Failures)
    tried: set[Worker] = field(default_factory=set)
    matches: dict[str, dict[str, float]] = field(default_factory=dict)
    bodies: dict[BodyKey, bytes] = field(default_factory=dict)
    queue_deadline: float | None = None
    last: AttemptFailed | None = None
    too_long_retried: bool = False
    migrate: bool = True
    """Whether a stream of it may be continued on another worker after a mid-stream failure (the
    client's `x-kimi-gateway-migrate: off` says no; `gateway/dispatch/migration.py`)."""
    pinned: Worker | None = None
    """The one worker that may serve it (a Responses follow-up's owner, `routing/response_affinity.py`):
    one attempt there, no policy, spill-over or failover (`kinds.PINNED`)."""
    flow: Flow | None = None
    """Its flow and band (gateway/flow/admission.py), when a pool of its chain has flow control on."""
    admission: Pass | None = None
    """Its admission to the first flow-controlled pool it reached (once per request), until its
    first attempt took a worker (`Pass.done`)."""
    size: int = 0
    """Its body's bytes (what a held request keeps in memory)."""
    engine_priority: int | None = None
    """The engine `priority` the gateway wrote into `payload` for the pool it is in (None: none;
    gateway/flow/priority.py)."""

    def move_to(self, pool: PoolConfig) -> None:
        """The request goes on in `pool` (a spill-over or a larger pool after "too long")."""
        self.pool = pool
        self.ledger.in_pool(pool.name)
