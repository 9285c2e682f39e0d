"""Shared fixtures: simulated engines and gateways served by uvicorn on free loopback ports."""

from __future__ import annotations

import gc
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.config import parse_config
from gateway.serving.request_head import http_options
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from gateway.sim.keepalive import sim_http_options
from tests.support import (
    REPO_ROOT,
    SHARED_DATA,
    GatewayProcess,
    OwnRedis,
    RunningGateway,
    RunningSim,
    ensure_shared_redis,
    free_port,
    with_test_redis_budgets,
)

# Every httpx client (each `httpx.get(...)`, each `openai.OpenAI(...)`) builds an SSL context. From a
# CA *file* (certifi's, or SSL_CERT_FILE) that parses ~150 certificates: 50-140 ms of CPU per client,
# minutes over the suite's thousands of one-off requests. A CA *directory* is read lazily (~0.4 ms).
# The trust is the system's either way, and no test reaches a public https server (the TLS tests
# pass their own trust), so point httpx (its `trust_env` default reads these) at the directory.
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = ssl.get_default_verify_paths().openssl_capath

# With PYTHONDONTWRITEBYTECODE set (the Dockerfile's and many dev shells' habit), every xdist worker
# compiles and assertion-rewrites the ~130 test modules again (~5 s of CPU each) and every gateway or
# serving process the tests spawn compiles the gateway package again (~0.3 s each, dozens of them).
# Caching bytecode in the (git-ignored) __pycache__ directories changes no behaviour, only that cost.
# Set here, in the controller, before xdist starts its workers: they and their children inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The Redis the tests share: the one at $KIMI_TEST_REDIS_URL (else 127.0.0.1:6379), or, when nothing
# answers there, a redis-server this session starts on a free port (stopped when it ends). Done here,
# as this root conftest is imported, so every test module and nested conftest that reads
# `shared_redis_url()` (at import or later) and every xdist worker (inheriting the variable) gets it.
_SHARED_REDIS = ensure_shared_redis()


def pytest_report_header() -> str:
    """Which Redis the tests use (see `ensure_shared_redis`)."""
    return _SHARED_REDIS


# The sims and gateways of most tests are threads of the pytest worker process, so a full (oldest
# generation) garbage collection of the worker's heap stops them all: with hundreds of thousands of
# long-lived objects (imported modules, Hypothesis and Schemathesis state) such a pause measured up
# to 1.6 s with the CPU oversubscribed, longer than the tests' health probes then allowed (both gateway
# processes of test_multiprocess found their sim dead at once and answered 503). Before each test
# module the objects alive then are collected once and frozen (`gc.freeze`): later collections walk
# only what is newer (the longest pause over three heavy modules at load 4.5: 0.73 -> 0.24 s). What
# is frozen lives on anyway (objects alive between modules); only garbage it later becomes stays.
_FROZEN_BEFORE: set[str] = set()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first test of each module: collect, then freeze what survives (see above)."""
    module = item.nodeid.split("::", 1)[0]
    if module not in _FROZEN_BEFORE:
        _FROZEN_BEFORE.add(module)
        gc.collect()
        gc.freeze()


def stop_all(servers: list[ThreadedServer], timeout: float = 10.0) -> None:
    """Ask every server to exit at once, then wait for them all, `timeout` seconds in total (uvicorn
    takes ~0.2 s to stop). The threads are daemons: one still stuck after that (a lifespan's end that
    hangs) is named on stderr and dies with the process, instead of costing 10 s per server."""
    for server in servers:
        server.server.should_exit = True
    deadline = time.monotonic() + timeout
    for server in servers:
        server.stop(max(0.0, deadline - time.monotonic()))
    alive = {thread.name for thread in threading.enumerate()}
    stuck = [server.thread_name for server in servers if server.thread_name in alive]
    if stuck:
        print(f"servers still stopping after {timeout} s: {', '.join(stuck)}", file=sys.stderr)


@pytest.fixture(scope="session")
def _stopping_servers() -> Iterator[list[ThreadedServer]]:
    """Servers (sims, gateways) told to exit at the end of their test; joined once at the session end.

    uvicorn needs ~0.2-0.4 s to shut a server down (its 0.1 s tick, the lifespan's end); letting that
    happen in the background instead of joining each server in turn saves it on every test.
    """
    stopping: list[ThreadedServer] = []
    yield stopping
    stop_all(stopping)


@pytest.fixture(scope="session")
def _stopping_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Gateway processes sent SIGTERM at the end of their test; waited for (killed after 15 s) at the
    session end, for the same reason as `_stopping_servers`."""
    stopping: list[subprocess.Popen[bytes]] = []
    yield stopping
    for proc in stopping:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _told_to_exit(servers: list[ThreadedServer], stopping: list[ThreadedServer]) -> None:
    for server in servers:
        server.server.should_exit = True
    stopping.extend(servers)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the repository (traces, texts, images)."""
    assert SHARED_DATA.is_dir(), f"shared data not found at {SHARED_DATA} (set KIMI_SHARED_DATA to its path)"
    return SHARED_DATA


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def start_sim(_stopping_servers: list[ThreadedServer]) -> Iterator[Callable[..., RunningSim]]:
    """Factory: `start_sim(engine="vllm", max_context_tokens=131072, **SimConfig fields)` → RunningSim
    (`url`, `engine`: the SimWorkerState with its request records; `app`, `server`). Every sim started
    through it is told to exit at the end of the test."""
    servers: list[ThreadedServer] = []

    def start(engine: str = "vllm", **fields: Any) -> RunningSim:
        fields.setdefault("max_context_tokens", 131072)
        config = SimConfig.model_validate({"engine": engine, **fields})
        app = create_sim_app(config)
        server = ThreadedServer(app, **sim_http_options(config, app.engine)).start()
        servers.append(server)
        return RunningSim(server, app.engine)

    yield start
    _told_to_exit(servers, _stopping_servers)


@pytest.fixture
def start_gateway(_stopping_servers: list[ThreadedServer]) -> Iterator[Callable[..., RunningGateway]]:
    """Factory: `start_gateway(pools=[{...pool config...}], **top-level config)` → RunningGateway.

    The config is parsed with an empty environment (`environ={}`): exported `KIMI_GATEWAY_*`
    variables never reach it. Redis call budgets the test leaves unset are 1 s (`with_test_redis_budgets`)."""
    servers: list[ThreadedServer] = []

    def start(pools: list[dict[str, Any]], **settings: Any) -> RunningGateway:
        # 2 s: a sim's probe answer can take over 1 s on a loaded 2-core machine (4 xdist workers)
        settings.setdefault("health", {"interval": 0.5, "timeout": 2.0})
        # Routing tests put pools of any max context in front of sims of another: the /v1/models
        # check (on in production) is opted into by the tests of it (test_worker_models.py).
        settings["health"] = {"verify_models": False, **settings["health"]}
        config = parse_config({"pools": pools, **with_test_redis_budgets(settings)}, environ={})
        server = ThreadedServer(create_app(config), **http_options(config)).start()
        servers.append(server)
        return RunningGateway(server, config)

    yield start
    _told_to_exit(servers, _stopping_servers)


@pytest.fixture
def unused_port() -> int:
    """A loopback TCP port nobody listens on (connections to it are refused)."""
    return free_port()


@pytest.fixture
def own_redis(unused_port: int) -> Iterator[OwnRedis]:
    """A private redis-server on a free port, started; the test may kill and restart it."""
    server = OwnRedis(unused_port)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def start_gateway_process(
        tmp_path: Path, unused_port: int,
        _stopping_processes: list[subprocess.Popen[bytes]]) -> Iterator[Callable[..., GatewayProcess]]:
    """Factory: `start(pools, **top-level config)` → a serving gateway process (ready answers 200
    and names no unready pool).

    Unless the test gives its own `shutdown`, the drain delay is 0: the 5 s default would hold every
    SIGTERM (the test's and the teardown's) for 5 s, and only shutdown tests are about it. Redis call
    budgets as in `start_gateway`."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(pools: list[dict[str, Any]], **settings: Any) -> GatewayProcess:
        config = {"pools": pools, "health": {"interval": 0.5, "timeout": 2.0}, "log_level": "info",
                  "shutdown": {"drain_delay": 0}, **settings}
        config["health"] = {"verify_models": False, **config["health"]}  # as in start_gateway
        config = with_test_redis_budgets(config)
        config_path = tmp_path / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = tmp_path / "gateway.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(config_path),
                                     "--port", str(unused_port)], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        gateway = GatewayProcess(proc, f"http://127.0.0.1:{unused_port}", log)
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"gateway exited with {proc.returncode}:\n{gateway.log_text()}"
            assert time.monotonic() < deadline, f"gateway not ready after 30 s:\n{gateway.log_text()}"
            try:
                answer = httpx.get(gateway.url + "/ready")
                if answer.status_code == 200 and answer.json()["unready_pools"] == []:  # every pool serves
                    return gateway
            except httpx.TransportError:
                pass
            time.sleep(0.05)

    yield start
    for proc in procs:  # SIGTERM first: a supervisor then stops its serving processes and cleans up
        if proc.poll() is None:
            proc.terminate()
            _stopping_processes.append(proc)
