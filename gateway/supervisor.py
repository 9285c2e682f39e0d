"""Several serving processes on one port (`processes: N` in the config, or `serve --processes N`).

The supervisor binds the listening socket, then starts N serving processes (multiprocessing's
`spawn`: fresh interpreters) that accept on that one socket, each running the whole gateway
(`create_app` + `GracefulServer`). It restarts a process that dies, and on SIGTERM/SIGINT passes
the signal on to every process, so each drains and shuts down as gateway/lifecycle.py describes.

What the processes share: the port, Redis (affinity, rate limits: use Redis when N > 1, the
in-process stores are per process) and the Prometheus metrics, kept in prometheus_client's
multiprocess mode: the supervisor sets `PROMETHEUS_MULTIPROC_DIR` to a fresh directory before
any process starts (the library reads it when first imported) and removes the directory at
exit; `/metrics` from any process sums every live process. What each process keeps for itself:
worker health (each probes), ejections and in-flight counts; operator drains too, unless Redis
is configured (gateway/backends/drains.py shares them through it).
"""

from __future__ import annotations

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

log = logging.getLogger("gateway.supervisor")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch for multiprocess mode
POLL_S = 0.5


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0 picks a free one), ready to be shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_process(config_path: str, sock: socket.socket, metrics_dir: str) -> None:
    """One serving process: load the config, build the app and serve on the shared socket."""
    from gateway.app import begin_draining, create_app
    from gateway.config import load_config
    from gateway.lifecycle import GracefulServer

    config = load_config(config_path)
    logging.basicConfig(level=config.log_level.upper(), format="%(message)s")
    app = create_app(config, metrics_dir=metrics_dir)
    host, port = sock.getsockname()[:2]
    server = GracefulServer(app, host, port, config.shutdown, on_drain=lambda: begin_draining(app),
                            log_level=config.log_level)
    server.run(sockets=[sock])


class Supervisor:
    """Starts, watches and stops `processes` serving processes of the config at `config_path`."""

    def __init__(self, config_path: str, host: str, port: int, processes: int, stop_timeout: float) -> None:
        """`stop_timeout`: seconds a process gets after SIGTERM (drain delay + grace period) before the
        supervisor kills it (30 s more are allowed for the lifespan's own end)."""
        self.config_path = config_path
        self.processes = processes
        self.stop_timeout = stop_timeout
        self.sock = bind_socket(host, port)
        self.metrics_dir = tempfile.mkdtemp(prefix="kimi-gateway-metrics-")
        os.environ[MULTIPROC_ENV] = self.metrics_dir  # inherited by the spawned processes
        self._context = multiprocessing.get_context("spawn")
        self._children: list[BaseProcess] = []
        self._signals = 0

    def _spawn(self) -> BaseProcess:
        child = self._context.Process(target=serve_process, args=(self.config_path, self.sock, self.metrics_dir),
                                      name="kimi-gateway-serve")
        child.start()
        return child

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status (0 when every process ended cleanly)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        host, port = self.sock.getsockname()[:2]
        try:
            self._children = [self._spawn() for _ in range(self.processes)]
            log.info("supervisor: %d serving processes on %s:%d (pids %s)", self.processes, host, port,
                     ", ".join(str(c.pid) for c in self._children))
            while not self._signals:
                for i, child in enumerate(self._children):
                    if not child.is_alive():
                        log.warning("supervisor: serving process %s exited with %s; starting another",
                                    child.pid, child.exitcode)
                        mark_process_dead(child.pid, self.metrics_dir)
                        self._children[i] = self._spawn()
                time.sleep(POLL_S)
            return self._stop()
        finally:
            self.sock.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _stop(self) -> int:
        """Pass SIGTERM on, wait for the drain and grace period, then kill what is left."""
        for child in self._children:
            if child.pid is not None and child.is_alive():
                os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout + 30.0
        status = 0
        for child in self._children:
            child.join(max(deadline - time.monotonic(), 0.1))
            if child.is_alive():
                log.warning("supervisor: serving process %s did not stop; killing it", child.pid)
                child.kill()
                child.join()
            status = status or (child.exitcode or 0)
        return status
