"""`serve` runs check-config's production checks (issue 24 §6): it logs each warning, `--strict`
refuses to start on any; `rediss://` with redis-py's TLS options reaches a real TLS redis-server
(certificates made with `openssl` in the test), and a wrong CA is refused, so the TLS is verified."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from tests.support import REPO_ROOT, RunningGateway, RunningSim, free_port, pool, wait_for_redis

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
UNSAFE = {"pools": [pool("p", "vllm", ["http://kimi-worker-0.invalid:8000"], 131072)],
          "redis_url": "redis://kimi-redis.invalid:6379/0", "shutdown": {"drain_delay": 0, "grace_period": 1}}


def serve(tmp_path: Path, config: dict[str, Any], port: int, *flags: str) -> subprocess.Popen[str]:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), "--port", str(port),
                             *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin"})


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_serve_strict_refuses_to_start_on_a_warning(tmp_path: Path) -> None:
    port = free_port()
    proc = serve(tmp_path, UNSAFE, port, "--strict")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and out == "", err
    lines = err.strip().splitlines()
    assert lines[-1] == f"serve --strict: 4 warning(s) in {tmp_path / 'gateway.yaml'}; not starting"
    assert sorted(lines[:-1]) == sorted([
        "warning: pools.0.workers.0: http://kimi-worker-0.invalid:8000 is a placeholder host",
        "warning: redis_url: kimi-redis.invalid is a placeholder host",
        "warning: redis_url: plaintext redis:// to kimi-redis.invalid: affinity keys, limits and any password "
        "cross the network unencrypted; use rediss:// (TLS options as query parameters, e.g. "
        "?ssl_ca_certs=/path/ca.crt) or accept it with allow_plaintext: [redis]",
        "warning: pools.0.workers: pool p reaches kimi-worker-0.invalid over plaintext http://: the engine key "
        "and every prompt and answer cross the network unencrypted; use https:// or accept it with "
        "allow_plaintext: [engines]"])
    assert "kimi-gateway serving" not in err and not listening(port)


def test_serve_logs_each_warning_and_starts(tmp_path: Path) -> None:
    port = free_port()
    proc = serve(tmp_path, {**UNSAFE, "allow_plaintext": ["redis"]}, port)
    try:
        deadline = time.monotonic() + 20
        while not listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    warnings = [line for line in err.splitlines() if line.startswith("config warning: ")]
    assert len(warnings) == 3, err
    assert "config warning: pools.0.workers: pool p reaches kimi-worker-0.invalid over plaintext http://" in err
    assert "plaintext redis://" not in err  # allow_plaintext: [redis] accepts it
    assert err.index("config warning: ") < err.index("kimi-gateway serving on")


# --- rediss:// against a real TLS redis-server ------------------------------------------------------------


def make_ca_signed_cert(folder: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signs for localhost / 127.0.0.1: (ca.crt, server.crt, server.key)."""
    folder.mkdir()
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt, ext = folder / "server.key", folder / "server.csr", folder / "server.crt", folder / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for command in (
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_crt, "-days", "1",
             "-subj", f"/CN={name} test CA"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
            ["x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
             "-days", "1", "-extfile", ext]):
        subprocess.run(["openssl", *map(str, command)], check=True, capture_output=True, timeout=30)
    return ca_crt, crt, key


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A redis-server speaking only TLS on a free port: (port, its CA, another CA that did not sign it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    ca, crt, key = make_ca_signed_cert(tmp_path / "tls", "redis")
    other_ca, _, _ = make_ca_signed_cert(tmp_path / "other", "other")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(crt), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_redis(redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=str(ca)), proc)
        yield port, ca, other_ca
    finally:
        proc.kill()
        proc.wait()


def test_rediss_with_tls_options_shares_a_drain(tls_redis: tuple[int, Path, Path], start_sim: StartSim,
                                                start_gateway: StartGateway) -> None:
    port, ca, other_ca = tls_redis
    sim = start_sim("vllm")
    verified = start_gateway([pool("p", "vllm", [sim.url], 131072)], affinity={"key_prefix": "kgw:tls"},
                             redis_url=f"rediss://localhost:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    answer = httpx.post(verified.url + "/admin/workers/p/0/drain", timeout=10)
    assert answer.status_code == 200 and answer.json()["shared"] is True, answer.text
    assert redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=str(ca)).smembers("kgw:tls:drained-urls") \
        == {f"p {sim.url}".encode()}
    wrong_ca = start_gateway([pool("p", "vllm", [sim.url], 131072)], affinity={"key_prefix": "kgw:tls2"},
                             redis_url=f"rediss://localhost:{port}/0?ssl_ca_certs={other_ca}&ssl_cert_reqs=required")
    refused = httpx.post(wrong_ca.url + "/admin/workers/p/0/drain", timeout=10)
    assert refused.status_code == 200 and refused.json()["shared"] is False  # the certificate did not verify
