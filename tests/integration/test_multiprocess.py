"""Several serving processes on one port (`processes: 2`, gateway/supervisor.py): metrics stay exact."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx

from tests.support import GatewayProcess, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
REQUESTS = 40


def _pids_answering(url: str, tries: int = 60) -> set[int]:
    """The serving processes seen over `tries` fresh connections."""
    return {httpx.get(url + "/health", headers={"connection": "close"}).json()["pid"] for _ in range(tries)}


def _sample(text: str, line_start: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))


def test_two_processes_count_every_request_exactly_once(start_sim: StartSim,
                                                        start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm", tpot_s=0.001)
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2)
    deadline = time.monotonic() + 20
    while len(pids := _pids_answering(gw.url)) < 2:  # the second process may still be starting
        assert time.monotonic() < deadline, f"only {pids} answered:\n{gw.log_text()}"
    for i in range(REQUESTS):  # a new connection each: the kernel hands them to either process
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 3,
                "stream": i % 2 == 0}
        response = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"connection": "close"})
        assert response.status_code == 200
    assert len(sim.engine.records) == REQUESTS
    scraped: set[int] = set()
    deadline = time.monotonic() + 20
    while scraped != pids:  # each process, asked on its own connection, reports every process's requests
        assert time.monotonic() < deadline, f"scraped only {scraped} of {pids}"
        with httpx.Client() as one_connection:
            scraped.add(one_connection.get(gw.url + "/health").json()["pid"])
            text = one_connection.get(gw.url + "/metrics").text
        assert _sample(text, 'kimi_gateway_requests_total{api="chat",pool="p",status_class="2xx"}') == REQUESTS
        assert _sample(text, 'kimi_gateway_ttft_seconds_count{pool="p"}') == REQUESTS / 2
        assert _sample(text, 'kimi_gateway_tokens_total{kind="completion",pool="p"}') == 3 * REQUESTS
        assert _sample(text, "kimi_gateway_in_flight{") == 0
        assert _sample(text, 'kimi_gateway_worker_healthy{pool="p",worker="p/0"}') == 1  # one series, not two

    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0, gw.log_text()


def test_a_killed_serving_process_is_replaced_and_its_counts_kept(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm")
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2)
    deadline = time.monotonic() + 20
    while len(pids := _pids_answering(gw.url)) < 2:
        assert time.monotonic() < deadline, f"only {pids} answered:\n{gw.log_text()}"
    with httpx.Client() as one_connection:  # a request served by a known process, which then dies
        victim = one_connection.get(gw.url + "/health").json()["pid"]
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert one_connection.post(gw.url + "/v1/chat/completions", json=body).status_code == 200
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(now := _pids_answering(gw.url, 20) - {victim}) < 2:
        assert time.monotonic() < deadline, f"no replacement for {victim}: {now}\n{gw.log_text()}"
    text = httpx.get(gw.url + "/metrics").text
    assert _sample(text, 'kimi_gateway_requests_total{api="chat",pool="p",status_class="2xx"}') == 1
    assert gw.proc.poll() is None  # the supervisor itself lives on
