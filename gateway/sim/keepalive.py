"""The simulator's idle keep-alive: uvicorn's, or one that drops idle connections unannounced.

uvicorn closes a connection idle for `timeout_keep_alive` seconds with a FIN, which a pooled
client sees at once (its pool then drops the connection). In the field a pooled client still
meets dead connections: the engine's idle close crosses the client's next request on the wire,
or a NAT or proxy in between forgot the connection. `UnannouncedIdleCloseProtocol` makes that
race deterministic: an idle connection is marked dead without a word, and the next request that
arrives on it is answered by a reset (the socket closed with the request unread), before any
response byte.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.sim.config import SimConfig
from gateway.sim.worker_state import SimWorkerState


class UnannouncedIdleCloseProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose idle keep-alive timeout forgets the connection silently;
    `engine` (set by `sim_http_options`) counts the requests reset that way."""

    engine: SimWorkerState | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forgotten = False

    def timeout_keep_alive_handler(self) -> None:
        self._forgotten = True  # no FIN: the client keeps the connection in its pool

    def data_received(self, data: bytes) -> None:
        if self._forgotten:
            if self.engine is not None:
                self.engine.note_idle_reset()
            self.transport.abort()  # the request arrives on a dead connection: reset, no answer
            return
        super().data_received(data)


def sim_http_options(config: SimConfig, engine: SimWorkerState | None = None) -> dict[str, Any]:
    """uvicorn settings for a sim of `config`: its idle keep-alive (`keep_alive_s`) and, with
    `idle_close_unannounced`, the protocol that drops idle connections without a FIN (counting
    the requests it resets in `engine.idle_resets`)."""
    options: dict[str, Any] = {"timeout_keep_alive": config.keep_alive_s}
    if config.idle_close_unannounced:
        options["http"] = type("UnannouncedIdleCloseProtocol", (UnannouncedIdleCloseProtocol,), {"engine": engine})
    return options
