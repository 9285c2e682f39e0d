"""What the replay compares: a list of layouts, each one way to put a router in front of workers.

A `Layout` has a name (its table row), a kind ("gateway", "peer", ...), why it cannot run here
(None when it can) and a `launch` that starts its processes in a `ProcessGroup` for one load level
and returns where to send the load (`Launched`). `build_layouts` gives the gateway policies, then
the peer routers; another kind (e.g. prefill/decode pools) is one more `Layout` in that list with
its own `launch`.

Gateway runs: one process with N simulated SGLang workers (`loadtest.workers`), then
`python -m gateway.cli serve -c <generated yaml>` (one pool, the policy, its `policy_params`, and
the gateway's time constants divided by the speed-up unless `--no-gateway-time-scale`). Peer runs:
fresh workers and the router with `loadtest.peers.peer_settings`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.peers import Peer, peer_problem, peer_settings, peer_version, routing_counters, start_peer
from loadtest.plan import Level
from loadtest.procs import ProcessGroup, child_env, free_port, python_argv
from loadtest.replay_settings import MAX_CONTEXT_TOKENS, MODEL, SIM_BYTES_PER_TOKEN, Settings, sim_fields
from loadtest.workerstats import WorkerTotals

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 60.0
MIN_SCRAPE_INTERVAL_S = 0.05
"""Scaled load-scrape interval floor, seconds (8 workers x 20 scrapes/s is already real work)."""


@dataclass(frozen=True)
class RunContext:
    """One run's inputs: the replay settings and the load level (speed-up, prefill speed)."""

    settings: Settings
    level: Level


@dataclass
class Launched:
    """A started layout: `base` URL to replay against, the worker URLs (their `/sim/stats`), the
    SimConfig fields the worker host dropped, `details` worth reporting (flags, versions), and
    `after_replay`: called once the replay ended, its answer goes into the details (e.g. the
    router's decision counters). A layout with workers outside the hit-ratio figures (PD decode
    workers) lists them in `side_urls`; `side_figures` turns their totals into `RunResult.pd`."""

    base: str
    worker_urls: list[str]
    dropped: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    after_replay: Callable[[], dict[str, Any]] | None = None
    side_urls: list[str] = field(default_factory=list)
    side_figures: Callable[[list[WorkerTotals]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Layout:
    """One row of the comparison. `problem` is why it is skipped (None = runnable)."""

    name: str
    kind: str
    launch: Callable[[ProcessGroup, RunContext], Launched]
    problem: str | None = None


# --- the gateway's configuration ---------------------------------------------------------------------


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in (nested dicts merged key by key, other values replaced)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gateway_config(port: int, worker_urls: list[str], policy: str, params: dict[str, Any] | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway config of a run: one SGLang pool of the workers with `policy` (and its params),
    with `extra` (top-level gateway settings such as `{"load": {"interval": 0.25}}`) merged in."""
    pool: dict[str, Any] = {
        "name": "replay",
        "engine": "sglang",
        "workers": worker_urls,
        "max_context_tokens": MAX_CONTEXT_TOKENS,
        "default_output_tokens": 1024,
        "spillover": False,
        "policy": policy,
    }
    if params:
        pool["policy_params"] = params
    # drain_delay 0: the gateway is stopped after the replay's last answer with no load balancer to
    # tell, so the default 5 s of `/ready` answering 503 before the listener closes would only be waited.
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning",
              "model": {"name": MODEL, "aliases": []}, "pools": [pool], "health": {"interval": 2.0},
              "shutdown": {"drain_delay": 0}}
    return deep_merge(config, extra or {})


def scaled_gateway_timers(speedup: float) -> dict[str, Any]:
    """Gateway settings whose time constants are divided by `speedup`, so that the replay keeps
    their meaning in trace time: the engine-load scrape interval (a stale load view at 20x is a
    20x staler one) and the affinity TTL. Only settings this gateway's config has are returned."""
    from gateway.config import GatewayConfig  # the gateway under test, as installed in this venv

    fields = GatewayConfig.model_fields
    out: dict[str, Any] = {}
    if "load" in fields and fields["load"].default_factory is not None:
        interval = fields["load"].default_factory().interval
        out["load"] = {"interval": max(MIN_SCRAPE_INTERVAL_S, interval / speedup)}
    if "affinity" in fields and fields["affinity"].default_factory is not None:
        ttl = fields["affinity"].default_factory().ttl_seconds
        out["affinity"] = {"ttl_seconds": max(1, round(ttl / speedup))}
    return out


def gateway_overrides(s: Settings, speedup: float) -> dict[str, Any]:
    """The top-level gateway settings of a run at `speedup`: the scaled timers (unless turned off)
    with `--gateway-extra` merged over them."""
    return deep_merge(scaled_gateway_timers(speedup) if s.gateway_time_scale else {}, s.gateway_extra)


def gateway_env() -> dict[str, str]:
    """The gateway's environment: ours without `KIMI_GATEWAY_*` overrides (the file decides)."""
    return {k: v for k, v in child_env().items() if not k.startswith("KIMI_GATEWAY_")}


def check_policy(policy: str, s: Settings, workdir: Path) -> str | None:
    """None when the gateway's `check-config` accepts a config with `policy`, else its message."""
    path = workdir / f"check-{policy}.yaml"
    urls = [f"http://127.0.0.1:{1 + i}" for i in range(s.workers)]
    config = gateway_config(8000, urls, policy, s.policy_params.get(policy), gateway_overrides(s, s.speedup))
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    try:
        done = subprocess.run(python_argv("gateway.cli", "check-config", str(path)), capture_output=True,
                              text=True, timeout=60, env=gateway_env(), cwd=REPO, check=False)
    except subprocess.TimeoutExpired:
        return "check-config timed out"
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip().splitlines()[-1] if (done.stderr or done.stdout) else "rejected"


# --- processes ------------------------------------------------------------------------------------------


def start_workers(group: ProcessGroup, s: Settings, prefill_tps: float | None, count: int | None = None,
                  sim: dict[str, Any] | None = None, name: str = "workers") -> tuple[list[str], list[str]]:
    """Start a worker host process `name` with `count` workers (default `s.workers`) of SimConfig
    fields `sim` (default `sim_fields(s, prefill_tps)`); returns the worker URLs and the SimConfig
    fields it had to drop."""
    spec_path = group.log_dir / f"{name}-spec.json"
    ports_path = group.log_dir / f"{name}-ports.json"
    spec = {"count": s.workers if count is None else count, "sim": sim_fields(s, prefill_tps) if sim is None else sim}
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    ports_path.unlink(missing_ok=True)
    proc = group.spawn(name, python_argv("loadtest.workers", "--spec", str(spec_path),
                                         "--ports-file", str(ports_path)), env=child_env())
    proc.wait_until(ports_path.exists, STARTUP_TIMEOUT_S, "listening")
    info = json.loads(ports_path.read_text(encoding="utf-8"))
    urls = [f"http://127.0.0.1:{port}" for port in info["ports"]]
    for url in urls:
        proc.wait_http(url + "/health", STARTUP_TIMEOUT_S)
    return urls, list(info.get("dropped", []))


def start_gateway(group: ProcessGroup, urls: list[str], policy: str, s: Settings, speedup: float) -> str:
    """Start `kimi-gateway serve` for one policy; returns its base URL once `/ready` answers 200."""
    port = free_port()
    return launch_gateway(group, gateway_config(port, urls, policy, s.policy_params.get(policy),
                                                gateway_overrides(s, speedup)), port)


def launch_gateway(group: ProcessGroup, config: dict[str, Any], port: int) -> str:
    """Start `kimi-gateway serve` with `config` (listening on `port`); returns its base URL once
    `/ready` answers 200."""
    path = group.log_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = group.spawn("gateway", python_argv("gateway.cli", "serve", "-c", str(path)), env=gateway_env())
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/ready", STARTUP_TIMEOUT_S)
    return base


# --- the layouts ----------------------------------------------------------------------------------------


def gateway_layout(policy: str, problem: str | None = None) -> Layout:
    """The gateway with one routing policy over fresh simulated workers."""

    def launch(group: ProcessGroup, ctx: RunContext) -> Launched:
        s = ctx.settings
        urls, dropped = start_workers(group, s, ctx.level.prefill_tps)
        base = start_gateway(group, urls, policy, s, ctx.level.speedup)
        return Launched(base, urls, dropped, {"gateway overrides": gateway_overrides(s, ctx.level.speedup)})

    return Layout(policy, "gateway", launch, problem)


def peer_layout(peer: Peer) -> Layout:
    """A peer router with one policy over fresh simulated workers, its flags scaled by `peer_settings`."""

    def launch(group: ProcessGroup, ctx: RunContext) -> Launched:
        s = ctx.settings
        sim = {**sim_fields(s, ctx.level.prefill_tps), "engine": peer.spec.worker_engine}
        urls, dropped = start_workers(group, s, ctx.level.prefill_tps, sim=sim)
        settings = peer_settings(peer, ctx.level.speedup, s.kv_capacity_tokens, SIM_BYTES_PER_TOKEN, s.peer_scale)
        base, metrics_url = start_peer(group, urls, peer, settings, STARTUP_TIMEOUT_S)
        return Launched(base, urls, dropped, {"router": peer_version(peer), "flags": settings.mapping},
                        after_replay=lambda: {"router decisions": routing_counters(metrics_url)})

    return Layout(peer.name, "peer", launch, peer_problem(peer))


def build_layouts(s: Settings, workdir: Path) -> list[Layout]:
    """The gateway policies (each checked with `check-config`), then the peers, in that order."""
    layouts = [gateway_layout(policy, check_policy(policy, s, workdir)) for policy in s.policies]
    layouts += [peer_layout(peer) for peer in s.peers]
    return layouts
