"""Graceful shutdown of a real `kimi-gateway serve` process on SIGTERM (gateway/serving/lifecycle.py), and
the accounting of requests a plain uvicorn server (no drain, no guard) cancels when it stops.

The gateway runs as a subprocess (signals, exit status and the listener are the real ones); the
simulated engines run in this process, so their request records show what the engine saw.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.app import create_app
from gateway.auth.keys import hash_key
from gateway.config import parse_config
from gateway.serving.request_head import http_options
from gateway.serving.server import ThreadedServer
from tests.support import GatewayProcess, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}
STREAMS = 20
DONE = b"data: [DONE]\n\n"


def fresh_client() -> httpx.AsyncClient:
    """A client that opens a new connection for every request (to see the listener itself)."""
    return httpx.AsyncClient(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


async def read_stream(client: httpx.AsyncClient, url: str, max_tokens: int, flowing: asyncio.Event) -> bytes:
    """The whole body of one streamed chat completion; sets `flowing` at its first bytes."""
    body = {**CHAT, "stream": True, "max_tokens": max_tokens}
    received = b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            received += chunk
            flowing.set()
    return received


async def start_streams(url: str, client: httpx.AsyncClient, max_tokens: int) -> list[asyncio.Task[bytes]]:
    """`STREAMS` concurrent streams, returned once every one of them has received bytes."""
    flowing = [asyncio.Event() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(read_stream(client, url, max_tokens, event)) for event in flowing]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), timeout=10)
    return tasks


async def within(seconds: float, check: Callable[[], Awaitable[bool]]) -> float:
    """Poll `check` every 10 ms until it is True; the seconds it took. Fails after `seconds`."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < seconds, f"condition not met within {seconds} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def last_event(stream: bytes) -> dict[str, Any]:
    """The JSON of a stream's last `data:` event."""
    events = [e for e in stream.split(b"\n\n") if e.startswith(b"data: ")]
    return json.loads(events[-1].removeprefix(b"data: "))


def test_shutdown_config_defaults_and_bounds() -> None:
    pools = [pool("p", "vllm", ["http://127.0.0.1:9"], 131072)]
    shutdown = parse_config({"pools": pools}, environ={}).shutdown
    assert (shutdown.drain_delay, shutdown.grace_period) == (5.0, 30.0)
    with pytest.raises(ValidationError, match=r"shutdown\.grace_period"):
        parse_config({"pools": pools, "shutdown": {"grace_period": -1}}, environ={})


@pytest.mark.anyio
async def test_sigterm_drains_readiness_then_lets_in_flight_streams_finish(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm", ttft_s=0.05, tpot_s=0.05)  # 60 tokens: ~3 s a stream
    drain, grace = 1.0, 5.0
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)],
                               shutdown={"drain_delay": drain, "grace_period": grace})
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=50)) as client, \
            fresh_client() as probe:
        streams = await start_streams(gw.url, client, max_tokens=60)
        sigterm_at = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)

        # 1. Readiness turns 503 first, while the listener is still open and the streams flow.
        async def draining() -> bool:
            response = await probe.get(gw.url + "/ready")
            return response.status_code == 503 and response.json()["draining"] is True

        await within(drain / 2, draining)
        assert not any(s.done() for s in streams)
        # Requests that still arrive during the drain delay are served normally.
        assert (await probe.get(gw.url + "/health")).status_code == 200
        late = await probe.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert late.status_code == 200 and late.json()["choices"][0]["message"]["content"]

        # 2. After the drain delay the listener is closed: new connections are refused.
        async def refused() -> bool:
            try:
                await probe.get(gw.url + "/health")
            except httpx.ConnectError:
                return True
            except (httpx.ReadError, httpx.RemoteProtocolError):
                return False  # accepted just as the listener closed, then closed by the server
            return False

        await within(drain + 1.0, refused)
        assert time.monotonic() - sigterm_at >= drain - 0.05
        assert not all(s.done() for s in streams), "streams keep flowing after the listener closed"

        # 3. Every in-flight stream completes normally; then the process exits 0.
        bodies = await asyncio.wait_for(asyncio.gather(*streams), timeout=grace)
        assert all(body.endswith(DONE) and b'"error"' not in body for body in bodies)
        assert await gw.wait_exit(timeout=drain + grace + 3 - (time.monotonic() - sigterm_at)) == 0
    records = sim.engine.records
    assert len(records) == STREAMS + 1 and all(r.completed and not r.aborted for r in records)
    assert "Traceback" not in gw.log_text()


@pytest.mark.anyio
async def test_requests_past_the_grace_period_are_ended_and_aborted_upstream(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm", ttft_s=0.05, tpot_s=0.1)  # 500 tokens: ~50 s a stream
    drain, grace = 0.5, 1.0
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)],
                               shutdown={"drain_delay": drain, "grace_period": grace})
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=50)) as client:
        streams = await start_streams(gw.url, client, max_tokens=500)
        # One more request whose engine never answers: still waiting for its first byte at the end.
        waiting = asyncio.create_task(client.post(gw.url + "/v1/chat/completions",
                                                  json={**CHAT, "x_sim_faults": {"hang_before_headers": True}}))
        await sim.engine.async_wait_for(lambda: len(sim.engine.records) == STREAMS + 1)
        sigterm_at = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        assert await gw.wait_exit(timeout=drain + grace + 5) == 0
        took = time.monotonic() - sigterm_at
        assert drain + grace - 0.1 <= took <= drain + grace + 3
        bodies = await asyncio.wait_for(asyncio.gather(*streams), timeout=5)
        answer = await asyncio.wait_for(waiting, timeout=5)

    # The clients' answers end cleanly, as incomplete: one SSE error event and no [DONE] ...
    for body in bodies:
        assert not body.endswith(DONE)
        assert last_event(body)["error"]["code"] == "shutting_down"
    # ... or a 503 the client may retry elsewhere when nothing had been sent yet.
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
    assert answer.headers["retry-after"] == "1" and len(answer.headers["x-request-id"]) == 32
    # The access log tells a shutdown from a client hang-up.
    access = [json.loads(line[line.index("{"):]) for line in gw.log_text().splitlines() if '"event":"request"' in line]
    assert len(access) == STREAMS + 1
    assert {(a["outcome"], a["status"]) for a in access} == {("shutting_down", 200), ("shutting_down", 503)}
    assert answer.headers["x-request-id"] in {a["request_id"] for a in access if a["status"] == 503}
    # Every engine request was aborted: no upstream request outlived the gateway.
    records = await sim.engine.async_wait_for(lambda: sim.engine.records if all(
        r.aborted for r in sim.engine.records) else None, timeout=5)
    assert len(records) == STREAMS + 1 and not any(r.completed for r in records)
    assert "Traceback" not in gw.log_text()


@pytest.mark.anyio
async def test_with_auth_on_the_shutdown_503_still_names_the_request(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm")
    key = "sk-shutdown-" + "k" * 40
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)],
                               shutdown={"drain_delay": 0.2, "grace_period": 0.5},
                               auth={"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(key)}]})
    async with httpx.AsyncClient(timeout=30) as client:
        waiting = asyncio.create_task(client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "x_sim_faults": {"hang_before_headers": True}},
            headers={"authorization": f"Bearer {key}", "x-request-id": "hang-0"}))
        await sim.engine.async_wait_for(lambda: len(sim.engine.records) == 1)
        gw.proc.send_signal(signal.SIGTERM)
        answer = await asyncio.wait_for(waiting, timeout=10)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
    assert answer.headers["x-request-id"] == "hang-0" and answer.headers["retry-after"] == "1"
    assert await gw.wait_exit(timeout=10) == 0



def unguarded_gateway(sim: RunningSim) -> ThreadedServer:
    """A gateway in front of `sim` on plain uvicorn (no serve drain, no ShutdownGuard), as the demo
    runs it; its `stop()` cancels what still runs after uvicorn's 0.2 s graceful-shutdown timeout."""
    config = parse_config({"pools": [pool("p", "vllm", [sim.url], 131072)],
                           "health": {"interval": 0.5, "timeout": 1.0, "verify_models": False}}, environ={})
    return ThreadedServer(create_app(config), **http_options(config), timeout_graceful_shutdown=0.2).start()


def access_lines(caplog: pytest.LogCaptureFixture, server: ThreadedServer) -> list[dict[str, Any]]:
    """The access-log lines `server` wrote (by its thread's name), parsed."""
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "gateway.access" and r.threadName == server.thread_name]


@pytest.mark.anyio
async def test_without_the_guard_requests_uvicorn_cancels_at_shutdown_count_as_cut_by_it(
        start_sim: StartSim, caplog: pytest.LogCaptureFixture) -> None:
    """Plain uvicorn (the demo, tests' ThreadedServer): no drain, no guard; its own
    `timeout_graceful_shutdown` cancels what still runs. The clients are still connected and reading:
    the access log and `requests_total` say `shutting_down` (5xx), not a client disconnect."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", ttft_s=0.05, tpot_s=0.05)  # 400 tokens: ~20 s
    server = unguarded_gateway(sim)
    metrics = server.app.state.gateway.metrics
    async with httpx.AsyncClient(timeout=10) as client:
        waiting = asyncio.create_task(client.post(server.url + "/v1/chat/completions",
                                                  json={**CHAT, "x_sim_faults": {"hang_before_headers": True}}))
        async with client.stream("POST", server.url + "/v1/chat/completions",
                                 json={**CHAT, "stream": True, "max_tokens": 400}) as answer:
            assert answer.status_code == 200
            chunks = answer.aiter_raw()  # kept: dropping it would close the connection (a real hang-up)
            await anext(chunks)
            await sim.engine.async_wait_for(lambda: len(sim.engine.records) == 2)
            await asyncio.to_thread(server.stop)
            with pytest.raises(httpx.RemoteProtocolError):  # uvicorn closed the connection inside the body
                async for _ in chunks:
                    pass
        assert (await asyncio.wait_for(waiting, timeout=5)).status_code == 500  # uvicorn's own answer

    labels = {"api": "chat", "pool": "p", "model": "kimi-k3"}
    assert metrics.registry.get_sample_value("kimi_gateway_requests_total", {**labels, "status_class": "5xx"}) == 2
    assert metrics.registry.get_sample_value("kimi_gateway_requests_total", {**labels, "status_class": "4xx"}) is None
    access = access_lines(caplog, server)
    assert sorted((a["outcome"], a["status"]) for a in access) == [("shutting_down", 200), ("shutting_down", 500)]
    # Both engine requests were aborted.
    records = await sim.engine.async_wait_for(lambda: sim.engine.records if all(
        r.aborted for r in sim.engine.records) else None, timeout=5)
    assert len(records) == 2 and not any(r.completed for r in records)


async def stored_stream(url: str) -> tuple[str, int]:
    """A streamed background Responses API answer (the kind vLLM 0.32 replays) created through the
    gateway at `url`: its id and event count."""
    async with httpx.AsyncClient(timeout=30) as client:
        created = await client.post(url + "/v1/responses", json={"model": "kimi-k3", "input": "Count.",
                                                                 "max_output_tokens": 20, "stream": True,
                                                                 "background": True})
    assert created.status_code == 200
    events = [e for e in created.content.split(b"\n\n") if e.startswith(b"event: ")]
    first = json.loads(events[0].split(b"data: ", 1)[1])
    return first["response"]["id"], len(events)


async def replays_ended(sim: RunningSim) -> list[Any]:
    """The sim's stream replays once every one has ended (completed, or aborted by the gateway)."""
    return await sim.engine.async_wait_for(lambda: sim.app.responses.replays if sim.app.responses.replays and all(
        r.aborted or r.completed for r in sim.app.responses.replays) else None, timeout=5)


@pytest.mark.anyio
async def test_without_the_guard_a_replay_uvicorn_cancels_at_shutdown_counts_as_cut_by_it(
        start_sim: StartSim, caplog: pytest.LogCaptureFixture) -> None:
    """`GET /v1/responses/{id}?stream=true` still relaying when plain uvicorn stops: `shutting_down`
    (5xx), not the client disconnect (4xx) it was counted as; the engine's replay is closed."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", tpot_s=0.1)  # the replay sends one event per 0.1 s: ~2.8 s for 28 events
    server = unguarded_gateway(sim)
    metrics = server.app.state.gateway.metrics
    rid, count = await stored_stream(server.url)
    async with httpx.AsyncClient(timeout=10) as client, \
            client.stream("GET", f"{server.url}/v1/responses/{rid}", params={"stream": "true"}) as answer:
        assert answer.status_code == 200
        chunks = answer.aiter_raw()  # kept: dropping it would close the connection (a real hang-up)
        await anext(chunks)
        await asyncio.to_thread(server.stop)
        with pytest.raises(httpx.RemoteProtocolError):  # uvicorn closed the connection inside the body
            async for _ in chunks:
                pass

    labels = {"api": "responses_get", "pool": "p", "model": "none"}  # a stored response's route names no model
    assert metrics.registry.get_sample_value("kimi_gateway_requests_total", {**labels, "status_class": "5xx"}) == 1
    assert metrics.registry.get_sample_value("kimi_gateway_requests_total", {**labels, "status_class": "4xx"}) is None
    access = [a for a in access_lines(caplog, server) if a["api"] == "responses_get"]
    assert [(a["outcome"], a["status"]) for a in access] == [("shutting_down", 200)]
    [replay] = await replays_ended(sim)
    assert replay.aborted and replay.sent < count


@pytest.mark.anyio
async def test_a_replay_past_the_grace_period_is_ended_as_a_shutdown(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    """serve's ShutdownGuard hangs up on a replay still streaming at the end of the grace period: the
    client gets the SSE `shutting_down` event, the access log says `shutting_down` (not a client
    disconnect), and the engine's replay is closed."""
    sim = start_sim("vllm", tpot_s=0.1)  # ~2.8 s a replay
    drain, grace = 0.2, 0.5
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)],
                               shutdown={"drain_delay": drain, "grace_period": grace})
    rid, count = await stored_stream(gw.url)
    async with httpx.AsyncClient(timeout=10) as client, \
            client.stream("GET", f"{gw.url}/v1/responses/{rid}", params={"stream": "true"}) as answer:
        assert answer.status_code == 200
        chunks = answer.aiter_raw()
        body = await anext(chunks)
        gw.proc.send_signal(signal.SIGTERM)
        async for chunk in chunks:
            body += chunk
    assert await gw.wait_exit(timeout=drain + grace + 5) == 0
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]  # the Responses API's `event:` + `data:` lines
    assert json.loads(last.split(b"data: ", 1)[1])["error"]["code"] == "shutting_down"
    access = [json.loads(line[line.index("{"):]) for line in gw.log_text().splitlines()
              if '"event":"request"' in line and '"responses_get"' in line]
    assert [(a["outcome"], a["status"]) for a in access] == [("shutting_down", 200)]
    [replay] = await replays_ended(sim)
    assert replay.aborted and replay.sent < count
    assert "Traceback" not in gw.log_text()
