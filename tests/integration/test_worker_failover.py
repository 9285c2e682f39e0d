"""A request moves to another worker when its worker fails (issue 4's done-when list): one that hangs
before its headers (streaming, and non-streaming after its budget), and a worker process killed with
SIGKILL in the middle of a stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import REPO_ROOT, RunningGateway, RunningSim, free_port, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SHORT_FIRST_BYTE = {"first_byte_base": 0.5, "first_byte_per_1k_tokens": 0, "read": 0.5}


def test_streaming_request_fails_over_from_a_worker_that_hangs_before_headers(start_sim: StartSim,
                                                                              start_gateway: StartGateway) -> None:
    hung = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [hung.url, good.url], 131072, policy="round_robin")],
                       timeouts=SHORT_FIRST_BYTE)
    started = time.monotonic()
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        body = b"".join(response.iter_raw())
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert response.headers["x-kimi-gateway-worker"] == "p/1"
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert body.rstrip().endswith(b"data: [DONE]")
    assert 0.4 < elapsed < 5, elapsed  # one first-byte budget spent on the hung worker, not more
    assert len(hung.engine.records) == 1 and len(good.engine.records) == 1
    record = hung.engine.wait_for(lambda: next((r for r in hung.engine.records if r.aborted), None), timeout=5)
    assert record.first_byte_at is None
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_upstream_attempts_total{outcome="timeout",pool="p",worker="p/0"} 1.0' in metrics


def test_non_streaming_request_to_a_hung_worker_goes_to_another_after_its_budget(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # A worker that sent no headers is not generating (issue 10 §2): after the answer budget the
    # request is retried elsewhere, and the hang counts toward the worker's outlier ejection.
    hung = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [hung.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60},
                       timeouts={**SHORT_FIRST_BYTE, "generation": 0.5, "generation_per_token": 0})
    started = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-worker"] == "p/1" and response.headers["x-kimi-gateway-attempts"] == "2"
    assert 0.9 < time.monotonic() - started < 5  # one answer budget (0.5 + 0.5 s) on the hung worker
    hung.engine.wait_for(lambda: all(r.aborted for r in hung.engine.records) or None, timeout=5)
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="timeout",pool="p",worker="p/0"}') == 1
    hung_state = httpx.get(gw.url + "/admin/workers/p/0").json()
    assert hung_state["consecutive_failures"] == 1 and "no response headers" in hung_state["last_error"]


# --- a worker process killed mid-stream ----------------------------------------------------------



@pytest.fixture
def sim_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A simulated vLLM engine as a real process (`kimi-gateway sim`), slow enough to kill mid-stream."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--engine", "vllm", "--port", str(port),
                             "--ttft", "0", "--tpot", "0.05"], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the simulator process exited"
        assert time.monotonic() < deadline, "the simulator process did not start"
        time.sleep(0.1)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_worker_killed_mid_stream_continues_on_the_other_worker(
        sim_process: tuple[subprocess.Popen[bytes], str], start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Issue 23: the stream migrates to the other worker, and the client reads one uninterrupted answer.
    proc, doomed_url = sim_process
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [doomed_url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})  # only the request path may notice the death
    body = {**CHAT, "stream": True, "max_tokens": 400}  # ~20 s at 50 ms a token
    uninterrupted = httpx.post(good.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
    events: list[bytes] = []
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["x-kimi-gateway-worker"] == "p/0"
        buffer = b""
        killed = False
        for chunk in response.iter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append(event)
            if not killed and len(events) >= 3:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
        assert buffer == b""
    assert killed
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events if e.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == uninterrupted.json()["choices"][0]["message"]["content"]
    assert len({c["id"] for c in chunks}) == 1
    assert any(e.startswith(b": x-kimi-gateway-migrated from=p/0 to=p/1") for e in events)

    # The mid-stream failure counted against the dead worker at once (passive health)...
    dead = httpx.get(gw.url + "/ready").json()["pools"]["p"][0]
    assert "mid-stream" in (dead["last_error"] or ""), dead
    # ...and the next requests all succeed on the other worker: the first one round robin sends to
    # the dead worker gets "connect refused", fails over at once (2 attempts) and marks it
    # unhealthy, so every later request takes 1 attempt.
    workers = []
    for stream in (False, True, False, True):
        response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
        assert response.status_code == 200, response.text
        workers.append((response.headers["x-kimi-gateway-worker"], response.headers["x-kimi-gateway-attempts"]))
    assert all(worker == "p/1" for worker, _ in workers), workers
    attempts = [a for _, a in workers]
    assert attempts.count("2") <= 1 and set(attempts) <= {"1", "2"}, workers
    assert attempts[-1] == "1" and attempts[-2] == "1", workers
    ready = httpx.get(gw.url + "/ready")
    assert ready.status_code == 200  # the pool still has a healthy worker
    states = {w["id"]: w["healthy"] for w in ready.json()["pools"]["p"]}
    assert states == {"p/0": False, "p/1": True}, ready.json()
