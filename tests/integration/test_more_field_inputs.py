"""Issue 10 and 15: more inputs of the kinds the issues name, beyond their own examples (the
filers keep some back): Retry-After as an HTTP date or an absurd number, engine failures that
differ only in ids, and streams that send a flood of content-less events before failing."""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate

import httpx

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_retry_after_as_an_http_date_is_honoured(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # RFC 9110 §10.2.3: Retry-After is delay-seconds or an HTTP-date; proxies in front of engines send dates.
    written = time.time()
    soon = formatdate(written + 8, usegmt=True)
    later = formatdate(written + 20, usegmt=True)
    a = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": later}))
    b = start_sim("vllm", faults=SimFaults(fail_status=429, fail_headers={"retry-after": soon}))
    gw = start_gateway([pool("p", "vllm", [a.url, b.url], 131072, policy="round_robin")])

    def left_to_soon() -> float:
        """Seconds from now to `soon` (a date has whole seconds: up to 1 s less; a loaded machine may
        take seconds to start the servers, so the expected value is taken from the clock, not fixed)."""
        return written + 8 - time.time()

    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_overloaded"
    assert left_to_soon() - 2 <= int(response.headers["retry-after"]) <= 8, response.headers  # soon, not later
    again = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)  # both sit out their wait
    assert again.status_code == 503 and left_to_soon() - 2 <= int(again.headers["retry-after"]) <= 8, again.headers
    assert len(a.engine.records) == 1 and len(b.engine.records) == 1


def test_absurd_retry_after_values_are_bounded_not_a_crash(start_sim: StartSim, start_gateway: StartGateway) -> None:
    for value in ("inf", "nan", "1e400", "-5", "soon"):
        sim = start_sim("vllm", faults=SimFaults(fail_status=429, fail_count=1, fail_headers={"retry-after": value}))
        gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503, (value, response.status_code, response.text)
        wait = int(response.headers["retry-after"])
        assert 1 <= wait <= 3600, (value, wait)


def _ejections(gw: RunningGateway) -> float:
    return gw.metric("kimi_gateway_worker_ejections_total{")


def test_two_failures_that_differ_only_in_ids_and_times_are_the_requests_fault(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Engines and proxies in front of them put base62 request ids and timestamps in error bodies,
    # not only UUIDs: those differ per attempt while the failure is the same.
    bodies = ['{"error": {"message": "invalid grammar", "request_id": "req_7Hk2LpQ9xZ", '
              '"time": "2026-11-30T18:48:14.123Z", "ts": 1764528494}}',
              '{"error": {"message": "invalid grammar", "request_id": "req_Ab3ZzQr7Wd", '
              '"time": "2026-11-30T18:48:15.456Z", "ts": 1764528495}}']
    sims = [start_sim("vllm", faults=SimFaults(fail_status=500, fail_body=body)) for body in bodies]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})
    for _ in range(4):  # more than passive_failures (3) per worker
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 500, response.text
        assert response.headers["x-should-retry"] == "false"
        assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert _ejections(gw) == 0
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    assert all(w["consecutive_failures"] == 0 for w in workers), workers


def test_a_flood_of_content_less_events_then_a_close_fails_over(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    role = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"kimi-k3",' \
           b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    flood = [role] + [b": keep-alive\n\n" * 20000] * 6  # ~1.7 MB of events without content, then the end
    bad = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(flood)))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        body = response.read()
        assert response.status_code == 200, body[:300]
        assert response.headers["x-kimi-gateway-worker"] == "p/1"
        assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert b'"error"' not in body and body.count(b"[DONE]") == 1
    assert body.count(b'"role":"assistant"') == 1
