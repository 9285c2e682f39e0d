"""The engines' lifecycle as the Kubernetes overlays run it, replayed on loopback with real processes:
two simulated engines (`kimi-gateway sim`), two gateway replicas (`kimi-gateway serve`) sharing one
Redis, and the drain sidecar's own shell (deploy/kubernetes/generate.py: `drain_hook`, its preStop,
and `drain_sidecar_script`, its command) running the real `kimi-gateway drain`.

A rolling restart of each engine (preStop drain → SIGTERM → a new engine on the same address) and a
drain that fails (a refused key) while a client keeps sending requests: every request is answered,
the failed drain still holds the engine its drain time, and afterwards no worker is left drained on
either replica. The first engine is restarted without its pod's start-up undrain (the gateways see
its engine go and a new one answer), the second with it (the sidecar's command). The replica
addresses also hold one where nothing listens (a starting or crash-looping replica), which the
drain and the undrain skip.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from gateway.auth.keys import hash_key
from gateway.backends.drains import GONE_PROBES
from tests.deploy.test_kubernetes import GENERATE
from tests.support import REPO_ROOT, free_port, free_ports, shared_redis_url, with_test_redis_budgets

USER_KEY = "sk-user-" + uuid.uuid4().hex + uuid.uuid4().hex
DRAIN_KEY = "sk-drain-" + uuid.uuid4().hex + uuid.uuid4().hex
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex + uuid.uuid4().hex
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DEADLINE_S = 30.0  # for each condition waited on: generous, for a loaded 2-core machine
BIN = str(Path(sys.executable).parent)  # `kimi-gateway` (the console script) beside the interpreter


def healthy(worker: dict[str, Any]) -> bool:
    """In service: healthy and not drained."""
    return bool(worker["healthy"] and not worker["draining"])


def eventually(check: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.1)


class Fleet:
    """The processes of one test: simulated engines by port, gateway replicas by URL."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sims: dict[int, subprocess.Popen[bytes]] = {}
        self.gateways: list[str] = []

    def start_sim(self, port: int) -> None:
        with (self.tmp_path / f"sim-{port}.log").open("ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--engine", "vllm", "--port",
                                     str(port), "--ttft", "0.01", "--tpot", "0.01"], cwd=REPO_ROOT, stdout=log,
                                    stderr=log)
        self.procs.append(proc)
        self.sims[port] = proc

    def stop_sim(self, port: int) -> None:
        """SIGTERM, as the kubelet sends once the preStop hooks ended; waits for the exit."""
        proc = self.sims.pop(port)
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)

    def start_gateway(self, port: int, config: dict[str, Any]) -> str:
        path = self.tmp_path / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        with (self.tmp_path / f"gateway-{port}.log").open("ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), "--port",
                                     str(port)], cwd=REPO_ROOT, stdout=log, stderr=log)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        self.gateways.append(url)
        return url

    def worker(self, gateway: str, index: int) -> dict[str, Any]:
        answer = httpx.get(f"{gateway}/admin/workers/p/{index}", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                           timeout=5)
        assert answer.status_code == 200, answer.text
        snapshot: dict[str, Any] = answer.json()
        return snapshot

    def until_everywhere(self, index: int, check: Callable[[dict[str, Any]], bool], what: str) -> None:
        """Wait until `check` holds for worker p/`index` on every gateway replica."""
        eventually(lambda: self.everywhere(index, check), f"p/{index} {what} on every gateway\n{self.logs()}")

    def everywhere(self, index: int, check: Callable[[dict[str, Any]], bool]) -> bool:
        try:
            return all(check(self.worker(gw, index)) for gw in self.gateways)
        except httpx.TransportError:
            return False

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(
            self.tmp_path.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Traffic:
    """A client sending one small request at a time, to each gateway replica in turn, until stopped."""

    def __init__(self, gateways: list[str]) -> None:
        self.gateways = gateways
        self.answers: list[tuple[int, str]] = []  # (status, worker or error text)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(headers={"authorization": f"Bearer {USER_KEY}"}, timeout=20) as client:
            n = 0
            while not self._stop.is_set():
                gateway = self.gateways[n % len(self.gateways)]
                n += 1
                try:
                    answer = client.post(gateway + "/v1/chat/completions", json=CHAT)
                    self.answers.append((answer.status_code, answer.headers.get("x-kimi-gateway-worker")
                                         or answer.text[:300]))
                except httpx.HTTPError as exc:
                    self.answers.append((0, repr(exc)))
                time.sleep(0.02)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def served_by(self, worker: str) -> int:
        return sum(1 for status, who in list(self.answers) if status == 200 and who == worker)

    def until_more(self, worker: str) -> None:
        """Wait until `worker` answered another request than it had when called."""
        served = self.served_by(worker)
        eventually(lambda: self.served_by(worker) > served, f"traffic on {worker} again")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=DEADLINE_S)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(tmp_path)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"kgw-test-lifecycle-{uuid.uuid4().hex[:8]}"
    yield prefix
    store = redis.Redis.from_url(shared_redis_url())
    for key in store.scan_iter(f"{prefix}:*"):
        store.delete(key)
    store.close()


def pod_files(directory: Path) -> dict[str, str]:
    """The drain sidecar's files in one pod's own `/drain` (an emptyDir: each pod starts without them)."""
    directory.mkdir()
    return {"stopping": str(directory / "stopping"), "undrain_pid": str(directory / "undrain.pid")}


def hook_env(key: str) -> dict[str, str]:
    return {"PATH": f"{BIN}:/usr/bin:/bin", GENERATE.DRAIN_KEY_ENV: key}


def test_a_rolling_restart_and_a_failed_drain_leave_no_worker_drained(fleet: Fleet, key_prefix: str,
                                                                      tmp_path: Path) -> None:
    sim_ports = free_ports(2)
    gateway_ports = free_ports(2)
    workers = [f"http://127.0.0.1:{port}" for port in sim_ports]
    for port in sim_ports:
        fleet.start_sim(port)
    config = with_test_redis_budgets({
        "pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 131072, "workers": workers,
                   "policy": "round_robin"}],
        "redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix},
        "health": {"interval": 0.3, "timeout": 2.0, "verify_models": False},
        "shutdown": {"drain_delay": 0}, "log_level": "info",
        "auth": {"enabled": True, "keys": [
            {"name": "clients", "sha256": hash_key(USER_KEY)},
            {"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["user", "admin"]},
            {"name": GENERATE.DRAIN_KEY_NAME, "sha256": hash_key(DRAIN_KEY), "scopes": ["drain"]}]}})
    for port in gateway_ports:
        fleet.start_gateway(port, config)
    for index in (0, 1):
        fleet.until_everywhere(index, healthy, "in service")
    traffic = Traffic(fleet.gateways).start()
    try:
        eventually(lambda: traffic.served_by("p/0") and traffic.served_by("p/1"), "traffic on both workers")

        # A rolling restart, one engine at a time, as the StatefulSet does it. The headless Service
        # also lists a replica where nothing listens (starting, or crash-looping): skipped.
        replicas = [f"http://127.0.0.1:{free_port()}", *fleet.gateways]
        for index, port in enumerate(sim_ports):
            done = tmp_path / f"done-{index}"
            hook = GENERATE.drain_hook("p", workers[index], 20, gateways=replicas, done=str(done),
                                       **pod_files(tmp_path / f"old-pod-{index}"))
            drained = subprocess.run(["sh", "-c", hook], env=hook_env(DRAIN_KEY), capture_output=True, text=True,
                                     timeout=DEADLINE_S + 20)
            assert done.exists() and "0 requests in flight on 2 gateway(s)" in drained.stderr, drained.stderr
            assert fleet.everywhere(index, lambda w: w["draining"])
            fleet.stop_sim(port)  # SIGTERM once the preStop hooks ended
            # The gateways' probes find nothing listening there (what tells them the engine is gone).
            fleet.until_everywhere(index, lambda w: w["failed_probes"] >= GONE_PROBES and w["draining"],
                                   "failing its probes")
            sidecar = None
            if index == 1:  # the new pod's drain sidecar starts with it and undrains the worker
                script = GENERATE.drain_sidecar_script("p", workers[index], gateways=replicas, retry_s=1,
                                                       **pod_files(tmp_path / f"new-pod-{index}"))
                sidecar = subprocess.Popen(["sh", "-c", script], env=hook_env(DRAIN_KEY), start_new_session=True,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            fleet.start_sim(port)  # the new engine, at the same address
            try:
                fleet.until_everywhere(index, healthy, "back in service after its restart")
                traffic.until_more(f"p/{index}")
            finally:
                if sidecar is not None:  # the pod's next SIGTERM: the sidecar exits at once
                    sidecar.send_signal(signal.SIGTERM)
                    assert sidecar.wait(timeout=10) == 0
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(sidecar.pid, signal.SIGKILL)  # its idle `sleep`

        # A drain that fails (the key is refused): the hook still holds the engine its drain time.
        done = tmp_path / "done-failed"
        hook = GENERATE.drain_hook("p", workers[0], 3, gateways=replicas, done=str(done),
                                   **pod_files(tmp_path / "failed-pod"))
        started = time.monotonic()
        failed = subprocess.run(["sh", "-c", hook], env=hook_env("sk-wrong-key"), capture_output=True, text=True,
                                timeout=DEADLINE_S)
        assert "HTTP 401" in failed.stderr, failed.stderr
        # fail closed: the whole drain time, to the hook's whole-second clock (`date +%s`)
        assert done.exists() and time.monotonic() - started >= 2.0
        fleet.stop_sim(sim_ports[0])
        fleet.start_sim(sim_ports[0])
        fleet.until_everywhere(0, healthy, "back in service after the failed drain")
        traffic.until_more("p/0")
    finally:
        traffic.stop()
    failures = [answer for answer in traffic.answers if answer[0] != 200]
    assert not failures and len(traffic.answers) > 20, failures[:5]
    for index in (0, 1):
        assert fleet.everywhere(index, healthy)
    for gateway in fleet.gateways:
        assert httpx.get(gateway + "/ready", timeout=5).status_code == 200
