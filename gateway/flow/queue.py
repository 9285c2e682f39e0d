"""The requests one pool holds, in priority bands of fair-queued flows (pure data, no I/O).

Order: the highest band with a held request first. Within a band, start-time fair queuing (SFQ,
Goyal, Vin and Cheng, SIGCOMM 1996) over tenants, and inside a tenant over its sub-flows; first
come first served within a sub-flow. Each node (a band over its tenants, a tenant over its
sub-flows) keeps a virtual time V and each child a start tag S and finish tag F:

- a child that gets a held request while it had none is tagged S = max(V, F) (an idle flow gets
  no credit for its idle time, and no debt: it starts level with the flows being served);
- the child with the least S is served next (ties: the one tagged first); V becomes its S, its F
  becomes S + the cost of the request it gave, and if it holds more it is tagged again S = F.

So within a band each backlogged tenant gets an equal share of the cost served, whatever its
arrival rate: a tenant that floods only lengthens its own queue, and one that sends a request now
and then is served after at most about one request of each other tenant. The cost is what
`fair_by` counts (`FlowControlConfig`): estimated tokens, or 1 per request. Sub-flows share their
tenant's share, so a key cannot grow its share by naming more sub-flows.

A request that leaves before it is served (its client hung up, its time ran out) is taken out of
its sub-flow at once, and a sub-flow it leaves empty out of its tenant's order; a tenant left
without held requests is skipped when it comes up in its band's order. Memory: the held requests,
one node per sub-flow holding some, one per tenant (a configured key) and band.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

_order = itertools.count()
"""Ties between equal start tags go to the child tagged first."""


class _Node(Generic[T]):
    """A child of a band or a tenant: its tags, its name in its parent and whether it is in its
    parent's order (`queued`)."""

    __slots__ = ("finish", "name", "queued", "start")

    def __init__(self, name: str) -> None:
        self.name = name
        self.start = 0.0
        self.finish = 0.0
        self.queued = False

    def holds(self) -> bool:
        raise NotImplementedError

    def take(self) -> tuple[T, float] | None:
        raise NotImplementedError


class SubFlow(_Node[T]):
    """One sub-flow's held requests, first come first served: (item, cost) pairs."""

    __slots__ = ("items",)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.items: deque[tuple[T, float]] = deque()

    def holds(self) -> bool:
        return bool(self.items)

    def take(self) -> tuple[T, float] | None:
        return self.items.popleft() if self.items else None


class Fair(_Node[T]):
    """A node serving its children by start-time fair queuing (see the module docstring). An
    empty sub-flow out of the order is forgotten (sub-flow names come from clients: only those
    holding requests are kept); a tenant's tags are kept (tenants are the configured keys)."""

    __slots__ = ("children", "order", "vtime")

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.vtime = 0.0
        self.order: list[tuple[float, int, _Node[T]]] = []
        self.children: dict[str, _Node[T]] = {}

    def holds(self) -> bool:
        return any(child.holds() for _, _, child in self.order)

    def tag(self, child: _Node[T]) -> None:
        """`child` just got a request: into this node's order unless it is there."""
        if not child.queued:
            child.queued = True
            child.start = max(self.vtime, child.finish)
            heapq.heappush(self.order, (child.start, next(_order), child))

    def take(self) -> tuple[T, float] | None:
        while self.order:
            start, _, child = heapq.heappop(self.order)
            taken = child.take()
            if taken is not None:
                self.vtime = start
                child.finish = start + taken[1]
            if taken is not None and child.holds():
                child.start = child.finish
                heapq.heappush(self.order, (child.start, next(_order), child))
            else:
                child.queued = False
                if isinstance(child, SubFlow):
                    del self.children[child.name]
            if taken is not None:
                return taken
        return None


class FlowQueue(Generic[T]):
    """One pool's held requests: bands (higher first) of tenants of sub-flows (see the module
    docstring). `push` adds an item, `pop` takes the next one, `remove` takes a given one out;
    `held` counts them."""

    __slots__ = ("_bands", "held")

    def __init__(self) -> None:
        self._bands: dict[int, Fair[T]] = {}
        self.held = 0

    def push(self, band: int, tenant: str, sub: str, item: T, cost: float) -> None:
        """Hold `item` of `cost` (> 0) at the end of its sub-flow."""
        fair = self._bands.get(band)
        if fair is None:
            fair = self._bands[band] = Fair()
        node = fair.children.get(tenant)
        if node is None:
            node = fair.children[tenant] = Fair(tenant)
        assert isinstance(node, Fair)
        flow = node.children.get(sub)
        if flow is None:
            flow = node.children[sub] = SubFlow(sub)
        assert isinstance(flow, SubFlow)
        flow.items.append((item, cost))
        node.tag(flow)
        fair.tag(node)
        self.held += 1

    def pop(self) -> T | None:
        """The next item to serve (highest band first), or None when nothing is held."""
        if not self.held:
            return None
        for band in sorted(self._bands, reverse=True):
            taken = self._bands[band].take()
            if taken is not None:
                self.held -= 1
                return taken[0]
        return None

    def highest_band(self) -> int | None:
        """The highest band holding an item, or None."""
        if not self.held:
            return None
        return max((band for band, fair in self._bands.items() if fair.holds()), default=None)

    def remove(self, band: int, tenant: str, sub: str, item: T) -> bool:
        """Take `item` out of its sub-flow (its client left, its time ran out); False when it is
        not held there (it was served)."""
        fair = self._bands.get(band)
        node = fair.children.get(tenant) if fair is not None else None
        flow = node.children.get(sub) if isinstance(node, Fair) else None
        if not isinstance(flow, SubFlow):
            return False
        for i, (held, _) in enumerate(flow.items):
            if held is item:
                del flow.items[i]
                self.held -= 1
                if not flow.items:  # forgotten now: out of its tenant's order too (bounded memory)
                    assert isinstance(node, Fair)
                    del node.children[sub]
                    node.order = [entry for entry in node.order if entry[2] is not flow]
                    heapq.heapify(node.order)
                    flow.queued = False
                return True
        return False
