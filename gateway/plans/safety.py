"""Production-safety checks of a gateway config: what `check-config` warns about (and `--strict` refuses).

A config can be valid and still unsafe to deploy. Each finding names the config path it is about:

- `host`: listening beyond loopback with auth off, so /v1/* and the admin API (drains) are open
  to the network;
- a `${VAR:-default}` whose VAR is unset (the default is deployed, e.g. a placeholder worker host),
  and any worker or Redis host that is a reserved placeholder name (RFC 2606 / RFC 6761:
  example.com/net/org, .example, .invalid, .test, .localhost);
- `redis_url`: more than one gateway replica (`replicas`) with no Redis or a Redis on this host
  (loopback or unix socket), so affinity, rate limits and drains stay per replica;
- `pools.N.api_key`: a pool that sends no engine credential while other pools do;
- `redis_url`, `pools.N.workers`: plaintext links beyond loopback (`redis://`, `redis+sentinel://`,
  `redis+cluster://`; `http://` workers or DNS discovery), unless `allow_plaintext` names them:
  engine keys, prompts and answers, affinity keys and limits would cross the network unencrypted.
  `rediss://` (`rediss+cluster://`) takes redis-py's TLS options as query parameters, e.g.
  `rediss://redis:6380/0?ssl_ca_certs=/etc/redis-tls/ca.crt&ssl_cert_reqs=required`.

`kimi-gateway check-config` prints them and `serve` logs them at start-up; `--strict` makes either
exit 1 on any (gateway/cli.py).

Also here: `pool_request_seconds`, `longest_request_seconds` and `grace_period_seconds`, what a
deployment gives a gateway pod to stop (Kubernetes `terminationGracePeriodSeconds`), derived from the config's timeouts.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.backends.client import answer_budget
from gateway.config import GatewayConfig
from gateway.config_env import ENV_PREFIX, ENV_REF
from gateway.dispatch.params import TimeoutConfig
from gateway.plans.models import expand_plan_refs
from gateway.redis_client import is_sentinel_url, parse_sentinel_url
from gateway.redis_cluster import is_cluster_url, parse_cluster_url

_PLACEHOLDER = re.compile(r"(^|\.)(example\.(com|net|org)|example|invalid|test|localhost)$", re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    """One production-safety warning: the config path it concerns and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def env_references(tree: Any, path: str = "") -> list[tuple[str, str, str | None]]:
    """Every `${NAME}` / `${NAME:-default}` in a parsed YAML tree as (config path, NAME, default or None)."""
    if isinstance(tree, str):
        return [(path or "(top level)", m.group(1), m.group(2)) for m in ENV_REF.finditer(tree)]
    if isinstance(tree, list):
        return [ref for i, v in enumerate(tree) for ref in env_references(v, f"{path}.{i}" if path else str(i))]
    if isinstance(tree, dict):
        return [ref for k, v in tree.items() for ref in env_references(v, f"{path}.{k}" if path else str(k))]
    return []


def read_tree(path: str | Path) -> dict[str, Any]:
    """A config file's YAML with its plan references expanded, before `${VAR}` interpolation."""
    path = Path(path)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return expand_plan_refs(data, path.parent) if isinstance(data, dict) else {}


def _is_local(host: str | None) -> bool:
    if host is None or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _redis_host(url: str | None) -> str | None:
    """The host of a Redis URL; of a `redis+sentinel://` one, the first sentinel's; of a
    `redis+cluster://` one, the first node's."""
    if url is None:
        return None
    if is_cluster_url(url):
        return parse_cluster_url(url).nodes[0][0]
    return parse_sentinel_url(url).sentinels[0][0] if is_sentinel_url(url) else urlsplit(url).hostname


_PLAINTEXT_REDIS = ("redis", "redis+sentinel", "redis+cluster")


def _redis_hosts(url: str) -> list[str]:
    """Every host a Redis URL names: the sentinels' or cluster nodes' for those schemes."""
    if is_cluster_url(url):
        return [host for host, _ in parse_cluster_url(url).nodes]
    if is_sentinel_url(url):
        return [host for host, _ in parse_sentinel_url(url).sentinels]
    host = urlsplit(url).hostname
    return [host] if host else []


def plaintext_findings(config: GatewayConfig) -> list[Finding]:
    """Findings for unencrypted links beyond loopback that `config.allow_plaintext` does not accept:
    a plaintext Redis URL (one finding naming its remote hosts, never its credentials) and, per
    pool, its `http://` workers (configured, PD roles, or DNS discovery with `scheme: http`)."""
    findings: list[Finding] = []
    url = config.redis_url
    if url is not None and "redis" not in config.allow_plaintext:
        scheme = url.split("://", 1)[0].lower()
        remote = [host for host in _redis_hosts(url) if not _is_local(host)]
        if scheme in _PLAINTEXT_REDIS and remote:
            tls = "rediss+cluster://" if scheme == "redis+cluster" else "rediss://"
            findings.append(Finding("redis_url", f"plaintext {scheme}:// to {', '.join(remote)}: affinity keys, "
                                                 f"limits and any password cross the network unencrypted; use "
                                                 f"{tls} (TLS options as query parameters, e.g. ?ssl_ca_certs="
                                                 "/path/ca.crt) or accept it with allow_plaintext: [redis]"))
    if "engines" in config.allow_plaintext:
        return findings
    for index, pool in enumerate(config.pools):
        urls = [url for url, _, _ in pool.pd_workers()]
        hosts = sorted({urlsplit(u).hostname or "" for u in urls
                        if urlsplit(u).scheme.lower() == "http" and not _is_local(urlsplit(u).hostname)})
        if pool.discover is not None and pool.discover.scheme == "http":
            hosts.append(f"{pool.discover.name} (DNS discovery)")
        if hosts:
            findings.append(Finding(f"pools.{index}.workers", f"pool {pool.name} reaches {', '.join(hosts)} over "
                                    "plaintext http://: the engine key and every prompt and answer cross the "
                                    "network unencrypted; use https:// or accept it with allow_plaintext: [engines]"))
    return findings


def production_findings(tree: Mapping[str, Any], config: GatewayConfig,
                        environ: Mapping[str, str]) -> list[Finding]:
    """The safety findings of `config`, loaded from `tree` (read_tree) with `environ`; empty when safe."""
    findings: list[Finding] = []
    if not _is_local(config.host) and not config.auth.enabled:
        findings.append(Finding("host", f"listens on {config.host} (beyond loopback) with auth off: /v1/* and the "
                                        "admin API (drain, undrain) are open to the network; enable auth"))
    for path, name, default in env_references(tree):
        overridden = f"{ENV_PREFIX}{path.split('.')[0].upper()}" in environ
        if name not in environ and default is not None and not overridden:
            findings.append(Finding(path, f"${{{name}}} is not set: falls back to {default!r}"))
    for index, pool in enumerate(config.pools):
        urls = [(f"pools.{index}.workers.{w}", url) for w, url in enumerate(pool.workers)]
        if pool.disaggregation is not None:  # a PD pool's workers
            urls += [(f"pools.{index}.disaggregation.prefill.{w}.url", p.url)
                     for w, p in enumerate(pool.disaggregation.prefill)]
            urls += [(f"pools.{index}.disaggregation.decode.{w}", url)
                     for w, url in enumerate(pool.disaggregation.decode)]
        for path, url in urls:
            host = urlsplit(url).hostname or ""
            if _PLACEHOLDER.search(host):
                findings.append(Finding(path, f"{url} is a placeholder host"))
    redis_host = _redis_host(config.redis_url)
    if redis_host and _PLACEHOLDER.search(redis_host) and redis_host.lower() != "localhost":
        findings.append(Finding("redis_url", f"{redis_host} is a placeholder host"))
    if config.replicas > 1:
        local = config.redis_url is None or config.redis_url.lower().startswith("unix:") or _is_local(redis_host)
        if local:
            where = "not set" if config.redis_url is None else f"on this host ({config.redis_url})"
            findings.append(Finding("redis_url", f"{config.replicas} gateway replicas but Redis is {where}: affinity, "
                                                 "rate limits and drains would stay per replica"))
    keyed = [p.name for p in config.pools if p.api_key is not None]
    if keyed:
        for index, pool in enumerate(config.pools):
            if pool.api_key is None:
                findings.append(Finding(f"pools.{index}.api_key", f"pool {pool.name} sends no engine credential "
                                                                  f"while {', '.join(keyed)} do"))
    return findings + plaintext_findings(config)


GRACE_MARGIN_S = 10
"""Seconds `grace_period_seconds` adds for the process's own exit (closing clients, flushing logs)."""


def pool_request_seconds(timeouts: TimeoutConfig, context: int) -> float:
    """Seconds the longest request the timeouts allow may run on a pool of `context` tokens C,
    answered non-streaming (gateway/backends/client.py `answer_budget`). The budget is linear in the
    prompt p with an output of at most C - p (the engines generate to the end of the context when
    the request sets no limit, and shorten a larger one: `gateway.dispatch.attempt.engine_output`),
    so the longest is at p = 0 or p = C:

        max(first_byte_base + generation + generation_per_token * C,
            first_byte_base + first_byte_per_1k_tokens * C / 1000 + generation)

    capped at `timeouts.total` when set. A stream's first content has the same prefill allowance;
    what it generates after that is bounded by `timeouts.total` alone (each gap by `read`), so set
    `total` to bound long generations too. The shipped production config sets `total: 3600`."""
    longest = max(answer_budget(timeouts, 0, context), answer_budget(timeouts, context, 0))
    return longest if timeouts.total is None else min(longest, timeouts.total)


def longest_request_seconds(config: GatewayConfig) -> float:
    """`pool_request_seconds` of the pool with the most: seconds the longest request the timeouts
    allow may run, over every pool."""
    return max(pool_request_seconds(config.timeouts, pool.max_context_tokens) for pool in config.pools)


def grace_period_seconds(config: GatewayConfig, pre_stop_s: float = 0.0) -> int:
    """Kubernetes `terminationGracePeriodSeconds` for a gateway pod running `config`, whole seconds:

        ceil(pre_stop_s + shutdown.drain_delay + max(shutdown.grace_period, longest_request_seconds) + 10)

    `pre_stop_s` is a preStop hook's sleep before SIGTERM (deploy/kubernetes/base/gateway.yaml: 5).
    After SIGTERM the gateway serves `drain_delay` seconds (`/ready` 503), closes its listener, and
    lets in-flight requests run `shutdown.grace_period` seconds more; the longest request the
    timeouts allow (`longest_request_seconds`) may have started just before the listener closed.
    The pod waits for the longer of the two, plus `GRACE_MARGIN_S` for the exit; Kubernetes stops
    waiting as soon as the gateway exits, so an idle pod stops at once. Give `shutdown.grace_period`
    at least `longest_request_seconds(config)` too, or the gateway itself ends such requests (a
    `shutting_down` error) before the pod's grace runs out."""
    shutdown = config.shutdown
    window = max(shutdown.grace_period, longest_request_seconds(config))
    return math.ceil(pre_stop_s + shutdown.drain_delay + window + GRACE_MARGIN_S)
