"""The optional overall request cap (`timeouts.total`): arrival to last byte, on every path."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
MESSAGES = [{"role": "user", "content": "tell me a long story"}]


def _aborted(sim: RunningSim) -> None:
    """The engine saw its one request aborted (the gateway closed the upstream)."""
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=5)
    assert record.aborted


def test_stream_over_the_cap_ends_with_an_error_event_and_aborts_the_engine(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.0, tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 0.6})
    started = time.monotonic()
    body = {"model": "kimi-k3", "messages": MESSAGES, "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        assert response.status_code == 200
        received = b"".join(response.iter_raw())
    assert 0.5 < time.monotonic() - started < 3.0
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) > 3  # tokens flowed before the cap
    assert b'"code":"request_timeout"' in events[-1] and b"[DONE]" not in received
    assert all(e.startswith(b"data: {") for e in events)  # whole events only, none cut by the error
    _aborted(sim)
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_worker_ejections_total') == 0  # the cap is no verdict on the engine

    # The real SDK raises on the error event instead of returning a silently truncated answer.
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="overall time limit"):
        for _ in client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=1000, stream=True):
            pass


def test_request_waiting_for_its_first_byte_over_the_cap_gets_504(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=30.0)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 0.5})
    started = time.monotonic()
    for stream in (True, False):
        response = httpx.post(gw.v1 + "/chat/completions", timeout=10,
                              json={"model": "kimi-k3", "messages": MESSAGES, "max_tokens": 5, "stream": stream})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 4.0
    sim.engine.wait_for(lambda: (len(sim.engine.records) == 2 and all(r.aborted for r in sim.engine.records)) or None,
                        timeout=5)
    gw.wait_until_idle()


def test_non_streaming_answer_over_the_cap_gets_504(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.0, tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 0.5})
    response = httpx.post(gw.v1 + "/chat/completions", timeout=10,
                          json={"model": "kimi-k3", "messages": MESSAGES, "max_tokens": 1000})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"
    _aborted(sim)
    gw.wait_until_idle()


def test_requests_inside_the_cap_are_untouched(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=0.0, tpot_s=0.001)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 5.0})
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=20, stream=True))
    assert len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()) == 20
    answer = client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=20)
    assert answer.choices[0].finish_reason == "length"
    assert not any(r.aborted for r in sim.engine.records)


def test_attempts_cut_by_the_cap_are_counted_and_a_hung_streaming_worker_is_ejected(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    hung = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [hung.url, good.url], 131072, policy="round_robin")],
                       timeouts={"total": 0.4}, health={"interval": 60, "passive_failures": 3})
    body = {"model": "kimi-k3", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    statuses = []
    for _ in range(10):
        response = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=10)
        statuses.append(response.status_code)
        if response.status_code == 504:
            assert response.headers["x-kimi-gateway-worker"] == "p/0"  # the operator sees which worker hung
    assert statuses.count(504) == 3 and statuses[-4:] == [200] * 4  # ejected after 3 cut attempts
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="timeout",pool="p",worker="p/0"}') == 3
    assert gw.metric('kimi_gateway_worker_ejected{pool="p",worker="p/0"}') == 1
    assert gw.metric('kimi_gateway_requests_total{api="chat",pool="p",status_class="5xx"}') == 3


def test_a_stream_cut_by_the_cap_counts_as_a_server_error(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 0.3})
    with httpx.stream("POST", gw.v1 + "/chat/completions",
                      json={"model": "kimi-k3", "messages": MESSAGES, "max_tokens": 100, "stream": True}) as r:
        assert r.status_code == 200 and b"request_timeout" in b"".join(r.iter_raw())
    gw.wait_for_metric('kimi_gateway_requests_total{api="chat",pool="p",status_class="5xx"}', lambda n: n == 1)
    assert gw.metric('kimi_gateway_worker_ejections_total') == 0


def test_a_body_still_uploading_at_the_cap_gets_408(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"total": 0.5})
    payload = b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "' + b"x" * 20 + b'"}]}'

    def trickle() -> Iterator[bytes]:  # a byte every 20 ms: ~1.5 s for the whole body
        for i in range(len(payload)):
            time.sleep(0.02)
            yield payload[i:i + 1]

    response = httpx.post(gw.v1 + "/chat/completions", content=trickle(), timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
    assert not sim.engine.records  # nothing reached the engine
