"""Run ASGI apps under uvicorn: in a background thread (tests, tools) or several in one event loop (demo)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

ASGIApp = Any
T = TypeVar("T")


def uvicorn_config(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> uvicorn.Config:
    """Build the uvicorn config every server of the project uses.

    `port=0` binds a free port; read it back with `bound_port(server)`. Access logs are off: the
    gateway writes its own structured line per request. uvicorn's `X-Forwarded-For` rewriting of
    the client address is off: nothing here reads the client address, and it cost a middleware call
    per request.
    """
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("proxy_headers", False)
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("timeout_graceful_shutdown", 2)
    return uvicorn.Config(app, host=host, port=port, **kwargs)


def bound_port(server: uvicorn.Server) -> int:
    """The TCP port a started uvicorn server listens on (useful after binding port 0)."""
    return int(server.servers[0].sockets[0].getsockname()[1])


class ThreadedServer:
    """An ASGI app served by uvicorn in a daemon thread on 127.0.0.1.

    Use as a context manager; `url` is `http://127.0.0.1:PORT` once entered. Raises RuntimeError
    when the server does not start within `start_timeout` seconds (e.g. the port is taken).
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 15.0,
                 **uvicorn_kwargs: Any) -> None:
        self.app = app
        self.host = host
        self.server = uvicorn.Server(uvicorn_config(app, host, port, **uvicorn_kwargs))
        self.start_timeout = start_timeout
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{host}:{port}", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = bound_port(self.server)
        self._thread.name = f"uvicorn-{self.host}:{self.port}"  # log records name the server they came from
        return self

    @property
    def thread_name(self) -> str:
        """The server thread's name (`uvicorn-HOST:PORT` once started): `LogRecord.threadName` of what
        it logs, so a test can tell its own server's lines from another's."""
        return self._thread.name

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coroutine` on the server's event loop and return its result (from another thread,
        e.g. a test reaching the app's state). Raises TimeoutError after `timeout` seconds."""
        loop = self.server.servers[0].get_loop()
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_many(servers: list[QuietServer], last_depends_on_others: bool = False,
                     sockets: list[socket.socket] | None = None) -> None:
    """Serve several servers in the current event loop; SIGINT/SIGTERM stop all of them.

    With `last_depends_on_others`, the last server (the demo's gateway, a client of the others)
    starts only once the others listen, so its first health probe finds them instead of waiting a
    probe interval; and a signal stops it first, the others once it has stopped, so what it still
    serves is cut by its own shutdown (`shutting_down`), not by its workers vanishing under it (an
    `upstream_error` and a worker marked unhealthy). `sockets`: one bound listening socket per
    server (else each binds its configured port)."""
    loop = asyncio.get_running_loop()
    ordered = last_depends_on_others and len(servers) > 1

    def stop_all() -> None:
        for server in servers[-1:] if ordered else servers:
            server.should_exit = True

    async def serve_last(last: QuietServer, others: list[QuietServer]) -> None:
        try:
            while not all(s.started for s in others):  # bounded: uvicorn sets should_exit when a bind fails
                if any(s.should_exit for s in others) or last.should_exit:
                    return
                await asyncio.sleep(0.01)
            await last.serve(**listen(len(servers) - 1))
        finally:
            for server in others:
                server.should_exit = True

    def listen(index: int) -> dict[str, list[socket.socket]]:
        return {"sockets": [sockets[index]]} if sockets is not None else {}

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_all)
    try:
        if ordered:
            *others, last = servers
            await asyncio.gather(*(s.serve(**listen(i)) for i, s in enumerate(others)), serve_last(last, others))
        else:
            await asyncio.gather(*(s.serve(**listen(i)) for i, s in enumerate(servers)))
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
