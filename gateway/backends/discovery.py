"""Workers from DNS: a pool's `discover:` name (e.g. a Kubernetes headless Service), re-resolved.

Every `discovery.interval` seconds each discovering pool's name is resolved (its own loop, with
dnspython's asyncio resolver, asking `discovery.nameservers` or the system's) and the pool's worker
set becomes its static `workers` plus one worker per answer (WorkerRegistry.set_discovered):

- `record: a`: the name's A and AAAA records, each address on the configured `port`. A headless
  Service answers one record per ready pod. Either question failing fails the round.
- `record: srv`: the name's SRV records (RFC 2782), each target host on its own port; the target's
  addresses come from the answer's additional section when the server put them there (CoreDNS
  does for headless Services), else from A/AAAA queries of the target.

A new worker joins unhealthy and takes requests once its first probe passes; a worker no longer in
the answer stops getting new requests while its streams finish (registry docstring). A failed
resolution (timeout, SERVFAIL, no nameserver) and an empty answer (NXDOMAIN, no records) keep the
last set: a DNS blip must not empty a pool, and a pod that is really gone fails its probes anyway.
The first failure of a run is logged as a warning, the recovery as info.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterable

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from gateway.backends.params import DiscoverConfig, DiscoveryConfig
from gateway.backends.periodic import PeriodicEach
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry

log = logging.getLogger("gateway.discovery")


class DiscoveryFailed(Exception):
    """A resolution that gave no usable answer; the message says why."""


def build_resolver(config: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    """dnspython's asyncio resolver for `config`: its nameservers and port, or the system's
    (/etc/resolv.conf); `timeout` seconds per resolution; no cache (each round asks again)."""
    resolver = dns.asyncresolver.Resolver(configure=not config.nameservers)
    if config.nameservers:
        resolver.nameservers = list(config.nameservers)
        resolver.port = config.port
    resolver.lifetime = config.timeout
    resolver.cache = None
    return resolver


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> list[str]:
    """The A and AAAA addresses of `name` (either may be missing: NOERROR without records or
    NXDOMAIN). Raises DiscoveryFailed when either question failed (timeout, SERVFAIL), even if the
    other answered: a dual-stack name answering only AAAA in a blip would otherwise lose its IPv4
    workers."""
    found: list[str] = []
    errors: list[str] = []
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as exc:
            errors.append(f"{rdtype}: {exc}")
            continue
        found += [rr.address for rr in answer]
    if errors:
        raise DiscoveryFailed(f"{name}: " + "; ".join(errors))
    return found


async def resolve_workers(resolver: dns.asyncresolver.Resolver, spec: DiscoverConfig) -> list[str]:
    """Worker base URLs `spec` resolves to now, sorted. Raises DiscoveryFailed when the name has no
    usable answer (the caller keeps the last set)."""
    if spec.record == "a":
        assert spec.port is not None  # DiscoverConfig's rule
        addresses = await _addresses(resolver, spec.name)
        urls = {_url(spec.scheme, a, spec.port) for a in addresses}
    else:
        try:
            answer = await resolver.resolve(spec.name, "SRV", search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            answer = None
        except dns.exception.DNSException as exc:
            raise DiscoveryFailed(f"{spec.name} SRV: {exc}") from None
        urls = set()
        if answer is not None:
            glue: dict[str, list[str]] = {}
            for rrset in answer.response.additional:
                if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    glue.setdefault(rrset.name.to_text(), []).extend(rr.address for rr in rrset)
            for rr in answer:
                target = rr.target.to_text()
                glued = glue.get(target)
                addresses = glued if glued is not None else await _addresses(resolver, target)
                urls |= {_url(spec.scheme, a, rr.port) for a in addresses}
    if not urls:
        raise DiscoveryFailed(f"{spec.name} ({spec.record.upper()}) has no records")
    return sorted(urls)


class DnsDiscovery:
    """One loop per pool with `discover:`; each round resolves the name and updates the registry.

    `status[pool]` tells the admin API how the last resolution went: `{"name", "record", "workers"
    (URLs found), "resolved_unix" (last success, seconds), "error" (None after a success)}`.
    """

    def __init__(self, registry: WorkerRegistry, config: DiscoveryConfig, pools: Iterable[PoolConfig]) -> None:
        self.registry = registry
        self.config = config
        self.resolver = build_resolver(config)
        self.specs: dict[str, DiscoverConfig] = {}
        self.status: dict[str, dict[str, object]] = {}
        self.loop: PeriodicEach[str] = PeriodicEach("dns discovery", config.interval, [], self.refresh)
        self.set_pools(config, pools)

    def set_pools(self, config: DiscoveryConfig, pools: Iterable[PoolConfig]) -> None:
        """At start-up and on a reload: loops for pools that discover, restarted (a round at once)
        for a pool whose `discover` changed; a new resolver when `discovery:` changed."""
        if config != self.config:
            self.config = config
            self.resolver = build_resolver(config)
            self.loop.interval = config.interval
        specs = {p.name: p.discover for p in pools if p.discover is not None}
        for name in list(self.specs):
            if specs.get(name) != self.specs[name]:
                self.loop.remove(name)
                self.status.pop(name, None)
        for name, spec in specs.items():
            if self.specs.get(name) != spec:
                self.loop.add(name)
        self.specs = specs

    async def refresh(self, pool: str) -> bool:
        """Resolve `pool`'s name once and apply the answer; False (last set kept) when it failed."""
        spec = self.specs.get(pool)
        if spec is None:
            return False
        status = self.status.setdefault(pool, {"name": spec.name, "record": spec.record, "workers": [],
                                               "resolved_unix": None, "error": None})
        try:
            urls = await resolve_workers(self.resolver, spec)
        except DiscoveryFailed as exc:
            if status["error"] is None:
                log.warning("discovery of pool %s failed: %s (keeping its %d discovered workers)", pool, exc,
                            len(self.registry.discovered.get(pool, [])))
            status["error"] = str(exc)
            return False
        if self.specs.get(pool) != spec:  # a reload changed it while this round waited
            return False
        if status["error"] is not None:
            log.info("discovery of pool %s works again", pool)
        status.update(workers=urls, resolved_unix=round(time.time(), 3), error=None)
        self.registry.set_discovered(pool, urls)
        return True

    def start(self) -> None:
        """Start the loops; each resolves its name at once."""
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
