"""`FlowControl`: one process's flows, its pools' queues of held requests and their release.

A request for a pool with `flow_control.enabled` asks `admit` before it is routed there. It goes
on at once when the pool has room (`saturation.pool_room`, less the requests already let go and
not yet sent: `in_transit`) and no request of its band or a higher one is held there; otherwise it
is held in the pool's `FlowQueue` (highest band first, fair across flows, first come first served
within one) until room shows up, and is routed then, to the worker that has room at that moment
(or a later pool, as any request). Room is looked at again when a request of the pool ends or
starts (its `StartTicket`), and every `recheck_interval` s while requests are held (the engines'
scraped load changes at every load scrape).

Bounds (`FlowControlConfig`): `max_queued` requests and `max_queued_bytes` body bytes held in
all; per tenant `max_queued_per_flow` and `max_queued_bytes_per_flow`. Beyond a tenant's bound:
429 `rate_limit_exceeded` (type `requests`); beyond the whole bound, or after `queue_timeout` s
held: 503 `server_overloaded`; both with `Retry-After` (the client API's error shape is the
endpoint's: OpenAI's or Anthropic's). A client that hangs up while held cancels its handler, which
takes its request out of the queue at once (`admit`'s cleanup).

Not held (they never call `admit`): a migrated stream's continuation and a prefill/decode
attempt's second leg (both are part of a request already admitted, `gateway/dispatch/migration.py`
and `gateway/dispatch/pd/`), and a request's later attempts after its first one failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.auth.keys import Principal
from gateway.auth.params import ApiKeyConfig
from gateway.backends.capacity import PoolGate
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.config import GatewayConfig
from gateway.errors import NoCapacity, RateLimited
from gateway.flow.params import MIN_BAND, FlowControlConfig
from gateway.flow.queue import FlowQueue
from gateway.flow.saturation import Starts, StartTicket, pool_room, worker_room
from gateway.observability.metrics import GatewayMetrics

ANONYMOUS = "anonymous"
"""The tenant of every request when auth is off."""

MAX_SUB_FLOW_CHARS = 128
"""A sub-flow header's value is cut to this many characters."""

RETRY_AFTER = "1"
"""Seconds a refused client is told to wait: held requests leave as requests end."""


@dataclass(frozen=True, slots=True)
class Flow:
    """Who a request is for flow control: its `tenant` (a key's `flow`, else its name), `sub`
    (the sub-flow header's value, "" without one), its `band` and whether its client's own engine
    `priority` field passes (`client_priority`: the key's, or auth off)."""

    tenant: str
    sub: str
    band: int
    client_priority: bool


@dataclass(frozen=True, slots=True)
class _KeyFlow:
    tenant: str
    band: int
    max_band: int
    client_priority: bool


class _Held:
    """One held request: its release (`future`), flow, cost and body size, and when it came."""

    __slots__ = ("at", "cost", "flow", "future", "size")

    def __init__(self, flow: Flow, cost: float, size: int) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.flow = flow
        self.cost = cost
        self.size = size
        self.at = time.monotonic()

    def released(self) -> bool:
        """Whether the queue let it go (a wait cut by a hang-up or the timeout cancels the future)."""
        return self.future.done() and not self.future.cancelled()


class PoolFlow:
    """One pool's held requests and room: `queue`, `in_transit` (let go, not yet sent to a
    worker), and each worker's not-started requests (`starts`)."""

    __slots__ = ("_gate", "_registry", "_timer", "_woken", "config", "in_transit", "name", "queue", "recheck",
                 "starts")

    def __init__(self, pool: PoolConfig, registry: WorkerRegistry, recheck: float) -> None:
        self.name = pool.name
        self.config = pool
        self.recheck = recheck
        self._registry = registry
        self._gate: PoolGate = registry.gates[pool.name]
        self.queue: FlowQueue[_Held] = FlowQueue()
        self.in_transit = 0
        self.starts: dict[Worker, Starts] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._woken = False

    def room(self) -> int:
        """Requests that may go to the pool's workers now (`saturation.pool_room`) less those in transit."""
        registry, pool = self._registry, self.config
        workers = registry.candidates(pool.name)
        prefills = registry.candidates(pool.name, (), "prefill") if pool.disaggregation is not None else None
        gate = registry.gates.get(pool.name, self._gate)
        return pool_room(workers, prefills, gate, self.starts.get, pool.flow_control) - self.in_transit

    def ticket(self, worker: Worker, tokens: int, stream: bool) -> StartTicket:
        """A request of `tokens` estimated uncached prompt tokens sent to `worker` now (`stream`:
        its first byte is its first token; see `StartTicket`)."""
        starts = self.starts.get(worker)
        if starts is None:
            starts = self.starts[worker] = Starts()
        return StartTicket(starts, tokens, stream, self.wake)

    def wake(self) -> None:
        """Room may have grown: release what it allows soon (once per loop turn however often called)."""
        if self.queue.held and not self._woken:
            self._woken = True
            asyncio.get_running_loop().call_soon(self.release)

    def release(self) -> int:
        """Let held requests go while the pool has room, in the queue's order; look again in
        `recheck` s while any are still held. All of them go when the pool has no worker in service
        left (a reload removed it, every worker is down): routed, they get the answer a request
        without flow control gets then (spill-over or 503), not a wait for workers that are gone.
        Returns how many went."""
        self._woken = False
        went = 0
        room = self.room() if self.queue.held else 0
        if self.queue.held and not self._registry.candidates(self.config.name):
            room = self.queue.held
        while room > 0:
            held = self.queue.pop()
            if held is None:
                break
            if held.future.done():  # its waiter is gone (`admit` takes it out; never here)
                continue
            held.future.set_result(None)
            self.in_transit += 1
            room -= 1
            went += 1
        if self.queue.held and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.recheck, self._tick)
        return went

    def _tick(self) -> None:
        self._timer = None
        self.release()

    def sent(self) -> None:
        """A request let go (or admitted at once) reached its first attempt, or ended before one."""
        self.in_transit -= 1
        self.wake()


class Pass:
    """A request's admission to a pool: counted in the pool's `in_transit` until `done()` (its
    first attempt took its worker, or it ended first). `waited`: seconds it was held."""

    __slots__ = ("_pool", "waited")

    def __init__(self, pool: PoolFlow, waited: float) -> None:
        self._pool: PoolFlow | None = pool
        self.waited = waited

    def done(self) -> None:
        """Idempotent."""
        if self._pool is not None:
            self._pool.sent()
            self._pool = None


class FlowControl:
    """Flows and the flow-controlled pools' queues of one serving process (`AppState.flow`).

    `flow_of` names a request's flow and band, `admit` holds it while its pool has no room,
    `ticket` counts a request sent to a worker of such a pool until it starts. Metrics through
    `metrics` (`kimi_gateway_flow_*`)."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        self._registry = registry
        self._metrics = metrics
        self._pools: dict[str, PoolFlow] = {}
        self._keys: dict[str, _KeyFlow] = {}
        self._keys_of: list[ApiKeyConfig] | None = None
        self.held = 0
        self.held_bytes = 0
        self._tenant_held: dict[str, tuple[int, int]] = {}

    # --- flows ---------------------------------------------------------------------------------

    def flow_of(self, config: GatewayConfig, principal: Principal | None, headers: Mapping[str, str]) -> Flow:
        """The request's flow: its key's tenant and band (auth off: `anonymous`, band 0, the
        client's own `priority` passes as it always did), the sub-flow header's value, and the
        priority header's band, at most the key's `max_priority` (at least `MIN_BAND`; a value that is
        not an integer is ignored)."""
        flows = config.flow_control
        key = _KeyFlow(ANONYMOUS, 0, 0, True) if principal is None else self._key(config, principal.name)
        sub = headers.get(flows.flow_header, "")[:MAX_SUB_FLOW_CHARS] if flows.flow_header else ""
        band = key.band
        asked = headers.get(flows.priority_header) if flows.priority_header else None
        if asked is not None:
            with contextlib.suppress(ValueError):
                band = max(min(int(asked.strip()), key.max_band), MIN_BAND)
        return Flow(key.tenant, sub, band, key.client_priority)

    def client_priority(self, config: GatewayConfig, principal: Principal | None) -> bool:
        """Whether the engines get a client's own `priority` field: its key's `client_priority`, or
        auth off (gateway/flow/priority.py)."""
        return principal is None or self._key(config, principal.name).client_priority

    def _key(self, config: GatewayConfig, name: str) -> _KeyFlow:
        if self._keys_of is not config.auth.keys:
            self._keys_of = config.auth.keys
            self._keys = {k.name: _KeyFlow(k.flow or k.name, k.priority,
                                           k.priority if k.max_priority is None else k.max_priority,
                                           k.client_priority) for k in config.auth.keys}
        return self._keys.get(name) or _KeyFlow(name, 0, 0, False)

    # --- pools ---------------------------------------------------------------------------------

    def pool(self, pool: PoolConfig, recheck: float) -> PoolFlow:
        """The pool's flow state (made on first use; its config refreshed after a reload)."""
        flow = self._pools.get(pool.name)
        if flow is None:
            flow = self._pools[pool.name] = PoolFlow(pool, self._registry, recheck)
        else:
            flow.config, flow.recheck = pool, recheck
        return flow

    def with_room(self, pool: PoolConfig, workers: list[Worker]) -> list[Worker]:
        """Those of `workers` (candidates of `pool`, flow control on) that are not saturated, or all
        of them when every one is: a request let in goes to a worker that has room then."""
        flow = self._pools.get(pool.name)
        starts = flow.starts if flow is not None else {}
        decode = pool.disaggregation is not None
        roomy = [w for w in workers if worker_room(w, starts.get(w), pool.flow_control, decode) > 0]
        return roomy or workers

    def ticket(self, pool: PoolConfig, worker: Worker, tokens: int, stream: bool) -> StartTicket | None:
        """For a pool with flow control on: a request of `tokens` estimated uncached prompt tokens
        sent to `worker` now (`stream`: it streams), counted there until it starts (`StartTicket`);
        None when it is off."""
        if not pool.flow_control.enabled:
            return None
        flow = self._pools.get(pool.name)
        if flow is None:
            flow = self._pools[pool.name] = PoolFlow(pool, self._registry, FlowControlConfig().recheck_interval)
        return flow.ticket(worker, tokens, stream)

    async def admit(self, config: FlowControlConfig, pool: PoolConfig, flow: Flow, cost: float,
                    size: int) -> Pass:
        """Let a request of `flow` into `pool` (flow control on there): at once when the pool has
        room and nothing of its band or above is held, else once the queue lets it go. `cost`:
        what fairness counts for it (`fair_by`), `size`: its body's bytes. Raises RateLimited
        (429: its tenant holds its bound) or NoCapacity (503: the gateway holds its bound, or
        `queue_timeout` passed), each with Retry-After; CancelledError (its client hung up) after
        taking it out of the queue."""
        pool_flow = self.pool(pool, config.recheck_interval)
        top = pool_flow.queue.highest_band()
        if (top is None or flow.band > top) and pool_flow.room() > 0:
            pool_flow.in_transit += 1
            return Pass(pool_flow, 0.0)
        band = str(flow.band)
        try:
            self._check_bounds(config, flow.tenant, size)
        except (RateLimited, NoCapacity):
            self._metrics.flow_refused(pool.name, band)
            raise
        held = _Held(flow, max(cost, 1.0), size)
        pool_flow.queue.push(flow.band, flow.tenant, flow.sub, held, held.cost)
        self._count(flow.tenant, 1, size)
        self._metrics.flow_held(pool.name, band)
        pool_flow.release()
        outcome = "expired"
        try:
            async with asyncio.timeout(config.queue_timeout):
                await held.future
            outcome = "dispatched"
        except TimeoutError:
            if not held.released():
                raise NoCapacity(f"The inference servers stayed saturated for the {config.queue_timeout:g} s a "
                                 "request may wait; try again shortly.",
                                 headers={"retry-after": RETRY_AFTER}, code="server_overloaded") from None
            outcome = "dispatched"  # let go as its time ran out: it goes
        except asyncio.CancelledError:
            outcome = "gone"
            if held.released():
                pool_flow.sent()  # let go, but its client left before it went on
            raise
        finally:
            if not held.released():  # (a cancelled wait cancels the future too)
                pool_flow.queue.remove(flow.band, flow.tenant, flow.sub, held)
            self._count(flow.tenant, -1, -size)
            self._metrics.flow_left(pool.name, band, outcome, time.monotonic() - held.at)
        return Pass(pool_flow, time.monotonic() - held.at)

    def _check_bounds(self, config: FlowControlConfig, tenant: str, size: int) -> None:
        count, held_bytes = self._tenant_held.get(tenant, (0, 0))
        if count >= config.max_queued_per_flow or held_bytes + size > config.max_queued_bytes_per_flow:
            raise RateLimited(f"Too many requests of this key are waiting for the inference servers ({count}); "
                              "try again shortly.", "requests", headers={"retry-after": RETRY_AFTER})
        if self.held >= config.max_queued or self.held_bytes + size > config.max_queued_bytes:
            raise NoCapacity("The inference servers are saturated and the gateway's queue is full; try again "
                             "shortly.", headers={"retry-after": RETRY_AFTER}, code="server_overloaded")

    def _count(self, tenant: str, requests: int, size: int) -> None:
        self.held += requests
        self.held_bytes += size
        count, held_bytes = self._tenant_held.get(tenant, (0, 0))
        if count + requests:
            self._tenant_held[tenant] = (count + requests, held_bytes + size)
        else:
            self._tenant_held.pop(tenant, None)

    def worker_gone(self, worker: Worker) -> None:
        """Forget a worker's not-started requests (their tickets close harmlessly)."""
        flow = self._pools.get(worker.pool)
        if flow is not None:
            flow.starts.pop(worker, None)

    def worker_added(self, worker: Worker) -> None:
        """A new worker may give a pool room."""
        flow = self._pools.get(worker.pool)
        if flow is not None:
            flow.wake()
