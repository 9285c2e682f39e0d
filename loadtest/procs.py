"""Child processes of a benchmark run: start, wait until ready, stop (always), with bounded waits.

Every child runs in its own session (process group), so `ManagedProcess.stop` can end it and
anything it spawned by that group's id: SIGTERM first, SIGKILL after `stop_timeout` seconds.
`ProcessGroup` stops all its children in reverse start order, also on errors and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

POLL_S = 0.1
"""Pause between readiness polls, seconds."""


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a child gets when the process that started it dies."""


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover
    _LIBC = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec hook: SIGTERM this child when the benchmark process dies (Linux; no-op elsewhere).

    Resolved before the fork: a preexec hook must not load libraries or start processes.
    """
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ProcessError(RuntimeError):
    """A child process failed to start or become ready; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, max_bytes: int = 4000) -> str:
    """The last `max_bytes` bytes of a log file (empty when missing)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ManagedProcess:
    """One child process with its output in `log_path`; stop it with `stop()` (idempotent)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, stop_timeout: float = 10.0) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        """Spawn the process in a new session; stdout and stderr go to `log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.cwd, start_new_session=True,
                                         preexec_fn=_die_with_parent if _LIBC is not None else None)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def fail(self, message: str) -> ProcessError:
        """A ProcessError naming this process, with the tail of its log."""
        code = self.proc.poll() if self.proc is not None else None
        status = f" (exit code {code})" if code is not None else ""
        tail = log_tail(self.log_path)
        return ProcessError(f"{self.name}{status}: {message}\n--- {self.log_path} (tail) ---\n{tail}")

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `check()` every `POLL_S` s until it is true; ProcessError if the process exits or
        `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise self.fail(f"exited while waiting for {what}")
            if check():
                return
            if time.monotonic() > deadline:
                raise self.fail(f"not {what} within {timeout:.0f} s")
            time.sleep(POLL_S)

    def wait_http(self, url: str, timeout: float, accept: Callable[[httpx.Response], bool] | None = None) -> None:
        """Wait until GET `url` answers 200 (and `accept(response)` holds, when given)."""

        def check() -> bool:
            try:
                response = httpx.get(url, timeout=2.0, trust_env=False)
            except httpx.HTTPError:
                return False
            return response.status_code == 200 and (accept is None or accept(response))

        self.wait_until(check, timeout, f"ready at {url}")

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL it after `stop_timeout` s; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        # Leftover members of its group (a child the process spawned) go too.
        self._signal_group(proc.pid, signal.SIGKILL)
        return proc.poll()

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


class ProcessGroup:
    """Children started together; `close()` (or leaving the `with` block) stops every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[ManagedProcess] = []

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              stop_timeout: float = 10.0) -> ManagedProcess:
        """Start a child whose log is `log_dir/<name>.log`."""
        child = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env=env, stop_timeout=stop_timeout)
        self.children.append(child)
        return child.start()

    def close(self) -> None:
        """Stop all children, newest first."""
        while self.children:
            self.children.pop().stop()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds used so far by process `pid` (Linux /proc; None elsewhere or gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    # After the command name: state is field 3, utime field 14, stime field 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / ticks


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot (Linux /proc/stat; None elsewhere)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


class CpuMeter:
    """CPU use during a span: each named process's CPU seconds and the machine's busy fraction."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float | None] = {}
        self._machine: tuple[int, int] | None = None

    def __enter__(self) -> CpuMeter:
        self._start = {name: process_cpu_seconds(pid) for name, pid in self.pids.items()}
        self._machine = machine_cpu_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read(self) -> tuple[dict[str, float], float | None]:
        """({name: CPU seconds since entering}, machine busy fraction since entering, 0..1)."""
        used = {}
        for name, pid in self.pids.items():
            now, then = process_cpu_seconds(pid), self._start.get(name)
            if now is not None and then is not None:
                used[name] = now - then
        busy = None
        now_machine = machine_cpu_ticks()
        if now_machine is not None and self._machine is not None and now_machine[1] > self._machine[1]:
            busy = (now_machine[0] - self._machine[0]) / (now_machine[1] - self._machine[1])
        return used, busy


def python_argv(module: str, *args: str) -> list[str]:
    """argv running `module` with this interpreter (the venv's python)."""
    return [sys.executable, "-m", module, *args]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `extra`, unbuffered, offline for Hugging Face libraries."""
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(extra or {})
    return env
