"""Service discovery (gateway/backends/discovery.py): workers from a DNS name, re-resolved while
traffic flows. A real DNS server on a loopback UDP port (tests/dns_support.py) answers the
gateway's resolver (`discovery.nameservers`); the engines are simulators on loopback addresses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.backends.discovery import DiscoveryFailed, build_resolver, resolve_workers
from gateway.backends.params import DiscoverConfig, DiscoveryConfig
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from gateway.sim.worker_state import SimWorkerState
from tests.dns_support import LoopbackDns
from tests.support import RunningGateway
from tests.traffic import Traffic

pytestmark = pytest.mark.anyio

NAME = "vllm.k3.test."
SRV_NAME = "_http._tcp.vllm.k3.test."


@pytest.fixture
def dns_server() -> Iterator[LoopbackDns]:
    with LoopbackDns() as server:
        yield server


def resolver_config(server: LoopbackDns, **extra: Any) -> DiscoveryConfig:
    return DiscoveryConfig(nameservers=["127.0.0.1"], port=server.port, **extra)


# --- the resolver alone ---------------------------------------------------------------------------

async def test_a_and_aaaa_records_become_worker_urls(dns_server: LoopbackDns) -> None:
    dns_server.a[NAME] = ["127.0.0.3", "127.0.0.2"]
    dns_server.aaaa[NAME] = ["::1"]
    resolver = build_resolver(resolver_config(dns_server))
    urls = await resolve_workers(resolver, DiscoverConfig(name=NAME, port=8000))
    assert urls == ["http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://[::1]:8000"]
    https = await resolve_workers(resolver, DiscoverConfig(name=NAME.rstrip("."), port=443, scheme="https"))
    assert https[0] == "https://127.0.0.2:443"


@pytest.mark.parametrize("glue", [True, False])
async def test_srv_records_give_each_worker_its_port(glue: bool) -> None:
    with LoopbackDns(glue=glue) as server:
        server.srv[SRV_NAME] = [("w1.k3.test.", 30001), ("w2.k3.test.", 30002)]
        server.a["w1.k3.test."] = ["10.1.0.1"]
        server.a["w2.k3.test."] = ["10.1.0.2"]
        resolver = build_resolver(resolver_config(server))
        urls = await resolve_workers(resolver, DiscoverConfig(name=SRV_NAME, record="srv"))
        # Without glue the resolver asked for the targets' addresses itself: 1 SRV + 2 x (A + AAAA).
        assert server.queries == (1 if glue else 5)
    assert urls == ["http://10.1.0.1:30001", "http://10.1.0.2:30002"]


async def test_failed_or_empty_answers_raise_so_the_last_set_stays(dns_server: LoopbackDns,
                                                                   unused_port: int) -> None:
    resolver = build_resolver(resolver_config(dns_server, timeout=0.5))
    with pytest.raises(DiscoveryFailed, match="has no records"):  # NXDOMAIN
        await resolve_workers(resolver, DiscoverConfig(name="gone.k3.test", port=8000))
    dns_server.a[NAME] = ["127.0.0.2"]
    dns_server.failing = True
    with pytest.raises(DiscoveryFailed, match=r"SERVFAIL|answered"):
        await resolve_workers(resolver, DiscoverConfig(name=NAME, port=8000))
    silent = build_resolver(DiscoveryConfig(nameservers=["127.0.0.1"], port=unused_port, timeout=0.5))
    started = time.monotonic()
    with pytest.raises(DiscoveryFailed):  # nothing listens there
        await resolve_workers(silent, DiscoverConfig(name=NAME, port=8000))
    assert time.monotonic() - started < 3


async def test_one_address_family_failing_keeps_the_last_set(dns_server: LoopbackDns) -> None:
    # A dual-stack name whose A question fails (SERVFAIL) while AAAA answers: taking the AAAA
    # records as the whole answer would remove every IPv4 worker on a DNS blip.
    dns_server.a[NAME] = ["127.0.0.2", "127.0.0.3"]
    dns_server.aaaa[NAME] = ["::1"]
    resolver = build_resolver(resolver_config(dns_server, timeout=0.5))
    for family in ("A", "AAAA"):
        dns_server.failing_types = {family}
        with pytest.raises(DiscoveryFailed, match=f"{family}: "):
            await resolve_workers(resolver, DiscoverConfig(name=NAME, port=8000))
    dns_server.failing_types = {"AAAA"}  # an SRV target's addresses: the same rule
    dns_server.srv[SRV_NAME] = [("w1.k3.test.", 30001)]
    dns_server.a["w1.k3.test."] = ["10.1.0.1"]
    dns_server.glue = False
    with pytest.raises(DiscoveryFailed, match="AAAA: "):
        await resolve_workers(resolver, DiscoverConfig(name=SRV_NAME, record="srv"))
    dns_server.failing_types = set()
    assert await resolve_workers(resolver, DiscoverConfig(name=SRV_NAME, record="srv")) == ["http://10.1.0.1:30001"]


# --- a gateway whose pool comes from DNS, under traffic --------------------------------------------

class Sims:
    """Simulated vLLM engines; `record: a` puts them on 127.0.0.2, .3, .4 ... on one port (the
    Service's port), `record: srv` on 127.0.0.1 with a port each."""

    def __init__(self, record: str) -> None:
        self.record = record
        self.port = 0
        self.servers: list[ThreadedServer] = []
        self.engines: dict[str, SimWorkerState] = {}
        self.hosts: dict[str, str] = {}  # url -> DNS host entry (address or SRV target)

    def start(self, n: int) -> str:
        app = create_sim_app(SimConfig(engine="vllm", max_context_tokens=8192, ttft_s=0.02, tpot_s=0.03))
        host = f"127.0.0.{n}" if self.record == "a" else "127.0.0.1"
        server = ThreadedServer(app, host=host, port=self.port).start()
        if self.record == "a":
            self.port = server.port  # the next ones share it, on their own address
        self.servers.append(server)
        self.engines[server.url] = app.engine
        self.hosts[server.url] = host if self.record == "a" else f"w{n}.k3.test."
        return server.url

    def publish(self, server: LoopbackDns, urls: list[str]) -> None:
        """Make the DNS name answer exactly `urls` (a new list: the server thread reads it)."""
        if self.record == "a":
            server.a[NAME] = [self.hosts[u] for u in urls]
        else:
            server.srv[SRV_NAME] = [(self.hosts[u], int(u.rsplit(":", 1)[1])) for u in urls]
            for url in urls:
                server.a[self.hosts[url]] = ["127.0.0.1"]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def sims(request: pytest.FixtureRequest) -> Iterator[Sims]:
    running = Sims(request.param)
    yield running
    running.stop()


async def poll(check: Callable[[], Any], seconds: float = 10.0) -> Any:
    """`check()`'s first truthy value, polled every 5 ms; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := await asyncio.to_thread(check)):
        assert time.monotonic() < deadline, f"condition not met within {seconds} s"
        await asyncio.sleep(0.005)
    return value


def urls(workers: list[dict[str, Any]]) -> list[str]:
    return sorted(w["url"] for w in workers)


def pool_view(gateway: RunningGateway) -> dict[str, Any]:
    pools: list[dict[str, Any]] = httpx.get(gateway.url + "/admin/workers", timeout=30).json()["pools"]
    return pools[0]


@pytest.mark.parametrize("sims", ["a", "srv"], indirect=True)
async def test_pods_join_and_leave_while_traffic_flows_with_no_failed_request(
        sims: Sims, dns_server: LoopbackDns, start_gateway: Callable[..., RunningGateway]) -> None:
    first, second = sims.start(2), sims.start(3)
    sims.publish(dns_server, [first, second])
    discover = ({"name": NAME, "port": sims.port} if sims.record == "a" else {"name": SRV_NAME, "record": "srv"})
    gateway = start_gateway([{"name": "k3", "engine": "vllm", "max_context_tokens": 8192, "discover": discover,
                              "policy": "round_robin"}],
                            discovery={"nameservers": ["127.0.0.1"], "port": dns_server.port, "interval": 0.2,
                                       "timeout": 1.0},
                            health={"interval": 0.2, "timeout": 1.0})
    await poll(lambda: httpx.get(gateway.url + "/ready").status_code == 200)
    start_view = pool_view(gateway)
    assert urls(start_view["workers"]) == sorted([first, second])
    first_id = next(w["id"] for w in start_view["workers"] if w["url"] == first)
    traffic = Traffic(gateway.url, clients=6, max_tokens=30).start()
    try:
        await traffic.wait_ok(12)

        # A new pod: it joins once probed, then takes its share.
        third = sims.start(4)
        sims.publish(dns_server, [first, second, third])
        joined = await poll(lambda: next((w for w in pool_view(gateway)["workers"]
                                          if w["url"] == third and w["healthy"]), None))
        assert joined["index"] == 2
        await poll(lambda: len(sims.engines[third].records) >= 3)

        # A pod goes away while streams run on it: no new requests; its open streams finish.
        sims.publish(dns_server, [second, third])

        def without_first() -> dict[str, Any] | None:
            view = pool_view(gateway)
            return view if first not in urls(view["workers"]) else None

        removed = await poll(without_first, seconds=10)
        removed_at = time.monotonic()
        await traffic.wait_ok(12)
        records = sims.engines[first].records
        assert [r for r in records if r.received_at > removed_at + 0.2] == [], "a removed worker got new requests"
        assert [r for r in records if r.aborted] == [], "a stream on the removed worker was cut"
        # Streams were open on it when it was removed (the gateway's own count); they ran to the end.
        assert next(w["in_flight"] for w in removed["retiring"] if w["url"] == first) > 0
        assert any(r.finished_at is not None and r.finished_at > removed_at for r in records)
        # Once its streams are done it is forgotten: loops stopped, metric series removed.
        await poll(lambda: not pool_view(gateway)["retiring"])
        metrics = await asyncio.to_thread(httpx.get, gateway.url + "/metrics")
        assert f'worker="{first_id}"' not in metrics.text

        # DNS fails for a while: the last set stays and traffic goes on.
        queries = dns_server.queries
        dns_server.failing = True
        await poll(lambda: dns_server.queries >= queries + 6)
        await traffic.wait_ok(12)
        view = pool_view(gateway)
        assert urls(view["workers"]) == sorted([second, third])
        assert view["discovery"]["error"] is not None
        dns_server.failing = False
        await poll(lambda: pool_view(gateway)["discovery"]["error"] is None)
    finally:
        await traffic.stop()
    assert traffic.failures == []
    assert traffic.ok >= 48
