"""Test support: handles of running servers and small config builders."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.config import GatewayConfig
from gateway.serving.server import ThreadedServer
from gateway.sim.app import SimApp
from gateway.sim.worker_state import SimWorkerState

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("KIMI_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


# Each Redis call's budget in a gateway config, by section. The defaults (20-50 ms) suit a production
# Redis; on a test machine running more busy processes than it has cores (the suite on 4 xdist workers
# over 2), the Redis server or the gateway's thread may wait that long for a CPU, and a missed budget is
# an affinity miss, a 503 or an open breaker that fails a test about something else.
REDIS_BUDGETS = {"affinity": "lookup_timeout", "responses": "lookup_timeout", "auth": "redis_timeout"}
TEST_REDIS_BUDGET_S = 1.0


def with_test_redis_budgets(settings: dict[str, Any]) -> dict[str, Any]:
    """A gateway config's top-level `settings` with every Redis call budget the test left unset at
    `TEST_REDIS_BUDGET_S` seconds (the tests of those budgets set theirs)."""
    out = dict(settings)
    for section, field in REDIS_BUDGETS.items():
        out[section] = {field: TEST_REDIS_BUDGET_S, **(out.get(section) or {})}
    return out


LISTEN_PORTS = range(20000, 32768)
"""Where the tests' listeners go: below Linux's ephemeral range (`net.ipv4.ip_local_port_range`,
32768-60999 by default), which the OS hands to every outgoing connection and to port-0 listeners. A
port picked there (the OS's own port-0 choice) can be taken by a client connection before the
server binds it: a burst of 1,200 connections did that in a CI run ("Address already in use")."""


def _listen_port_candidates() -> list[int]:
    ports = list(LISTEN_PORTS)
    random.SystemRandom().shuffle(ports)  # two xdist workers do not walk the same order
    return ports


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` in `LISTEN_PORTS` that nobody listened on a moment ago."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports on `host` in `LISTEN_PORTS` that nobody listened on a moment ago.

    Raises RuntimeError when fewer than `n` are free."""
    picked: list[int] = []
    for port in _listen_port_candidates():
        if _bindable(host, port):
            picked.append(port)
            if len(picked) == n:
                return picked
    raise RuntimeError(f"fewer than {n} free ports in {LISTEN_PORTS}")


# The Redis the tests share (own key prefixes, cleaned up): $KIMI_TEST_REDIS_URL, else the usual local
# one. When nothing answers there, tests/conftest.py starts a redis-server on a free port for the
# session and points the variable at it (`ensure_shared_redis`), before any test module reads it.
SHARED_REDIS_ENV = "KIMI_TEST_REDIS_URL"
DEFAULT_SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def shared_redis_url() -> str:
    """The URL of the Redis the tests share (see `SHARED_REDIS_ENV`)."""
    return os.environ.get(SHARED_REDIS_ENV) or DEFAULT_SHARED_REDIS_URL


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis at `url` answers PING within `timeout` seconds."""
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux's
    PR_SET_PDEATHSIG), so a session killed outright leaves no redis-server behind."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the atexit stop alone
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def ensure_shared_redis() -> str:
    """Make `shared_redis_url()` answer: when no Redis answers there and `redis-server` is on PATH,
    start one on a free loopback port (no persistence), point `SHARED_REDIS_ENV` at it (xdist workers
    and the tests' subprocesses inherit it) and stop it when this process exits. Returns a line for
    pytest's report header saying which Redis the tests use."""
    url = shared_redis_url()
    if redis_answers(url):
        return f"redis: {url}"
    binary = shutil.which("redis-server")
    if binary is None:
        return f"redis: nothing answers at {url} and redis-server is not on PATH: the tests that use Redis fail"
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    atexit.register(stop_process, proc)
    wait_for_redis(redis.Redis(port=port), proc)
    os.environ[SHARED_REDIS_ENV] = own = f"redis://127.0.0.1:{port}/0"
    return f"redis: nothing answered at {url}: started redis-server at {own} for this session"


@dataclass
class RunningSim:
    """A simulated engine on a loopback port."""

    server: ThreadedServer
    engine: SimWorkerState

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def app(self) -> SimApp:
        """The sim's ASGI app (`app.engine` is `engine`)."""
        return self.server.app  # type: ignore[no-any-return]


@dataclass
class RunningGateway:
    """A gateway on a loopback port and the config it runs."""

    server: ThreadedServer
    config: GatewayConfig

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def v1(self) -> str:
        return self.server.url + "/v1"

    def metric(self, prefix: str) -> float:
        """Sum of this gateway's /metrics samples `prefix` selects (0 when none): see `metric_sum`."""
        return metric_sum(httpx.get(self.url + "/metrics").text, prefix)

    def flush_affinity(self) -> None:
        """Return once the gateway's affinity records so far are in its store (Redis writes are
        queued to a background task; this is its `flush()` barrier, run on the server's loop)."""
        state = self.server.app.state.gateway
        assert state is not None and state.affinity is not None, "the gateway is not running with affinity"
        self.server.call(state.affinity.flush())

    def wait_for_metric(self, prefix: str, expected: Callable[[float], bool], timeout: float = 5.0) -> float:
        """Poll `metric(prefix)` until `expected(value)` holds and return the value; AssertionError with the
        last value after `timeout` seconds. A request is accounted (requests, tokens) as its handler ends,
        just after the client got its last byte and the upstream lease was released, so neither the
        client's return nor `wait_until_idle` orders a test after that accounting."""
        deadline = time.monotonic() + timeout
        while not expected(value := self.metric(prefix)):
            assert time.monotonic() < deadline, f"{prefix} stayed at {value}"
            time.sleep(0.02)
        return value

    def wait_until_idle(self, timeout: float = 5.0) -> None:
        """Wait until no upstream lease is open (`kimi_gateway_in_flight` sums to 0); AssertionError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.metric("kimi_gateway_in_flight{") != 0:
            assert time.monotonic() < deadline, "an upstream lease was not released"
            time.sleep(0.05)


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _labels(text: str) -> dict[str, str] | None:
    """`a="x",b="y"` (a sample's or a selector's labels, maybe ending in `,`) as a dict; None when
    it is not whole pairs (a selector cut inside a value)."""
    labels, at = {}, 0
    for found in _LABEL.finditer(text):
        if text[at:found.start()].strip(", ") != "":
            return None
        labels[found.group(1)] = found.group(2)
        at = found.end()
    return labels if text[at:].strip(", ") == "" else None


def metric_sum(exposition: str, prefix: str) -> float:
    """Sum of the exposition's samples that `prefix` selects, as a PromQL selector would: with
    `name{a="x",...}` (closed or not) every sample of `name` whose labels include those (so a
    label added to a metric, `model`, leaves the tests' selectors working); otherwise every sample
    line starting with `prefix`."""
    name, brace, rest = prefix.partition("{")
    wanted = _labels(rest.removesuffix("}")) if brace else None
    total = 0.0
    for line in exposition.splitlines():
        if wanted is None or line.startswith("#"):
            if line.startswith(prefix):
                total += float(line.split()[-1])
            continue
        sample, _, labels = line.partition("{")
        if sample != name:
            continue
        have = _labels(labels.rpartition("}")[0])
        if have is not None and all(have.get(k) == v for k, v in wanted.items()):
            total += float(line.split()[-1])
    return total


def pool(name: str, engine: str, urls: list[str], max_context_tokens: int, **extra: Any) -> dict[str, Any]:
    """A pool config mapping for tests."""
    return {"name": name, "engine": engine, "workers": urls, "max_context_tokens": max_context_tokens, **extra}


def wait_for_redis(client: redis.Redis, proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """Return once `client` gets PONG from the redis-server `proc` just started (then close the client);
    AssertionError when the process exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    client.close()


class OwnRedis:
    """A private redis-server on a free port that a test may kill and restart."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server must be installed"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(redis.Redis(port=self.port), self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@dataclass
class GatewayProcess:
    """A `kimi-gateway serve` subprocess on a loopback port; its output goes to `log`."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_exit(self, timeout: float) -> int:
        """The exit status, polled without blocking the event loop; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"gateway still running after {timeout} s:\n{self.log_text()}"
            await asyncio.sleep(0.02)
        return self.proc.returncode


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s: a peer router or other child process of a test."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_router_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, name: str, timeout: float = 30) -> None:
    """Poll `url`/health until it answers 200 (a peer router answers once its workers are registered);
    AssertionError with the log's tail if the process exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{name} not ready: {log.read_text()[-2000:]}"
        time.sleep(0.1)


def access_lines(caplog: pytest.LogCaptureFixture, gw: RunningGateway, count: int) -> list[dict[str, Any]]:
    """`gw`'s access log lines (its server thread's only: another test's gateway may still be finishing
    in the background), once there are `count`: a request is logged as its handler ends. AssertionError
    after 5 s with fewer."""
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(r.getMessage()) for r in caplog.records
                 if r.name == "gateway.access" and r.threadName == gw.server.thread_name]
        if len(lines) >= count:
            return lines
        assert time.monotonic() < deadline, f"{len(lines)} access log lines, expected {count}"
        time.sleep(0.02)
