"""`kimi-gateway serve` on a port another process listens on: a non-zero exit at once (issue 15 §4),
not a process that keeps running without a listener and ignores SIGTERM."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO_ROOT, pool, shared_redis_url


@pytest.mark.parametrize(("processes", "settings"), [
    (1, {"redis_url": shared_redis_url()}),  # with Redis the old start-up hung in its shutdown
    (1, {}),
    (2, {}),  # the supervisor binds for its serving processes
])
def test_serve_on_a_port_in_use_exits_non_zero_at_once(tmp_path: Path, processes: int,
                                                       settings: dict[str, object]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {"pools": [pool("p", "vllm", ["http://127.0.0.1:9"], 131072)], "host": "127.0.0.1",
                  "port": port, "processes": processes, "affinity": {"key_prefix": "kgw:test-port"}, **settings}
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            pytest.fail(f"serve still running with its port taken:\n{output.decode(errors='replace')}")
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in output.decode(errors="replace")
