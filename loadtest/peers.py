"""Peer routers of the replay (SGLang's and vLLM's Rust routers) and how their settings are scaled.

A peer is named `ROUTER:POLICY` (`sglang-router:cache_aware`, `vllm-router:cache_aware`, ...; a
bare policy means SGLang's router). `peer_settings` maps the replay's scaling onto each router's
flags the way `loadtest.layouts` scales the gateway's own timers, so both sides keep the meaning of
their settings in trace time and relative to the simulated workers (sglang-router 0.3.2 /
vllm-router 0.1.17):

- `--eviction-interval-secs` (defaults 60 s / 120 s): max(1, round(default / speed-up)). The
  period of the LRU sweep of the router's prefix tree, kept in trace time; whole seconds (the
  routers take an integer and 0 turns eviction off).
- `--max-tree-size` (defaults 2^26 / 2^25 characters): the worker's KV capacity x the
  simulator's bytes per token (4). Both routers trim each worker's ("tenant's") part of the tree
  to this many characters of request text at every sweep (sglang-router 0.3.2 logs "Used size per
  tenant"; vllm-router's help says "Per-worker character budget"); the replay's texts are ASCII,
  so that is what one worker's KV cache holds.
- `--balance-abs-threshold` 64, `--balance-rel-threshold` 1.5: unchanged, they count requests in
  flight at the router (no time unit).
- health-check interval, circuit breaker, retries, queue and request timeouts: unchanged, they act
  only on failures or overload the replay does not inject.

The defaults are read from the installed package (`<module>.router_args.RouterArgs`), falling back
to the versions above. `vllm-router:kv_aware` can start but is not a fair peer here: see
`KV_AWARE_NOTE`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.procs import ManagedProcess, ProcessGroup, child_env, free_port, python_argv


@dataclass(frozen=True)
class RouterSpec:
    """One peer router package: import name, PyPI distribution, log level word, the policies the
    replay may run, and its defaults for the scaled flags (used when `RouterArgs` is missing)."""

    module: str
    dist: str
    log_level: str
    policies: tuple[str, ...]
    eviction_interval_s: int
    max_tree_chars: int
    worker_engine: str = "sglang"
    """The simulated workers' engine dialect in its runs (`SimConfig.engine`): the engine the router
    is built for. vllm-router's `cache_aware` needs vLLM's render routes (`gateway.sim.render`)."""


ROUTERS: dict[str, RouterSpec] = {
    "sglang-router": RouterSpec("sglang_router", "sglang-router", "warn",
                                ("cache_aware", "round_robin", "random", "power_of_two"), 60, 2**26),
    "vllm-router": RouterSpec("vllm_router", "vllm-router", "warning",
                              ("cache_aware", "kv_aware", "round_robin", "random", "power_of_two",
                               "consistent_hash"), 120, 2**25, worker_engine="vllm"),
}
"""Defaults as printed by `--help` of sglang-router 0.3.2 and vllm-router 0.1.17."""

DEFAULT_ROUTER = "sglang-router"

KV_AWARE_NOTE = ("vllm-router kv_aware needs the engine's KV events (ZMQ, `--kv-event-source` or the "
                 "worker's /kv_event_sources) and token ids (the worker's tokenizer via /get_server_info); "
                 "against the simulator, which has neither, vllm-router 0.1.17 logs every decision as "
                 "outcome=\"missing_tokens\" with 0 credited prefix tokens: it routes by load alone")
"""Why `vllm-router:kv_aware` is no cache-aware peer here (observed with a debug log, 2026-11-30)."""


@dataclass(frozen=True)
class Peer:
    """A peer layout: `router` (a key of ROUTERS) running `policy`."""

    router: str
    policy: str

    @property
    def name(self) -> str:
        return f"{self.router}:{self.policy}"

    @property
    def spec(self) -> RouterSpec:
        return ROUTERS[self.router]


def parse_peer(value: str) -> Peer:
    """`ROUTER:POLICY` or a bare POLICY (SGLang's router). Raises ValueError for an unknown router
    or a policy that router does not have."""
    router, sep, policy = value.partition(":")
    if not sep:
        router, policy = DEFAULT_ROUTER, value
    if router not in ROUTERS:
        raise ValueError(f"unknown peer router {router!r} (known: {', '.join(ROUTERS)})")
    if policy not in ROUTERS[router].policies:
        raise ValueError(f"{router} has no policy {policy!r} (known: {', '.join(ROUTERS[router].policies)})")
    return Peer(router, policy)


def router_defaults(spec: RouterSpec) -> tuple[int, int]:
    """(eviction interval s, max tree size chars) defaults of the installed router, else the spec's."""
    try:
        args = importlib.import_module(f"{spec.module}.router_args").RouterArgs
        return int(args.eviction_interval_secs), int(args.max_tree_size)
    except (ImportError, AttributeError, TypeError, ValueError):
        return spec.eviction_interval_s, spec.max_tree_chars


@dataclass(frozen=True)
class PeerSettings:
    """The scaled flags of one peer run and how each was derived (for the report)."""

    flags: list[str]
    mapping: dict[str, str]


def peer_settings(peer: Peer, speedup: float, kv_capacity_tokens: int, bytes_per_token: float,
                  scale: bool = True, defaults: tuple[int, int] | None = None) -> PeerSettings:
    """The router flags that keep its settings' meaning at `speedup` over workers with
    `kv_capacity_tokens` of KV cache each (see the module docstring). `scale=False` keeps the
    router's defaults. `defaults` overrides `router_defaults` (tests)."""
    eviction_default, tree_default = defaults or router_defaults(peer.spec)
    if not scale:
        return PeerSettings([], {"--eviction-interval-secs": f"{eviction_default} (default, not scaled)",
                                 "--max-tree-size": f"{tree_default} (default, not scaled)"})
    eviction = max(1, round(eviction_default / speedup))
    tree = max(1, round(kv_capacity_tokens * bytes_per_token))
    return PeerSettings(
        ["--eviction-interval-secs", str(eviction), "--max-tree-size", str(tree)],
        {"--eviction-interval-secs": f"{eviction} (default {eviction_default} s / speed-up {speedup:g})",
         "--max-tree-size": f"{tree} (worker KV {kv_capacity_tokens} tokens x {bytes_per_token:g} chars; "
                            f"default {tree_default})"})


def peer_problem(peer: Peer) -> str | None:
    """None when the router's package is importable, else why the peer is skipped."""
    try:
        importlib.import_module(peer.spec.module)
    except ImportError:
        return f"{peer.spec.dist} is not installed (.venv/bin/pip install -e '.[bench]')"
    return None


def peer_version(peer: Peer) -> str:
    """`<dist> <version>` of the installed router, or `<dist> (unknown version)`."""
    try:
        return f"{peer.spec.dist} {importlib.metadata.version(peer.spec.dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{peer.spec.dist} (unknown version)"


def _lists_workers(count: int) -> Callable[[httpx.Response], bool]:
    """A readiness test: the router's `GET /workers` lists at least `count` workers."""

    def accept(response: httpx.Response) -> bool:
        try:
            body: Any = response.json()
        except ValueError:
            return True  # an older router without a JSON list: /health already said yes
        listed = body.get("workers") if isinstance(body, dict) else body
        return not isinstance(listed, list) or len(listed) >= count
    return accept


def start_peer(group: ProcessGroup, urls: list[str], peer: Peer, settings: PeerSettings,
               timeout_s: float) -> tuple[str, str]:
    """Start the router over the workers with the scaled flags; returns its base URL (once it lists
    every worker) and its Prometheus URL. Offline: no model or tokenizer path, `HF_HUB_OFFLINE=1`."""
    return start_router(group, peer, ["--worker-urls", *urls, "--policy", peer.policy], len(urls), settings.flags,
                        timeout_s)


def start_router(group: ProcessGroup, peer: Peer, worker_args: list[str], workers: int, flags: list[str],
                 timeout_s: float) -> tuple[str, str]:
    """Start `peer`'s router with `worker_args` (its workers and policies, e.g. a PD mode's) and
    `flags` on free ports; returns its base URL once it lists `workers` workers, and its
    Prometheus URL."""
    port, metrics_port = free_port(), free_port()
    argv = python_argv(f"{peer.spec.module}.launch_router", *worker_args,
                       "--host", "127.0.0.1", "--port", str(port), "--log-level", peer.spec.log_level,
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *flags)
    proc: ManagedProcess = group.spawn("router", argv, env=child_env())
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/health", timeout_s)
    proc.wait_http(base + "/workers", timeout_s, accept=_lists_workers(workers))
    return base, f"http://127.0.0.1:{metrics_port}/metrics"


DECISION_MARKERS = ("decision", "cache_hit", "cache_miss", "load_balancing")
"""Substrings of the routers' Prometheus series that say how they routed (e.g. vllm-router's
`vllm_router_prefix_routing_decisions_total{outcome=...}`, SGLang's cache hit/miss counters)."""


def routing_counters(metrics_url: str) -> list[str]:
    """The router's routing-decision series (`name{labels} value` lines, per-worker series left
    out); empty when the endpoint does not answer."""
    try:
        response = httpx.get(metrics_url, timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return []
    return [line for line in response.text.splitlines()
            if not line.startswith("#") and any(m in line for m in DECISION_MARKERS) and "worker=" not in line]
