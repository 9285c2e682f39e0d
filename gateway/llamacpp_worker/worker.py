"""`LlamaCppWorker`: one llama.cpp server in a child process, for tests, the demo and the CLI.

A child process (not a thread) so that several servers with different settings can run side by
side, one can be killed to simulate a dead worker, and a crash in native code cannot take the
caller down. The child is `python -m gateway.llamacpp_worker ... --exit-on-stdin-eof`: it announces its
URL on stdout and also exits when its stdin pipe closes, so it cannot outlive this process.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from gateway.llamacpp_worker.serve import LISTENING_PREFIX
from gateway.llamacpp_worker.settings import LlamaCppSettings

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(re.escape(LISTENING_PREFIX) + r"(http://\S+)")


class WorkerStartError(RuntimeError):
    """The llama.cpp child exited or did not become healthy in time; the message ends with the
    tail of its stderr."""


class LlamaCppWorker:
    """One llama.cpp server serving SmolLM2 in a child process.

    Usage::

        with LlamaCppWorker(LlamaCppSettings(n_ctx=2048)) as worker:
            openai.OpenAI(base_url=worker.url + "/v1", api_key="x")

    `start()` returns once `GET /health` answers 200 (typically 0.5-1 s on the 2-core machines).
    `stop()` ends it with SIGTERM (then SIGKILL), `kill()` with SIGKILL at once; either way the
    port refuses connections afterwards. A worker can be started again after it stopped (with
    `port` 0 it may get a different port).
    """

    def __init__(
        self,
        settings: LlamaCppSettings | None = None,
        *,
        startup_timeout: float = 60.0,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        """`startup_timeout` in seconds; `python` runs the child; `env` adds variables to it."""
        self.settings = settings or LlamaCppSettings()
        self.startup_timeout = startup_timeout
        self._python = python
        self._extra_env = dict(env or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._url: str | None = None
        self._log_dir: Path | None = None
        self._finalizer: weakref.finalize[..., LlamaCppWorker] | None = None

    # ---- state -------------------------------------------------------------------------------

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The child process. Raises RuntimeError if the worker was never started."""
        if self._process is None:
            raise RuntimeError("worker not started")
        return self._process

    @property
    def url(self) -> str:
        """Base URL, `http://host:port` (no `/v1`). Raises RuntimeError before `start()`."""
        if self._url is None:
            raise RuntimeError("worker not started")
        return self._url

    @property
    def port(self) -> int:
        """The TCP port the server listens on. Raises RuntimeError before `start()`."""
        return int(self.url.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        """True while the child process is alive (healthy or not)."""
        return self._process is not None and self._process.poll() is None

    @property
    def log_dir(self) -> Path | None:
        """Folder with the child's `stdout.log` and `stderr.log` (llama.cpp logs); removed by
        `stop()`/`kill()`."""
        return self._log_dir

    def stderr_tail(self, max_chars: int = 4000) -> str:
        """The last `max_chars` characters of the child's stderr ('' if none)."""
        return _tail(self._log_dir / "stderr.log", max_chars) if self._log_dir else ""

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Spawn the server and wait until `/health` answers 200; returns self.

        Raises WorkerStartError (with the child's stderr tail) if it exits early or is not
        healthy within `startup_timeout` seconds; RuntimeError if already running.
        """
        if self.running:
            raise RuntimeError(f"worker already running at {self._url}")
        self._cleanup_logs()
        self._log_dir = Path(tempfile.mkdtemp(prefix="llamacpp-worker-"))
        env = {**os.environ, **self._extra_env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        cmd = [self._python, "-m", "gateway.llamacpp_worker", *self.settings.to_args(), "--exit-on-stdin-eof"]
        log_dir = self._log_dir
        with (log_dir / "stdout.log").open("wb") as out, (log_dir / "stderr.log").open("wb") as err:
            self._process = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env, cwd=_PROJECT_ROOT,
                start_new_session=True,  # a Ctrl-C meant for the caller does not hit the child
            )
        self._url = None
        self._finalizer = weakref.finalize(self, _reap, self._process, log_dir)
        try:
            self._wait_ready(time.monotonic() + self.startup_timeout)
        except BaseException:
            self._terminate(force=True)
            raise
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the server, wait up to `timeout` seconds, then SIGKILL; returns the exit code
        (0 for a clean shutdown, None if never started). Idempotent."""
        return self._terminate(force=False, timeout=timeout)

    def kill(self) -> int | None:
        """SIGKILL the server at once (a worker dying abruptly) and reap it; returns the exit code
        (-9) or None if never started. Its port refuses connections once this returns."""
        return self._terminate(force=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LlamaCppWorker({self._url or 'unstarted'}, n_ctx={self.settings.n_ctx}, {state})"

    # ---- internals ---------------------------------------------------------------------------

    def _wait_ready(self, deadline: float) -> None:
        process = self.process
        assert self._log_dir is not None
        stdout_log = self._log_dir / "stdout.log"
        with httpx.Client(timeout=2.0) as client:
            while True:
                if process.poll() is not None:
                    raise WorkerStartError(
                        f"llama.cpp worker exited with code {process.returncode} before it was ready"
                        f"; stderr tail:\n{self.stderr_tail()}"
                    )
                if self._url is None:
                    match = _LISTENING.search(stdout_log.read_text(errors="replace"))
                    self._url = match.group(1).rstrip("/") if match else None
                if self._url is not None and _healthy(client, self._url):
                    return
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"llama.cpp worker not healthy within {self.startup_timeout:.0f} s"
                        f" (url {self._url}); stderr tail:\n{self.stderr_tail()}"
                    )
                time.sleep(0.05)

    def _terminate(self, *, force: bool, timeout: float = 10.0) -> int | None:
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            if force:
                process.kill()
            else:
                # SIGTERM before stdin's EOF: the EOF alone also stops the server, which then puts the
                # default SIGTERM disposition back on its way out, so a SIGTERM sent after it killed the
                # process (-15) where a loaded machine let the shutdown run first
                process.send_signal(signal.SIGTERM)
                _close(process.stdin)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
        process.wait()
        _close(process.stdin)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._cleanup_logs()
        return process.returncode

    def _cleanup_logs(self) -> None:
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, max_chars: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars * 4))
            return f.read().decode("utf-8", "replace")[-max_chars:]
    except OSError:
        return ""


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        with contextlib.suppress(OSError):
            stream.close()


def _reap(process: subprocess.Popen[bytes], log_dir: Path) -> None:
    """Finalizer: kill a child whose worker was garbage-collected (or at interpreter exit)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    shutil.rmtree(log_dir, ignore_errors=True)
