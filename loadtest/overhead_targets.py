"""The processes of the overhead benchmark: the fake engine, the gateway (variants) and the peers.

Every process is a child in a `ProcessGroup` (stopped at the end, also on errors) and is pinned to
CPU cores by starting it under `taskset -c CORES` (all its threads inherit the mask; Rust routers
size their thread pools from it). A `Target` is what the load generator talks to: "direct" is the
fake engine itself; the gateway runs as `python -m gateway.cli serve -c <generated yaml>` (the
`kimi-gateway serve` entry point) with one pool of one vLLM-kind worker, the fake engine. Peers:
vLLM's router and SGLang's router (Rust; `cache_aware`, their default policy, no model or
tokenizer path, `HF_HUB_OFFLINE=1`) and LiteLLM's proxy (one `openai/kimi-k3` model with
`api_base` = the fake engine; no database, a master key, the local model cost map, logs at ERROR).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.procs import ManagedProcess, ProcessGroup, child_env, free_port, python_argv

REPO = Path(__file__).resolve().parent.parent
MODEL = "kimi-k3"
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 90.0
GATEWAY_MAX_CONTEXT = 1_048_576
"""Tokens: the gateway estimates a 1 MiB prompt at ~315K tokens; the pool must take it."""
REDIS_URL = "redis://127.0.0.1:6379/0"
MASTER_KEY = "sk-overhead-bench-not-a-secret-0123456789"
"""LiteLLM's proxy refuses to start without a master key; the load client sends it to every target
as `Authorization: Bearer` (the gateway with auth off and the Rust routers ignore it; `gateway+prod`
has it as its one key)."""

PEERS: dict[str, tuple[str, str]] = {
    "vllm-router": ("vllm_router", "vllm-router"),
    "sglang-router": ("sglang_router", "sglang-router"),
    "litellm": ("litellm", "litellm"),
}
"""Peer name -> (import name, PyPI distribution)."""


@dataclass
class Target:
    """An endpoint under test. `proc` is None for "direct" (the engine itself, no router)."""

    name: str
    kind: str  # direct | gateway | peer
    port: int
    proc: ManagedProcess | None = None
    version: str = ""
    cores: str = ""
    notes: list[str] = field(default_factory=list)
    cleanup: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


@dataclass(frozen=True)
class Pinning:
    """Which cores the routers and the engine + load generator get ("" = no pinning)."""

    router: str = ""
    engine: str = ""

    def argv(self, cores: str, argv: list[str]) -> list[str]:
        return ["taskset", "-c", cores, *argv] if cores else argv

    def describe(self) -> str:
        if not self.router:
            return "not pinned (fewer than 2 cores, no taskset, or --no-pin)"
        return (f"router under test on core {self.router} (`taskset -c {self.router}`); load generator "
                f"(this process, os.sched_setaffinity) and fake engine on core {self.engine}")


def plan_pinning(enabled: bool) -> Pinning:
    """Router on core 0, everything else on core 1, when there are 2+ usable cores and taskset."""
    import os

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not enabled or len(cores) < 2 or shutil.which("taskset") is None:
        return Pinning()
    return Pinning(router=str(cores[0]), engine=str(cores[1]))


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_missing(name: str) -> str | None:
    """None when the peer's package is installed, else why it is skipped."""
    module, dist = PEERS[name]
    if importlib.util.find_spec(module) is None:
        return f"{dist} is not installed (.venv/bin/pip install -e '.[bench]')"
    return None


def gateway_version() -> str:
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=REPO, timeout=10, check=False)
        described = done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        described = ""
    return f"kimi-gateway {described or 'unknown'}"


def gateway_process_flag() -> str | None:
    """The `kimi-gateway serve` option for several serving processes (`--processes` or `--workers`),
    or None when it has none."""
    try:
        done = subprocess.run(python_argv("gateway.cli", "serve", "--help"), capture_output=True, text=True,
                              cwd=REPO, timeout=60, check=False, env=child_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((flag for flag in ("--processes", "--workers") if flag in done.stdout), None)


def start_stub(group: ProcessGroup, name: str, pin: Pinning, chunks: int, chunk_delay: float = 0.0,
                 procs: int = 1) -> Target:
    """The fake engine (`loadtest.stub_upstream`) on a free port, once `/health` answers."""
    port = free_port()
    argv = python_argv("loadtest.stub_upstream", "--port", str(port), "--chunks", str(chunks),
                       "--chunk-delay", str(chunk_delay), "--procs", str(procs))
    proc = group.spawn(name, pin.argv(pin.engine, argv), env=child_env())
    target = Target(name, "direct", port, proc, version=f"fake engine, {chunks} chunks"
                    + (f", {chunk_delay * 1000:g} ms apart" if chunk_delay else ", no delay"), cores=pin.engine)
    proc.wait_http(target.url + "/health", STARTUP_TIMEOUT_S)
    return target


PROD_LIMIT = 1_000_000_000
"""The production target's per-key requests and tokens per minute: counted, never reached."""
PROD_REDIS_TIMEOUT_S = 0.5
"""The production target's `affinity.lookup_timeout` and `auth.redis_timeout` (defaults 0.02 and
0.05 s): on this loaded 2-core machine, with the gateway's core saturated, a few calls a thousand
missed the defaults, and each opened its store's breaker for a second, so most requests of a
run made no lookup and no rate-limit check. The figure wanted is the CPU of making every call."""


FLOW_CONTROL = {"enabled": True, "max_waiting": 1_000_000, "max_prefill_tokens": None}
"""The pool's flow control with `--flow-control`: on, but never saturated (the fake engine exports no
load metrics, so only the gateway's own not-started requests would count): the figure is the cost
of its bookkeeping on every request (a flow, an admission, a not-started ticket), not of holding."""


def gateway_config(port: int, engine_url: str, log_level: str, redis_prefix: str | None,
                   auth_prefix: str | None = None, flow: bool = False) -> dict[str, Any]:
    """One pool of one vLLM-kind worker; everything else the gateway's defaults. `redis_prefix`:
    affinity in Redis under that key prefix; `auth_prefix` (the production shape, with Redis):
    auth on with one `user` key, `MASTER_KEY` (the load client sends it), whose
    `requests_per_minute` and `tokens_per_minute` (`PROD_LIMIT`) are counted in Redis under that
    prefix and never refuse; both stores' Redis timeouts `PROD_REDIS_TIMEOUT_S`. `flow`: the pool's
    flow control on (`FLOW_CONTROL`)."""
    config: dict[str, Any] = {
        "host": HOST, "port": port, "log_level": log_level,
        "model": {"name": MODEL, "aliases": []},
        "pools": [{"name": "bench", "engine": "vllm", "workers": [engine_url],
                   "max_context_tokens": GATEWAY_MAX_CONTEXT}],
    }
    if flow:
        config["pools"][0]["flow_control"] = dict(FLOW_CONTROL)
    if redis_prefix is not None:
        config["redis_url"] = REDIS_URL
        config["affinity"] = {"key_prefix": redis_prefix}
    if auth_prefix is not None:
        config["affinity"]["lookup_timeout"] = PROD_REDIS_TIMEOUT_S
        config["auth"] = {"enabled": True, "key_prefix": auth_prefix, "redis_timeout": PROD_REDIS_TIMEOUT_S, "keys": [{
            "name": "bench", "sha256": hashlib.sha256(MASTER_KEY.encode()).hexdigest(), "scopes": ["user"],
            "requests_per_minute": PROD_LIMIT, "tokens_per_minute": PROD_LIMIT}]}
    return config


def gateway_env() -> dict[str, str]:
    """Our environment without `KIMI_GATEWAY_*` overrides: the generated file decides."""
    return {k: v for k, v in child_env().items() if not k.startswith("KIMI_GATEWAY_")}


def start_gateway(group: ProcessGroup, name: str, engine: Target, pin: Pinning, log_level: str,
                  redis: bool = False, processes: tuple[str, int] | None = None, cores: str | None = None,
                  prod: bool = False, flow: bool = False) -> Target:
    """`kimi-gateway serve -c <yaml>` in front of `engine`, once `/ready` answers 200.
    `processes`: (the serve option, how many) for several serving processes; `prod`: the
    production shape (Redis affinity, auth on, per-key limits in Redis: `gateway_config`); `flow`:
    its pool's flow control on, never saturated (`FLOW_CONTROL`)."""
    port = free_port()
    redis = redis or prod
    prefix = f"kgw:ovh:{uuid.uuid4().hex[:12]}" if redis else None
    auth_prefix = f"kgw:ovhrl:{uuid.uuid4().hex[:12]}" if prod else None
    path = group.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(gateway_config(port, engine.url, log_level, prefix, auth_prefix, flow)),
                    encoding="utf-8")
    argv = python_argv("gateway.cli", "serve", "-c", str(path))
    if processes is not None:
        argv += [processes[0], str(processes[1])]
    use = pin.router if cores is None else cores
    proc = group.spawn(name, pin.argv(use, argv), env=gateway_env())
    target = Target(name, "gateway", port, proc, version=gateway_version(), cores=use)
    if flow:
        target.notes.append("flow control on, never saturated (max_waiting 1,000,000, no prefill bound)")
    if prefix is not None:
        target.cleanup["redis_prefixes"] = [p for p in (prefix, auth_prefix) if p is not None]
        target.notes.append(f"affinity store in Redis at {REDIS_URL}, key prefix {prefix} (deleted afterwards)")
    if auth_prefix is not None:
        target.notes.append(f"auth on, one key with requests_per_minute and tokens_per_minute {PROD_LIMIT:,} "
                            f"(never refused), counted in Redis under {auth_prefix} (deleted afterwards); both stores' "
                            f"Redis timeouts {PROD_REDIS_TIMEOUT_S:g} s")
    proc.wait_http(target.url + "/ready", STARTUP_TIMEOUT_S)
    return target


def _lists_workers(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return True
    listed = body.get("workers") if isinstance(body, dict) else body
    return not isinstance(listed, list) or len(listed) >= 1


def start_rust_router(group: ProcessGroup, name: str, engine: Target, pin: Pinning) -> Target:
    """vLLM's or SGLang's router (`cache_aware`) over the engine, once it lists the worker."""
    module, dist = PEERS[name]
    port, metrics_port = free_port(), free_port()
    log_level = "warning" if name == "vllm-router" else "warn"
    argv = python_argv(f"{module}.launch_router", "--worker-urls", engine.url, "--policy", "cache_aware",
                       "--host", HOST, "--port", str(port), "--log-level", log_level,
                       "--prometheus-host", HOST, "--prometheus-port", str(metrics_port))
    proc = group.spawn(name, pin.argv(pin.router, argv), env=child_env())
    target = Target(name, "peer", port, proc, version=f"{dist} {dist_version(dist)}", cores=pin.router)
    proc.wait_http(target.url + "/health", STARTUP_TIMEOUT_S)
    proc.wait_http(target.url + "/workers", STARTUP_TIMEOUT_S, accept=_lists_workers)
    return target


def start_litellm(group: ProcessGroup, engine: Target, pin: Pinning) -> Target:
    """LiteLLM's proxy with a config listing the fake engine as `openai/kimi-k3`."""
    port = free_port()
    config = {
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": engine.url + "/v1", "api_key": "unused"}}],
        "litellm_settings": {"set_verbose": False, "request_timeout": 120},
        "general_settings": {},
    }
    path = group.log_dir / "litellm.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = child_env({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
                     "LITELLM_MASTER_KEY": MASTER_KEY})
    for name in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL"):
        env.pop(name, None)
    argv = [str(Path(sys.executable).with_name("litellm")), "--config", str(path), "--host", HOST,
            "--port", str(port), "--num_workers", "1"]
    proc = group.spawn("litellm", pin.argv(pin.router, argv), env=env)
    target = Target("litellm", "peer", port, proc, version=f"litellm {dist_version('litellm')}", cores=pin.router)
    target.notes.append("no database, a master key (it will not start without one), "
                        "LITELLM_LOCAL_MODEL_COST_MAP=True, LITELLM_LOG=ERROR, 1 uvicorn worker")
    proc.wait_http(target.url + "/health/liveliness", STARTUP_TIMEOUT_S)
    return target


def delete_redis_prefix(prefix: str) -> int:
    """Delete the benchmark's affinity keys; returns how many (0 when Redis is unreachable)."""
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a gateway dependency
        return 0
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.delete(*batch))
                batch = []
        if batch:
            deleted += int(client.delete(*batch))
    except redis.RedisError:
        return deleted
    finally:
        client.close()
    return deleted


def redis_available() -> bool:
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure means: no Redis variant
        return False


REDIS_OUTCOME_METRICS = ("kimi_gateway_affinity_lookups_total", "kimi_gateway_redis_errors_total",
                         "kimi_gateway_rate_limit_unavailable_total")


def redis_outcomes(target: Target) -> dict[str, float]:
    """What a gateway's Redis calls came to so far, from its `/metrics`: affinity lookups by result
    (`hit`, `miss`, `error`, `skipped`: the breaker was open), Redis errors by op, rate-limit checks
    Redis did not answer. A run whose lookups were mostly skipped did not pay for them: its CPU per
    request is then not the production path's. Empty when the scrape fails."""
    try:
        text = httpx.get(target.url + "/metrics", timeout=5.0, trust_env=False).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in REDIS_OUTCOME_METRICS or "}" not in rest:
            continue
        labels, _, value = rest.partition("}")
        label = ",".join(part.split("=", 1)[1].strip('"') for part in labels.split(",")
                         if part.split("=", 1)[0] in ("result", "op", "action"))
        out[f"{name.removeprefix('kimi_gateway_').removesuffix('_total')}[{label}]"] = float(value)
    return out
