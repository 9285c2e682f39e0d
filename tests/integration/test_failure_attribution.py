"""Requests that fail because of what they ask (issue 10 §4) are the request's fault, not the
worker's: a failure every worker answers alike (also when the answers differ only in ids and times)
ejects no worker, a worker failing alone is still held against, and a prompt an engine finds too
long moves on to one larger pool only. (The body the engine gets: test_engine_body_fields.py.)"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT_TWO_TOKENS = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HEALTH = {"interval": 60, "passive_failures": 3, "ejection_base": 30}  # probes stay out of the way


def _ejections(gw: RunningGateway) -> float:
    return gw.metric("kimi_gateway_worker_ejections_total{")


def test_a_request_every_worker_fails_alike_is_its_own_fault(start_sim: StartSim,
                                                             start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm"), start_sim("vllm")]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH)
    # The simulator fails any request carrying this override: the request's own doing, on every worker.
    poison = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}],
              "x_sim_faults": {"fail_status": 500, "fail_body": '{"error": {"message": "bad grammar in request"}}'}}
    for n in range(1, 5):  # more than passive_failures (3) per worker
        response = httpx.post(gw.v1 + "/chat/completions", json=poison)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["message"] == "bad grammar in request"
        assert response.json()["error"]["type"] == "server_error"
        assert response.headers["x-should-retry"] == "false"  # the OpenAI SDKs do not resend it
        assert response.headers["x-kimi-gateway-attempts"] == "2"  # stopped after the second worker
        assert sum(len(s.engine.records) for s in sims) == 2 * n
    assert _ejections(gw) == 0
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    assert all(w["state"] == "healthy" for w in workers), workers
    ok = httpx.post(gw.v1 + "/chat/completions", json={**poison, "x_sim_faults": {}})
    assert ok.status_code == 200 and ok.headers["x-kimi-gateway-attempts"] == "1"


def test_a_worker_failing_alone_is_still_held_against_it(start_sim: StartSim, start_gateway: StartGateway) -> None:
    broken = start_sim("vllm", faults=SimFaults(fail_status=500))
    steady = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [broken.url, steady.url], 131072, policy="round_robin")],
                       health=HEALTH)
    chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for _ in range(6):  # round robin puts every other first attempt on the broken worker
        response = httpx.post(gw.v1 + "/chat/completions", json=chat)
        assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/1"
    assert len(broken.engine.records) == 3
    assert _ejections(gw) == 1  # three failures in a row, each followed by a success elsewhere


def test_a_500_then_another_500_with_a_different_cause_counts_both(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", faults=SimFaults(fail_status=500, fail_body=f'{{"error": {{"message": "dead {i}"}}}}'))
            for i in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)], health=HEALTH)
    for _ in range(3):
        response = httpx.post(gw.v1 + "/chat/completions",
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 502 and "x-should-retry" not in response.headers
    assert _ejections(gw) == 2


def test_the_same_error_with_another_status_is_not_the_same_failure(start_sim: StartSim,
                                                                    start_gateway: StartGateway) -> None:
    same_body = '{"error": {"message": "internal error"}}'
    sims = [start_sim("vllm", faults=SimFaults(fail_status=status, fail_body=same_body)) for status in (500, 501)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH)
    for _ in range(3):
        response = httpx.post(gw.v1 + "/chat/completions",
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 502 and "x-should-retry" not in response.headers
    assert _ejections(gw) == 2


def test_too_long_is_retried_on_one_larger_pool_only(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Both smaller engines count 1 token a byte, far above the gateway's estimate: each says "too long".
    sims = [start_sim("vllm", max_context_tokens=ctx, bytes_per_token=1.0) for ctx in (4096, 8192)]
    big = start_sim("vllm", max_context_tokens=65536)
    gw = start_gateway([pool("small", "vllm", [sims[0].url], 4096), pool("mid", "vllm", [sims[1].url], 8192),
                        pool("big", "vllm", [big.url], 65536)])
    response = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert (response.headers["x-kimi-gateway-pool"], response.headers["x-kimi-gateway-attempts"]) == ("mid", "2")
    assert [len(s.engine.records) for s in (*sims, big)] == [1, 1, 0]


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
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT_TWO_TOKENS, timeout=10)
        assert response.status_code == 500, response.text
        assert response.headers["x-should-retry"] == "false"
        assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert _ejections(gw) == 0
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    assert all(w["consecutive_failures"] == 0 for w in workers), workers
