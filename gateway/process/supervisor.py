"""Several serving processes on one port (`processes: N` in the config, or `serve --processes N`).

The supervisor binds the listening socket, then starts N serving processes (multiprocessing's
`spawn`: fresh interpreters) that accept on that one socket, each running the whole gateway
(`create_app` + `GracefulServer`). It restarts a process that dies, and one that hangs: each
process's event loop writes a heartbeat (`time.monotonic()`, a double in shared memory) every
`hang_timeout / 4` seconds (at most 1 s); a process whose heartbeat is older than `hang_timeout`
(`hung_process_timeout` in the config; `START_TIMEOUT_S` before its first beat) is killed
(SIGKILL: it may be stopped or stuck in C code) and replaced like a dead one. On SIGTERM/SIGINT it
passes the signal on to every process, so each drains and shuts down as gateway/serving/lifecycle.py describes.

What the processes share: the port, Redis (affinity, rate limits: use Redis when N > 1, the
in-process stores are per process) and the Prometheus metrics, kept in prometheus_client's
multiprocess mode: the supervisor sets `PROMETHEUS_MULTIPROC_DIR` to a fresh directory before
any process starts (the library reads it when first imported) and removes the directory at
exit; `/metrics` from any process sums every live process. What each process keeps for itself:
worker health (each probes), ejections and in-flight counts; operator drains too, unless Redis
is configured (gateway/backends/drains.py shares them through it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

log = logging.getLogger("gateway.process.supervisor")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch for multiprocess mode
POLL_S = 0.5
CRASH_WINDOW_S = 10.0  # a process that dies sooner after its start counts as crash-looping
MAX_RESTART_DELAY_S = 30.0
START_TIMEOUT_S = 60.0  # seconds a new process may take to its first heartbeat (imports, app start-up)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0 picks a free one), ready to be shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent(supervisor_pid: int) -> None:
    """Ask Linux to SIGTERM this process when the supervisor dies, even by SIGKILL (prctl
    PR_SET_PDEATHSIG), so no serving process outlives it holding the port; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != supervisor_pid:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def serve_process(config_path: str, sock: socket.socket, metrics_dir: str, supervisor_pid: int,
                  heartbeat: ctypes.c_double | None = None) -> None:
    """One serving process: load the config, build the app and serve on the shared socket, writing
    `time.monotonic()` to `heartbeat` (a shared double) while its event loop runs."""
    _die_with_parent(supervisor_pid)
    from gateway.app import begin_draining, create_app
    from gateway.config import load_config
    from gateway.observability.logs import setup_logging
    from gateway.serving.lifecycle import GracefulServer, tune_gc
    from gateway.serving.request_head import http_options

    config = load_config(config_path, os.environ)
    setup_logging(config.log_level)
    app = create_app(config, metrics_dir=metrics_dir, config_path=config_path)
    host, port = sock.getsockname()[:2]

    def beat() -> None:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()

    server = GracefulServer(app, host, port, config.shutdown, on_drain=lambda: begin_draining(app),
                            heartbeat=beat, heartbeat_every=min(1.0, config.hung_process_timeout / 4),
                            log_level=config.log_level, **http_options(config))
    tune_gc()
    server.run(sockets=[sock])


class Supervisor:
    """Starts, watches and stops `processes` serving processes of the config at `config_path`.

    A process that dies is replaced; one that dies within `CRASH_WINDOW_S` of its start waits
    `2^n` s (at most `MAX_RESTART_DELAY_S`) before its replacement, so a bad config does not
    spin. Every SIGTERM/SIGINT is passed on (the second skips the drain delay, the third stops
    waiting, as with one process); on the first the supervisor closes its own copy of the
    listening socket, so once the processes close theirs new connections are refused at once.
    """

    def __init__(self, config_path: str, host: str, port: int, processes: int, stop_timeout: float,
                 hang_timeout: float = 10.0) -> None:
        """`stop_timeout`: seconds a process gets after SIGTERM (drain delay + grace period) before the
        supervisor kills it (30 s more are allowed for the lifespan's own end). `hang_timeout`:
        seconds without a heartbeat after which a serving process counts as hung."""
        self.config_path = config_path
        self.processes = processes
        self.stop_timeout = stop_timeout
        self.hang_timeout = hang_timeout
        self.sock = bind_socket(host, port)
        self.metrics_dir = tempfile.mkdtemp(prefix="kimi-gateway-metrics-")
        os.environ[MULTIPROC_ENV] = self.metrics_dir  # inherited by the spawned processes
        self._context = multiprocessing.get_context("spawn")
        self._children: list[BaseProcess] = []
        self._beats: list[ctypes.c_double] = []
        self._started: list[float] = []
        self._restart_at: list[float | None] = []
        self._quick_deaths = 0
        self._signals = 0
        self._forwarded = 0

    def _spawn(self, slot: int) -> None:
        beat = self._beats[slot]
        beat.value = 0.0  # no beat yet: START_TIMEOUT_S applies
        child = self._context.Process(target=serve_process,
                                      args=(self.config_path, self.sock, self.metrics_dir, os.getpid(), beat),
                                      name="kimi-gateway-serve")
        child.start()
        self._children[slot], self._started[slot], self._restart_at[slot] = child, time.monotonic(), None

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1

    def _on_hangup(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: every serving process reloads the config (gateway/serving/reload.py)."""
        for child in self._children:
            if child is not None and child.pid is not None and child.is_alive():
                os.kill(child.pid, signal.SIGHUP)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status (0 when every process ended cleanly)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        host, port = self.sock.getsockname()[:2]
        try:
            self._children = [None] * self.processes  # type: ignore[list-item]
            self._started = [0.0] * self.processes
            self._restart_at = [None] * self.processes
            self._beats = [self._context.Value("d", 0.0, lock=False) for _ in range(self.processes)]
            for slot in range(self.processes):
                self._spawn(slot)
            log.info("supervisor: %d serving processes on %s:%d (pids %s)", self.processes, host, port,
                     ", ".join(str(c.pid) for c in self._children))
            while not self._signals:
                self._replace_dead()
                time.sleep(POLL_S)
            return self._stop()
        finally:
            self.sock.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _kill_if_hung(self, slot: int, child: BaseProcess, now: float) -> None:
        """SIGKILL a process whose heartbeat is late (a blocked event loop, a SIGSTOP); `_replace_dead`
        then replaces it."""
        beat = self._beats[slot].value
        if beat > 0:
            silent, allowed = now - beat, self.hang_timeout
        else:
            silent, allowed = now - self._started[slot], max(START_TIMEOUT_S, self.hang_timeout)
        if silent <= allowed:
            return
        log.warning("supervisor: serving process %s sent no heartbeat for %.1f s (limit %.1f s): hung; killing it",
                    child.pid, silent, allowed)
        child.kill()
        child.join(5)

    def _replace_dead(self) -> None:
        now = time.monotonic()
        for slot, child in enumerate(self._children):
            if child.is_alive() and self._restart_at[slot] is None:
                self._kill_if_hung(slot, child, now)
            if child.is_alive():
                if now - self._started[slot] > CRASH_WINDOW_S:
                    self._quick_deaths = 0
                continue
            due = self._restart_at[slot]
            if due is None:
                mark_process_dead(child.pid, self.metrics_dir)
                quick = now - self._started[slot] < CRASH_WINDOW_S
                self._quick_deaths = self._quick_deaths + 1 if quick else 0
                delay = min(2.0 ** self._quick_deaths, MAX_RESTART_DELAY_S) if quick else 0.0
                log.warning("supervisor: serving process %s exited with %s; another starts in %.0f s",
                            child.pid, child.exitcode, delay)
                self._restart_at[slot] = due = now + delay
            if now >= due:
                self._spawn(slot)

    def _forward_signals(self) -> None:
        while self._forwarded < self._signals:
            self._forwarded += 1
            for child in self._children:
                if child.pid is not None and child.is_alive():
                    os.kill(child.pid, signal.SIGTERM)

    def _stop(self) -> int:
        """Pass the signals on, wait for the drain and grace period, then kill what is left."""
        self.sock.close()  # the processes' copies close when their drain delay ends
        deadline = time.monotonic() + self.stop_timeout + 30.0
        status = 0
        # A process already dead when the stop began (waiting for its restart) was reported then;
        # its exit code says nothing about this drain.
        serving = [child for child in self._children if child.is_alive()]
        for child in serving:
            while child.is_alive() and time.monotonic() < deadline:
                self._forward_signals()
                child.join(POLL_S)
            if child.is_alive():
                log.warning("supervisor: serving process %s did not stop; killing it", child.pid)
                child.kill()
                child.join()
            # Ended by the SIGTERM we sent before its own handler was installed (still starting): clean.
            code = 0 if child.exitcode == -signal.SIGTERM else (child.exitcode or 0)
            status = status or code
        return status
