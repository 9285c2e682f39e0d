"""The image fetcher's DNS runs in threads of its own: a name server that never answers cannot
stall the event loop's shared resolver threads (engine connections, health probes)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

from gateway.observability.metrics import GatewayMetrics
from gateway.routing.image_fetch import ImageFetcher, SystemResolver
from gateway.routing.params import ImageFetchConfig


class SilentNameServer:
    """getaddrinfo's shape; every lookup blocks until released (a name server that never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def __call__(self, host: str, port: int, family: int = 0, type: int = 0) -> list[Any]:
        self.started += 1
        self.release.wait(10)
        raise socket.gaierror("no answer")


@pytest.mark.anyio
async def test_stuck_lookups_hold_only_the_fetchers_own_threads() -> None:
    silent = SilentNameServer()
    resolver = SystemResolver(threads=2, lookup=silent)
    try:
        stuck = [asyncio.ensure_future(resolver(f"n{i}.slow.test", 80)) for i in range(2)]
        deadline = time.monotonic() + 5
        while silent.started < 2:  # both threads are in their lookup
            assert time.monotonic() < deadline, f"{silent.started} lookups started"
            await asyncio.sleep(0.01)
        started = time.monotonic()
        for i in range(20):  # every thread busy: the next lookups fail at once instead of queueing
            with pytest.raises(OSError, match="busy"):
                await resolver(f"more{i}.slow.test", 80)
        assert time.monotonic() - started < 0.5 and silent.started == 2
        # The event loop's own resolver (what the engine client and probes use) is unaffected.
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("localhost", 80), 2)
        assert infos
        for task in stuck:
            task.cancel()
        await asyncio.sleep(0.05)
        with pytest.raises(OSError, match="busy"):  # giving up waiting does not free the thread
            await resolver("again.slow.test", 80)
    finally:
        silent.release.set()
    deadline = time.monotonic() + 5
    while True:  # free again once the lookups really ended: a real answer (no such name), not "busy"
        try:
            await resolver("later.slow.test", 80)
        except socket.gaierror:
            break
        except OSError as exc:
            assert "busy" in str(exc) and time.monotonic() < deadline, exc
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("later.slow.test resolved")
    resolver.close()


@pytest.mark.anyio
async def test_many_images_on_a_silent_name_server_cost_the_budget_and_no_more() -> None:
    silent = SilentNameServer()
    metrics = GatewayMetrics()
    fetcher = ImageFetcher(ImageFetchConfig(enabled=True, timeout=0.5, request_budget=1.0), metrics,
                           SystemResolver(threads=2, lookup=silent))
    try:
        started = time.monotonic()
        sizes = await fetcher.measure([f"http://img{i}.slow.test/i.png" for i in range(16)])
        assert sizes == {} and time.monotonic() - started < 1.5
        results = {s.labels["result"]: s.value for m in metrics.registry.collect() if m.name.endswith("fetches")
                   for s in m.samples if s.name.endswith("_total")}
        assert sum(results.values()) == 16 and results.get("error", 0) >= 14  # the rest failed at once
    finally:
        silent.release.set()
        await fetcher.aclose()
