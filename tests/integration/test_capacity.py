"""Concurrency limits per worker and per pool, with a bounded wait queue and saturated spillover."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}


def in_background(fn: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_full_worker_makes_requests_wait_then_refuses_beyond_the_queue(start_sim: StartSim,
                                                                       start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.02)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_in_flight_per_worker=2, max_queue=1,
                             queue_timeout=5)])

    def post(tokens: int) -> httpx.Response:
        return httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": tokens}, timeout=30)

    busy = [in_background(lambda: post(40)) for _ in range(2)]          # ~0.8 s each: both slots
    wait_until(lambda: len(sim.engine.records) == 2)
    queued = in_background(lambda: post(1))                             # waits for a slot
    time.sleep(0.2)
    assert len(sim.engine.records) == 2                                 # not sent yet: queued
    started = time.monotonic()
    refused = post(1)                                                   # the queue (1) is full
    assert time.monotonic() - started < 0.5
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_overloaded"
    for thread, _ in [*busy, queued]:
        thread.join()
    assert all(out[0].status_code == 200 for _, out in [*busy, queued])
    assert max(r.received_at for r in sim.engine.records) > min(r.finished_at or 0 for r in sim.engine.records)


def test_queue_timeout_is_a_503(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, max_in_flight=1, queue_timeout=0.3)])
    thread, _ = in_background(lambda: httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 40},
                                                 timeout=30))
    wait_until(lambda: len(sim.engine.records) == 1)
    started = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=30)
    assert 0.25 < time.monotonic() - started < 1.5
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_overloaded"
    thread.join()


def test_saturated_pool_spills_over_to_a_larger_one(start_sim: StartSim, start_gateway: StartGateway) -> None:
    small, big = start_sim("vllm", tpot_s=0.02), start_sim("sglang")
    gw = start_gateway([pool("small", "vllm", [small.url], 131072, max_in_flight_per_worker=1),
                        pool("big", "sglang", [big.url], 524288)])
    thread, first = in_background(lambda: httpx.post(gw.v1 + "/chat/completions",
                                                     json={**CHAT, "max_tokens": 40}, timeout=30))
    wait_until(lambda: len(small.engine.records) == 1)
    second = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=30)
    thread.join()
    assert first[0].headers["x-kimi-gateway-pool"] == "small"
    assert second.headers["x-kimi-gateway-pool"] == "big"
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_spillovers_total{cause="saturated",from_pool="small",to_pool="big"} 1.0' in metrics
