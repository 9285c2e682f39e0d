"""Health probes and load scrapes against real loopback servers: they carry the pool's key, say
the real cause of a failure, and stay bounded (overall deadline, capped body, one loop per
worker) when a worker trickles or streams forever."""

from __future__ import annotations

import asyncio
import gzip
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import pytest

from gateway.backends.control import ControlError, control_get
from gateway.backends.h1 import HIGH_WATER, H1Pool
from gateway.config import parse_config
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from gateway.state import AppState
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MIB = 1 << 20


def workers(gw: RunningGateway, name: str = "p") -> list[dict[str, Any]]:
    """Every worker's snapshot of pool `name` (`/ready` lists them with auth off)."""
    return list(httpx.get(gw.url + "/ready", timeout=5).json()["pools"][name])


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `check` until true; the seconds it took. AssertionError naming `what` after `timeout`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - started


@asynccontextmanager
async def app_state(pools: list[dict[str, Any]], **settings: Any) -> AsyncIterator[AppState]:
    """The gateway's state for `pools` without its background loops (the test calls probes itself)."""
    state = AppState.build(parse_config({"pools": pools, **settings}, environ={}))
    try:
        yield state
    finally:
        await state.http.aclose()
        state.control.close()


# --- issue 10 §5: every call to a worker carries the pool's credentials -------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_probes_and_scrapes_carry_the_pool_key_through_a_proxy_that_guards_every_path(
        start_sim: StartSim, start_gateway: StartGateway, engine: str) -> None:
    guarded = [start_sim(engine, api_key="pool-key-1", api_key_scope="all") for _ in range(2)]
    gw = start_gateway([pool("p", engine, [s.url for s in guarded], 131072, api_key="pool-key-1")],
                       health={"interval": 0.1, "timeout": 1.0}, load={"interval": 0.1})
    wait_until(lambda: all(s.engine.health_checks >= 2 for s in guarded), 10,
               "two probes of each worker that the proxy let through")
    wait_until(lambda: all(w["engine_running"] is not None for w in workers(gw)), 10, "a scrape of each worker")
    assert [(w["state"], w["last_error"]) for w in workers(gw)] == [("healthy", None)] * 2
    assert httpx.get(gw.url + "/ready").status_code == 200
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_a_key_the_worker_refuses_is_named_as_the_probe_failure(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    guarded = start_sim("vllm", api_key="pool-key-1", api_key_scope="all")
    gw = start_gateway([pool("p", "vllm", [guarded.url], 131072, api_key="not-the-key")],
                       health={"interval": 0.1, "timeout": 1.0}, load={"enabled": False})
    wait_until(lambda: workers(gw)[0]["state"] == "unhealthy", 10, "the refused worker marked unhealthy")
    error = workers(gw)[0]["last_error"]
    assert "HTTP 401" in error and "credentials" in error and "api_key" in error
    assert "not-the-key" not in error


# --- issue 10 §9: probe errors say the real cause --------------------------------------------------------


def test_a_worker_host_that_does_not_resolve_is_reported_as_such(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    # `.invalid` is reserved (RFC 6761 §6.4): no resolver answers it, so getaddrinfo fails.
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", ["http://kimi-worker-7.invalid:8000", good.url], 131072)],
                       health={"interval": 0.2, "timeout": 5.0}, load={"enabled": False})
    wait_until(lambda: workers(gw)[0]["state"] == "unhealthy", 10, "the unresolvable worker marked unhealthy")
    error = workers(gw)[0]["last_error"]
    assert "'kimi-worker-7.invalid' does not resolve" in error, error
    assert "ConnectError" not in error


def test_refused_and_silent_workers_are_reported_with_their_cause(start_sim: StartSim, start_gateway: StartGateway,
                                                                  unused_port: int) -> None:
    silent = start_sim("vllm", faults={"hang_health": True})
    gw = start_gateway([pool("p", "vllm", [f"http://127.0.0.1:{unused_port}", silent.url], 131072)],
                       health={"interval": 0.2, "timeout": 0.4}, load={"enabled": False})
    wait_until(lambda: all(w["state"] == "unhealthy" for w in workers(gw)), 10, "both workers marked unhealthy")
    refused, hung = (w["last_error"] for w in workers(gw))
    assert refused == "health probe failed: connection to 127.0.0.1 refused"
    assert hung == "health probe failed: no complete answer within 0.4 s (waiting for the response headers)"


# --- issue 15 §3: bounded probes and scrapes, one loop per worker -----------------------------------------


@contextmanager
def peak_traced_memory() -> Iterator[list[int]]:
    """Trace allocations of the block; the list holds the peak (bytes) once it exits."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.anyio
async def test_an_endless_metrics_body_is_cut_at_the_cap_and_memory_stays_bounded(start_sim: StartSim) -> None:
    endless = start_sim("vllm", faults={"metrics_body": "endless"})
    async with app_state([pool("p", "vllm", [endless.url], 131072)], load={"timeout": 5.0}) as state:
        worker = next(iter(state.registry))
        with peak_traced_memory() as peak:
            async with asyncio.timeout(8):  # without a cap the scrape reads for ever
                updated = await state.load.scrape(worker)
        assert updated is False
        assert state.load.failures[worker.id] == "body larger than 1048576 bytes"
        assert peak[0] < 8 * MIB, f"the scrape held {peak[0]} bytes"
        # the same call, seen from the bytes read: the cap plus at most what the connection buffers
        # before it pauses reading (h1.HIGH_WATER) and one socket read (asyncio's 256 KiB)
        with pytest.raises(ControlError) as cut:
            await control_get(state.control, endless.url + "/metrics", {}, 5.0, MIB)
        assert MIB < cut.value.bytes_read <= MIB + HIGH_WATER + 256 * 1024
        endless.engine.set_faults(endless.engine.faults.model_copy(update={"metrics_body": "normal"}))
        assert await state.load.scrape(worker) is True and worker.id not in state.load.failures


@pytest.mark.anyio
async def test_an_endless_health_body_fails_the_probe_within_its_cap(start_sim: StartSim) -> None:
    endless = start_sim("sglang", faults={"health_body": "endless"})
    async with app_state([pool("p", "sglang", [endless.url], 131072)], health={"timeout": 5.0}) as state:
        worker = next(iter(state.registry))
        with peak_traced_memory() as peak:
            async with asyncio.timeout(8):
                assert await state.health.probe(worker) is False
        assert worker.healthy is False and worker.last_error == "health probe failed: body larger than 1048576 bytes"
        assert peak[0] < 8 * MIB, f"the probe held {peak[0]} bytes"


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_a_trickled_body_fails_at_the_overall_deadline(start_sim: StartSim, path: str) -> None:
    # every byte comes well within any per-read timeout, so only an overall deadline can end the call
    trickler = start_sim("vllm", faults={"health_body": "trickle", "metrics_body": "trickle",
                                         "trickle_interval_s": 0.05})
    async with app_state([pool("p", "vllm", [trickler.url], 131072)],
                         health={"timeout": 0.5}, load={"timeout": 0.5}) as state:
        worker = next(iter(state.registry))
        async with asyncio.timeout(5):
            if path == "/health":
                assert await state.health.probe(worker) is False
                error = worker.last_error
            else:
                assert await state.load.scrape(worker) is False
                error = state.load.failures[worker.id]
    assert error is not None and "no complete answer within 0.5 s (reading the body, " in error, error
    assert worker.healthy is (path == "/metrics")


@asynccontextmanager
async def raw_server(answer: Callable[[asyncio.StreamWriter], Any]) -> AsyncIterator[str]:
    """A loopback HTTP/1.1 server that reads a request head and lets `answer(writer)` reply; its URL."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await answer(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.anyio
async def test_hostile_answers_fail_with_their_cause() -> None:
    async def trickle_headers(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while True:  # one header byte every 50 ms, for ever
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def gzip_bomb(writer: asyncio.StreamWriter) -> None:
        body = gzip.compress(b"0" * (16 * MIB))  # 16 KiB that would inflate to 16 MiB
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def hang_up(writer: asyncio.StreamWriter) -> None:
        pass  # the request is read, then the connection closed without a word

    async def not_http(writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")  # something else listens on the worker's port
        await writer.drain()

    client = H1Pool(5.0)
    try:
        async with raw_server(hang_up) as url, asyncio.timeout(5):
            with pytest.raises(ControlError,
                               match=r"^the worker broke the HTTP exchange \(the engine closed the connection\)$"):
                await control_get(client, url + "/health", {}, 2.0, MIB)
        async with raw_server(not_http) as url, asyncio.timeout(5):
            with pytest.raises(ControlError, match=r"^the worker broke the HTTP exchange \("):
                await control_get(client, url + "/health", {}, 2.0, MIB)
        async with raw_server(trickle_headers) as url, asyncio.timeout(5):
            with pytest.raises(ControlError, match=r"within 0.3 s \(waiting for the response headers\)"):
                await control_get(client, url + "/health", {}, 0.3, MIB)
        async with raw_server(gzip_bomb) as url, asyncio.timeout(5):
            with pytest.raises(ControlError, match=r"compressed body \(Content-Encoding: gzip\)"):
                await control_get(client, url + "/metrics", {}, 2.0, MIB)
    finally:
        client.close()


def test_a_restarted_worker_turns_healthy_within_the_interval_while_a_neighbour_trickles(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    trickler = start_sim("vllm", faults={"health_body": "trickle", "metrics_body": "trickle",
                                         "trickle_interval_s": 0.05})
    victim = start_sim("vllm")
    interval = 0.3
    gw = start_gateway([pool("p", "vllm", [trickler.url, victim.url], 131072)],
                       health={"interval": interval, "timeout": 1.0}, load={"interval": interval, "timeout": 1.0})
    wait_until(lambda: workers(gw)[0]["state"] == "unhealthy", 10, "the trickling worker marked unhealthy")
    assert "no complete answer within 1 s (reading the body" in workers(gw)[0]["last_error"]
    port = victim.server.port
    victim.server.stop()
    wait_until(lambda: workers(gw)[1]["state"] == "unhealthy", 10,
               "the killed worker marked unhealthy (its probes must not wait for the trickling neighbour)")
    restarted = ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=131072)), port=port)
    restarted.start()
    try:
        # a probe every 0.3 s, each behind none of the trickler's 1 s ones: healthy within a few intervals
        wait_until(lambda: workers(gw)[1]["state"] == "healthy", 10 * interval, "the restarted worker healthy again")
        assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).headers["x-kimi-gateway-worker"] == "p/1"
    finally:
        restarted.stop()


@pytest.mark.anyio
async def test_only_an_address_nothing_serves_counts_as_gone() -> None:
    """`ControlError.gone` (what lets a drain lift for a new engine): a refused connection or a name
    that does not resolve is an engine gone; a slow answer or a broken exchange is not."""
    async def silent(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)  # a busy engine: the connection is there, no answer comes

    async def hang_up(writer: asyncio.StreamWriter) -> None:
        pass

    client = H1Pool(5.0)
    try:
        async with raw_server(hang_up) as url:
            closed = url  # the server closes when the block ends: nothing listens there any more
        for gone_url in (closed, "http://no-such-engine.invalid:8000"):
            with pytest.raises(ControlError) as refused:
                await control_get(client, gone_url + "/health", {}, 2.0, MIB)
            assert refused.value.gone, refused.value
        for answer in (silent, hang_up):
            async with raw_server(answer) as url:
                with pytest.raises(ControlError) as there:
                    await control_get(client, url + "/health", {}, 0.3, MIB)
                assert not there.value.gone, there.value
    finally:
        client.close()
