"""Concurrency limits per worker and per pool, with a bounded wait queue and saturated spillover."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import httpx
import redis

from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
REDIS_URL = shared_redis_url()
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


def _most_at_once(records: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals open at one moment."""
    edges = sorted([(start, 1) for start, _ in records] + [(end, -1) for _, end in records])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_limits_hold_when_the_affinity_lookup_awaits_redis(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # The Redis lookup awaits between the room check and taking the slot; every request used to pass
    # the check during that await, so 8 streams ran at once through a pool limited to 2.
    prefix = f"test-cap-{uuid.uuid4().hex[:10]}"
    sims = [start_sim("vllm", tpot_s=0.02) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, max_in_flight=2,
                             max_in_flight_per_worker=1, spillover=False)],
                       redis_url=REDIS_URL, affinity={"key_prefix": prefix}, load={"enabled": False})
    try:
        def post(i: int) -> httpx.Response:
            body = {**CHAT, "messages": [{"role": "user", "content": f"conversation {i}"}], "max_tokens": 10}
            return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30)

        runs = [in_background(lambda i=i: post(i)) for i in range(8)]
        for thread, _ in runs:
            thread.join()
        assert all(out[0].status_code == 200 for _, out in runs)
        # The engine notes an answer's end just after its last write: allow it 5 ms to do so.
        spans = [[(r.received_at, (r.finished_at or r.received_at) - 0.005) for r in s.engine.records] for s in sims]
        assert sum(map(len, spans)) == 8 and _most_at_once([span for one in spans for span in one]) <= 2
        assert all(_most_at_once(one) == 1 for one in spans)
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
