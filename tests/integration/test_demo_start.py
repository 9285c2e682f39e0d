"""`kimi-gateway demo` starts its gateway only once its simulated workers listen, so the gateway's
first health probe finds them: `/ready` is true from the first answer, not a probe interval later."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from gateway.config import parse_config
from gateway.demo import demo_servers, listen_or_exit
from gateway.server import serve_many
from tests.support import free_port, pool


def test_demo_gateway_is_ready_from_its_first_answer() -> None:
    workers = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = parse_config({"pools": [pool("p", "vllm", workers, 131072)],
                           "health": {"interval": 30.0},  # no second probe within the test
                           "affinity": {"key_prefix": "kgw:test-demo-start"}}, environ={})
    port = free_port()
    servers = demo_servers(config, "127.0.0.1", port)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(serve_many(servers, start_last_after_others=True),), daemon=True)
    # serve_many installs signal handlers, which only the main thread may do: serve without them.
    loop.add_signal_handler = lambda *args: None  # type: ignore[method-assign]
    loop.remove_signal_handler = lambda *args: True  # type: ignore[method-assign]
    thread.start()
    try:
        answer = None
        with httpx.Client(timeout=2.0) as client:
            for _ in range(1000):  # deadline poll: until the gateway listens (≤ 10 s)
                try:
                    answer = client.get(f"http://127.0.0.1:{port}/ready")
                    break
                except httpx.TransportError:
                    threading.Event().wait(0.01)
        assert answer is not None, "the demo's gateway never listened"
        assert answer.status_code == 200, answer.text
        assert answer.json()["ready"] is True
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(timeout=10)
        loop.close()


def test_demo_on_a_port_in_use_exits_with_one_line() -> None:
    workers = [f"http://127.0.0.1:{free_port()}"]
    config = parse_config({"pools": [pool("p", "vllm", workers, 131072)]}, environ={})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        servers = demo_servers(config, "127.0.0.1", port)
        with pytest.raises(SystemExit) as exited:
            listen_or_exit(servers)
    assert str(exited.value) == f"demo: cannot listen on 127.0.0.1:{port}: Address already in use"
    # the worker's socket, bound before the gateway's failed, was closed again: its port is free
    with socket.socket() as again:
        again.bind(("127.0.0.1", int(workers[0].rsplit(":", 1)[1])))
