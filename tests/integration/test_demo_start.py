"""`kimi-gateway demo` starts its gateway only once its simulated workers listen, so the gateway's
first health probe finds them: `/ready` is true from the first answer, not a probe interval later;
and on SIGTERM it stops the gateway before them, so a stream still running is cut by the gateway's
shutdown, not by its worker vanishing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.process.demo import demo_servers, listen_or_exit
from gateway.serving.server import QuietServer, serve_many
from tests.support import REPO_ROOT, free_port, pool

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}


@contextlib.contextmanager
def serving_demo(servers: list[QuietServer]) -> Iterator[Callable[[], None]]:
    """`servers` served as the demo serves them, in a thread; yields a function that does what the
    demo's SIGTERM handler does (serve_many's handler, called on the demo's loop)."""
    loop = asyncio.new_event_loop()
    handlers: list[Callable[[], None]] = []
    # serve_many installs signal handlers, which only the main thread may do: keep them to call.
    loop.add_signal_handler = lambda sig, handler: handlers.append(handler)  # type: ignore[method-assign]
    loop.remove_signal_handler = lambda *args: True  # type: ignore[method-assign]
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(serve_many(servers, last_depends_on_others=True),), daemon=True)
    thread.start()
    try:
        yield lambda: loop.call_soon_threadsafe(handlers[-1])
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(timeout=10)
        loop.close()


def wait_listening(url: str) -> httpx.Response:
    """The first answer of `url`'s `/ready` once it listens (≤ 10 s)."""
    with httpx.Client(timeout=2.0) as client:
        for _ in range(1000):  # deadline poll: until the gateway listens
            try:
                return client.get(url + "/ready")
            except httpx.TransportError:
                threading.Event().wait(0.01)
    raise AssertionError("the demo's gateway never listened")


def test_demo_gateway_is_ready_from_its_first_answer() -> None:
    workers = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = parse_config({"pools": [pool("p", "vllm", workers, 131072)],
                           "health": {"interval": 30.0},  # no second probe within the test
                           "affinity": {"key_prefix": "kgw:test-demo-start"}}, environ={})
    port = free_port()
    with serving_demo(demo_servers(config, "127.0.0.1", port)):
        answer = wait_listening(f"http://127.0.0.1:{port}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["ready"] is True


def test_demo_stop_cuts_a_running_stream_by_the_gateways_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    workers = [f"http://127.0.0.1:{free_port()}"]
    config = parse_config({"pools": [pool("p", "vllm", workers, 131072)],
                           "health": {"interval": 0.2, "timeout": 1.0},  # several probes while it stops
                           "affinity": {"key_prefix": "kgw:test-demo-stop"}}, environ={})
    port = free_port()
    servers = demo_servers(config, "127.0.0.1", port)
    engine = servers[0].config.app.engine
    url = f"http://127.0.0.1:{port}"
    with serving_demo(servers) as sigterm:
        assert wait_listening(url).json()["ready"] is True
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 1000}) as answer:
            assert answer.status_code == 200  # 1000 tokens at 20 ms: 20 s, stopped after its first bytes
            chunks = answer.iter_raw()  # kept: dropping it would close the connection (a real hang-up)
            next(chunks)
            sigterm()
            with pytest.raises(httpx.RemoteProtocolError):  # uvicorn closed the connection inside the body
                for _ in chunks:
                    pass
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["outcome"], a["status"]) for a in access] == [("shutting_down", 200)]
    # The worker still listened while the gateway stopped: no probe failed, no worker went unhealthy.
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("gateway.") and r.levelno >= logging.WARNING]
    assert not warnings
    record = engine.wait_for(lambda: next((r for r in engine.records if r.finished_at), None), timeout=5)
    assert record.aborted and not record.completed


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


def test_the_several_models_demo_serves_every_model_adapter_and_embeddings() -> None:
    """config/demo-models.yaml, on free ports: each model, the declared and the on-demand LoRA
    adapter reach their pools, and the embedding model's pool of simulated pooling workers embeds."""
    data = yaml.safe_load((REPO_ROOT / "config" / "demo-models.yaml").read_text())
    for entry in data["pools"]:
        entry["workers"] = [f"http://127.0.0.1:{free_port()}" for _ in entry["workers"]]
    data["affinity"] = {"key_prefix": "kgw:test-demo-models"}
    config = parse_config(data, environ={})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving_demo(demo_servers(config, "127.0.0.1", port)), httpx.Client(base_url=url, timeout=10) as client:
        assert wait_listening(url).json()["ready"] is True
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert listed[:6] == ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3", "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B",
                              "qwen3-embedding-8b"]
        pools = {}
        for model in ("kimi-k3", "qwen3-30b-a3b", "sql-lora", "support-lora"):
            answer = client.post("/v1/chat/completions", json={**CHAT, "model": model, "max_tokens": 2})
            assert answer.status_code == 200, answer.text
            pools[model] = answer.headers["x-kimi-gateway-pool"]
        assert pools == {"kimi-k3": "vllm-128k", "qwen3-30b-a3b": "small", "sql-lora": "vllm-128k",
                         "support-lora": "vllm-128k"}
        embedded = client.post("/v1/embeddings", json={"model": "qwen3-embedding-8b", "input": ["a", "b"]})
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"]) == 2 and embedded.headers["x-kimi-gateway-pool"] == "embed"
