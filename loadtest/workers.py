"""One process hosting N simulated engines (`python -m loadtest.workers --spec FILE --ports-file FILE`).

The spec is a JSON file `{"count": N, "sim": {<SimConfig fields>}}`. Each engine gets its own
uvicorn server on a free loopback port, all in one event loop (`gateway.serving.server.serve_many`); once
every server listens, the ports are written to `--ports-file` as `{"ports": [...], "dropped": [...]}`
(written to a temporary name, then renamed, so readers never see half a file). `dropped` lists spec
fields this version of `SimConfig` does not know, which were left out.

The process ends on SIGTERM/SIGINT, or by itself when its parent process goes away, so a benchmark
that was killed leaves no simulator behind. Without `keep_records` in `SimConfig`, it clears the
engines' request records every few seconds (they hold whole request bodies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from gateway.serving.server import QuietServer, bound_port, serve_many, uvicorn_config
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig

STARTUP_TIMEOUT_S = 30.0
"""Longest wait for every server to listen, seconds."""

HOUSEKEEPING_S = 1.0
"""Period of the parent check and the record clean-up, seconds."""


def supported_fields(requested: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The requested SimConfig fields this SimConfig knows, and the names of those it does not."""
    known = set(SimConfig.model_fields)
    kept = {k: v for k, v in requested.items() if k in known}
    return kept, sorted(set(requested) - known)


def build_servers(count: int, sim: dict[str, Any], host: str) -> tuple[list[QuietServer], list[Any]]:
    """`count` uvicorn servers on port 0, each with a fresh simulated engine, and their apps."""
    config = SimConfig.model_validate(sim)
    servers, apps = [], []
    for _ in range(count):
        app = create_sim_app(config.model_copy(deep=True))
        servers.append(QuietServer(uvicorn_config(app, host, 0)))
        apps.append(app)
    return servers, apps


def write_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to `path` via a temporary file and a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(path)


async def _announce(servers: list[QuietServer], ports_file: Path, dropped: list[str]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    while not all(s.started for s in servers):
        if loop.time() > deadline:
            raise RuntimeError("simulated workers did not start in time")
        await asyncio.sleep(0.02)
    write_atomically(ports_file, {"ports": [bound_port(s) for s in servers], "dropped": dropped})


async def _housekeeping(servers: list[QuietServer], apps: list[Any], clear_records: bool) -> None:
    parent = os.getppid()
    while True:
        await asyncio.sleep(HOUSEKEEPING_S)
        if os.getppid() != parent:  # the benchmark died: stop instead of lingering
            for server in servers:
                server.should_exit = True
            return
        if clear_records:
            for app in apps:
                app.engine.clear_records()


async def run(count: int, sim: dict[str, Any], ports_file: Path, host: str = "127.0.0.1") -> None:
    """Serve `count` simulated engines until a signal or the parent's exit."""
    kept, dropped = supported_fields(sim)
    servers, apps = build_servers(count, kept, host)
    tasks = [asyncio.create_task(_announce(servers, ports_file, dropped)),
             asyncio.create_task(_housekeeping(servers, apps, "keep_records" not in SimConfig.model_fields))]
    try:
        await serve_many(servers)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.workers", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file: {count, sim}")
    parser.add_argument("--ports-file", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
    coro = run(int(spec["count"]), dict(spec["sim"]), Path(args.ports_file), args.host)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    main()
