"""Worker health against real simulated engines: ejection and re-admission, Retry-After, a
deadlocked engine that accepts connections but never answers its health check."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def send(gw: RunningGateway) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)


def test_burst_of_500s_ejects_then_the_worker_comes_back(start_sim: StartSim, start_gateway: StartGateway) -> None:
    flaky = start_sim("vllm", faults=SimFaults(fail_status=500, fail_count=3))
    steady = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [flaky.url, steady.url], 131072, policy="round_robin")],
                       health={"interval": 60, "passive_failures": 3, "ejection_base": 2.0})
    for _ in range(6):  # every request succeeds: the failures fail over to the steady worker
        assert send(gw).status_code == 200
    assert len(flaky.engine.records) == 3
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_worker_ejections_total{pool="p",worker="p/0"} 1.0' in metrics
    assert 'kimi_gateway_worker_ejected{pool="p",worker="p/0"} 1.0' in metrics
    assert 'kimi_gateway_retries_total{cause="status_5xx",pool="p"} 3.0' in metrics
    ejected = httpx.get(gw.url + "/ready").json()["pools"]["p"][0]
    assert ejected["ejected"] is True and ejected["healthy"] is True
    for _ in range(4):  # within the 2 s ejection (4 requests of ~0.1 s, even on a loaded machine)
        assert send(gw).headers["x-kimi-gateway-worker"] == "p/1"
    deadline = time.monotonic() + 10  # the ejection ends: half-open, and the fault has run out
    while httpx.get(gw.url + "/ready").json()["pools"]["p"][0]["ejected"]:
        assert time.monotonic() < deadline, "the ejection must end after ejection_base"
        time.sleep(0.05)
    workers = {send(gw).headers["x-kimi-gateway-worker"] for _ in range(4)}
    assert workers == {"p/0", "p/1"}
    assert httpx.get(gw.url + "/ready").json()["pools"]["p"][0]["ejections"] == 0
    assert gw.metric('kimi_gateway_worker_ejected{pool="p",worker="p/0"}') == 0


def test_429_retry_after_is_respected_for_that_worker(start_sim: StartSim, start_gateway: StartGateway) -> None:
    busy = start_sim("vllm", faults=SimFaults(fail_status=429, fail_count=1, retry_after_s=1))
    other = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [busy.url, other.url], 131072, policy="round_robin")],
                       health={"interval": 60})
    assert send(gw).headers["x-kimi-gateway-worker"] == "p/1"   # 429 from p/0, then p/1
    for _ in range(4):                                          # p/0 rests for its Retry-After
        assert send(gw).headers["x-kimi-gateway-worker"] == "p/1"
    time.sleep(1.1)
    assert {send(gw).headers["x-kimi-gateway-worker"] for _ in range(4)} == {"p/0", "p/1"}
    assert len(busy.engine.records) >= 2


def test_engine_that_never_answers_health_is_taken_out(start_sim: StartSim, start_gateway: StartGateway) -> None:
    stuck = start_sim("vllm", faults=SimFaults(hang_health=True))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [stuck.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 0.2, "timeout": 1.0})
    deadline = time.monotonic() + 5
    while httpx.get(gw.url + "/ready").json()["pools"]["p"][0]["healthy"]:
        assert time.monotonic() < deadline, "the probe timeout must mark the worker unhealthy"
        time.sleep(0.1)
    assert {send(gw).headers["x-kimi-gateway-worker"] for _ in range(4)} == {"p/1"}


def test_first_byte_budget_catches_a_hung_worker_even_with_a_long_gap_timeout(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    hung = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [hung.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60},
                       timeouts={"first_byte_base": 0.5, "first_byte_per_1k_tokens": 0, "read": 120})
    started = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    assert time.monotonic() - started < 3
    assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/1"
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    hung.engine.wait_for(lambda: all(r.aborted for r in hung.engine.records), timeout=5)


def test_streams_that_break_after_the_first_byte_eject_the_worker(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    broken = start_sim("vllm", faults=SimFaults(drop_after_chunks=2))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [broken.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60, "passive_failures": 3, "ejection_base": 30})
    body = {**CHAT, "stream": True, "max_tokens": 10}
    outcomes = []
    for _ in range(10):
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=10) as response:
            outcomes.append((response.headers["x-kimi-gateway-worker"], b"[DONE]" in response.read()))
    # Three broken streams (each finished on p/1 by migration: the client still gets [DONE]), then ejected.
    assert [worker for worker, _ in outcomes].count("p/0") == 3 and all(ok for _, ok in outcomes)
    assert gw.metric('kimi_gateway_migrations_total{outcome="migrated",pool="p"}') == 3
    assert all(ok for worker, ok in outcomes if worker == "p/1")
    assert outcomes[-4:] == [("p/1", True)] * 4
    assert httpx.get(gw.url + "/ready").json()["pools"]["p"][0]["ejected"] is True


def _state(gw: RunningGateway, worker: str) -> str:
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    return next(w["state"] for w in workers if w["id"] == worker)


def _wait_for_state(gw: RunningGateway, worker: str, state: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while _state(gw, worker) != state:
        assert time.monotonic() < deadline, f"{worker} never became {state}: {_state(gw, worker)}"
        time.sleep(0.05)


# A non-streamed answer budget of ~80 s (the clients give up after 1 s), and a no-token answer
# budget (`silence_limit`) of 0.4 s.
PATIENT_BUDGETS = {"first_byte_base": 0.2, "first_byte_per_1k_tokens": 0, "generation": 0.2,
                   "generation_per_token": 80}


def test_clients_hanging_up_on_a_wedged_worker_eject_it(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A worker that accepts requests and never answers, its health probe green (issue 26 §10): a
    non-streamed request's own budget outlasts its client, but each client that hangs up after the
    no-token answer budget without a byte from the worker counts against it; after two it is
    ejected and new requests go to the other worker."""
    wedged = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    steady = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [wedged.url, steady.url], 131072, policy="round_robin")],
                       timeouts=PATIENT_BUDGETS, health={"interval": 0.2, "passive_failures": 2, "ejection_base": 60})
    hung_up = 0
    for _ in range(6):
        try:
            answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=1.0)
        except httpx.ReadTimeout:
            hung_up += 1
            continue
        assert answer.status_code == 200 and answer.headers["x-kimi-gateway-worker"] == "p/1"
        if hung_up >= 2:
            break
    assert hung_up >= 2
    _wait_for_state(gw, "p/0", "ejected")  # (the last hang-up is judged as the gateway sees it)
    assert _state(gw, "p/1") == "healthy"
    assert {send(gw).headers["x-kimi-gateway-worker"] for _ in range(4)} == {"p/1"}
    assert len(wedged.engine.records) == hung_up


def test_quick_hang_ups_and_hang_ups_on_a_busy_worker_eject_nobody(start_sim: StartSim,
                                                                    start_gateway: StartGateway) -> None:
    """No false positives: a client that gives up before the no-token answer budget says nothing of
    its worker; nor does one that waited longer on a worker that answered other requests meanwhile
    (busy, not wedged). With one failure to eject, the worker stays in."""
    slow = start_sim("vllm", ttft_s=1.5)
    gw = start_gateway([pool("p", "vllm", [slow.url], 131072)],
                       timeouts={**PATIENT_BUDGETS, "first_byte_base": 1.0, "generation": 1.0},
                       health={"interval": 60, "passive_failures": 1, "ejection_base": 60})
    for _ in range(2):  # gone after 0.3 s, under the 2 s no-token answer budget
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=0.3)
    gw.wait_until_idle()
    assert _state(gw, "p/0") == "healthy"

    busy = start_sim("vllm", ttft_s=0.2, tpot_s=0.02)
    gw = start_gateway([pool("p", "vllm", [busy.url], 131072)], timeouts=PATIENT_BUDGETS,
                       health={"interval": 60, "passive_failures": 1, "ejection_base": 60})

    def impatient() -> float:  # a 200-token answer (4 s): gone after 1 s, over the 0.4 s no-token budget
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 200}, timeout=1.0)
        return time.monotonic() - started

    with ThreadPoolExecutor(1) as pool_:
        waited = pool_.submit(impatient)
        time.sleep(0.1)
        assert send(gw).status_code == 200  # meanwhile the worker answers another request
        assert waited.result() >= 0.9
    gw.wait_until_idle()
    assert _state(gw, "p/0") == "healthy"


# SGLang's generating /health, shortened: it looks for scheduler output every 0.05 s and gives up
# (503) after 0.5 s; a 40,000-token prompt at 1,000 tokens/s keeps the scheduler in one prefill
# for 40 s, far longer than any step of these tests (the client leaves early to end it).
SGLANG_HEALTH = {"health_generate_poll_s": 0.05, "health_generate_timeout_s": 0.5, "prefill_tokens_per_s": 1000.0}
LONG_PROMPT = {**CHAT, "messages": [{"role": "user", "content": "word " * 32000}], "stream": True}


def _hold_a_long_prefill(url: str, leave: threading.Event) -> None:
    """Stream a long-prefill request to a simulated engine (which sends its headers at once) until
    `leave` is set, then hang up, which ends the prefill."""
    with httpx.stream("POST", url + "/chat/completions", json=LONG_PROMPT, timeout=60) as response:
        assert response.status_code == 200
        leave.wait(60)


def test_sglang_sim_health_runs_a_generation_and_ready_answers_at_once(start_sim: StartSim) -> None:
    """The simulator's SGLang imitates 0.5.23: `/health` (= `/health_generate`) waits for scheduler
    output, so it fails while one long prefill holds the scheduler; `/ready` and `/model_info` answer at
    once."""
    sim = start_sim("sglang", **SGLANG_HEALTH)
    idle = httpx.get(sim.url + "/health", timeout=10)
    assert idle.status_code == 200 and idle.content == b""
    assert idle.elapsed.total_seconds() >= 0.05  # at its first look, never before
    assert httpx.get(sim.url + "/health_generate", timeout=10).status_code == 200
    leave = threading.Event()
    with ThreadPoolExecutor(1) as pool_:
        held = pool_.submit(_hold_a_long_prefill, sim.url + "/v1", leave)
        sim.engine.wait_for(lambda: sim.engine.stats().running == 1 or None, timeout=10)
        try:
            assert httpx.get(sim.url + "/health", timeout=10).status_code == 503
            assert httpx.get(sim.url + "/ready", timeout=10).status_code == 200
            info = httpx.get(sim.url + "/model_info", timeout=10)
            assert info.status_code == 200 and info.json()["model_path"] == "kimi-k3"
            assert httpx.get(sim.url + "/get_model_info", timeout=10).json() == info.json()
        finally:
            leave.set()
            held.result(timeout=30)
    sim.engine.wait_for(lambda: sim.engine.stats().running == 0 or None, timeout=10)
    assert httpx.get(sim.url + "/health", timeout=10).status_code == 200


def test_a_sglang_worker_busy_with_a_long_prefill_stays_healthy(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    """The gateway probes SGLang on its instant `/ready` (`engine_kinds.PROBES`), not on its
    generating `/health`, which fails while a long prefill runs: the busy worker stays healthy. (The
    long request goes to the worker directly: the gateway would hold its client's headers until the
    first token, so the client could not leave early.)"""
    busy = start_sim("sglang", **SGLANG_HEALTH)
    gw = start_gateway([pool("p", "sglang", [busy.url], 131072)], health={"interval": 0.1, "timeout": 1.0},
                       load={"enabled": False})
    leave = threading.Event()
    with ThreadPoolExecutor(1) as pool_:
        held = pool_.submit(_hold_a_long_prefill, busy.url + "/v1", leave)
        try:
            busy.engine.wait_for(lambda: busy.engine.stats().running == 1 or None, timeout=10)
            probes = busy.engine.health_checks
            busy.engine.wait_for(lambda: busy.engine.health_checks >= probes + 4 or None, timeout=20)
            assert httpx.get(busy.url + "/health", timeout=10).status_code == 503  # its own /health fails meanwhile
            assert busy.engine.stats().running == 1  # (still in the prefill)
            assert _state(gw, "p/0") == "healthy"
        finally:
            leave.set()
            held.result(timeout=30)
