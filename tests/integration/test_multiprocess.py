"""Several serving processes on one port (`processes: 2`, gateway/process/supervisor.py): metrics stay exact."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support import GatewayProcess, RunningSim, metric_sum, pool

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
REQUESTS = 40


def _pids_answering(url: str, tries: int = 60) -> set[int]:
    """The serving processes seen over `tries` fresh connections."""
    return {httpx.get(url + "/health", headers={"connection": "close"}).json()["pid"] for _ in range(tries)}


def _both_serving(gw: GatewayProcess, timeout: float = 20.0) -> set[int]:
    """The pids of the 2 serving processes, once both answer (the second may still be starting)."""
    deadline = time.monotonic() + timeout
    pids: set[int] = set()
    while len(pids) < 2:
        assert time.monotonic() < deadline, f"only {pids} answered:\n{gw.log_text()}"
        pids |= _pids_answering(gw.url)
    return pids


def _sample(text: str, selector: str) -> float:
    return metric_sum(text, selector)


def test_two_processes_count_every_request_exactly_once(start_sim: StartSim,
                                                        start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm", tpot_s=0.001)
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2)
    pids = _both_serving(gw)
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


def test_a_killed_or_hung_serving_process_is_replaced_and_its_counts_kept(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm")
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2, hung_process_timeout=2.0)
    _both_serving(gw)
    with httpx.Client() as one_connection:  # a request served by a known process, which then dies
        victim = one_connection.get(gw.url + "/health").json()["pid"]
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert one_connection.post(gw.url + "/v1/chat/completions", json=body).status_code == 200
        counted = 'kimi_gateway_requests_total{api="chat",pool="p",status_class="2xx"}'
        deadline = time.monotonic() + 10  # the count is written once the answer went out: wait for it
        while _sample(one_connection.get(gw.url + "/metrics").text, counted) != 1:
            assert time.monotonic() < deadline, "the request was never counted"
            time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(now := _pids_answering(gw.url, 20) - {victim}) < 2:
        assert time.monotonic() < deadline, f"no replacement for {victim}: {now}\n{gw.log_text()}"
    text = httpx.get(gw.url + "/metrics").text
    assert _sample(text, counted) == 1
    assert gw.proc.poll() is None  # the supervisor itself lives on

    # A hung process (SIGSTOP: alive, holding the socket, its event loop still) misses its heartbeat:
    # the supervisor kills and replaces it, and the other process serves meanwhile.
    hung = next(iter(now))
    os.kill(hung, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while f"serving process {hung} sent no heartbeat" not in gw.log_text():
            assert time.monotonic() < deadline, f"{hung} was not found hung:\n{gw.log_text()}"
            assert httpx.post(gw.url + "/v1/chat/completions", json=body,
                              headers={"connection": "close"}).status_code == 200
            time.sleep(0.2)
        while len(serving := _pids_answering(gw.url, 20) - {victim, hung}) < 2:
            assert time.monotonic() < deadline, f"no replacement for {hung}: {serving}\n{gw.log_text()}"
        assert not _alive(hung)
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGCONT)
    assert gw.proc.poll() is None


def test_a_clean_stop_exits_0_while_a_dead_process_waits_for_its_restart(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm")
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2,
                               shutdown={"drain_delay": 0.2, "grace_period": 1})
    victim = next(iter(_both_serving(gw)))
    os.kill(victim, signal.SIGKILL)  # a quick death: its replacement waits for the crash back-off
    deadline = time.monotonic() + 10
    while f"serving process {victim} exited" not in gw.log_text():  # the supervisor saw it
        assert time.monotonic() < deadline, gw.log_text()
        time.sleep(0.05)
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0, gw.log_text()  # the killed process was reported, not this drain's failure


def _children_of(pid: int) -> set[int]:
    return {int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_serving_processes_die_with_a_killed_supervisor(start_sim: StartSim,
                                                        start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm")
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2)
    serving = _both_serving(gw)
    assert serving <= _children_of(gw.proc.pid)
    gw.proc.kill()  # no chance to clean up: the kernel's parent-death signal must end them
    gw.proc.wait(5)
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in serving):
        assert time.monotonic() < deadline, f"serving processes outlived their supervisor: {serving}"
        time.sleep(0.1)
    with pytest.raises(httpx.TransportError):
        httpx.get(gw.url + "/health", timeout=2)


def test_new_connections_are_refused_once_the_drain_delay_is_over(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2,
                               shutdown={"drain_delay": 0.5, "grace_period": 10})
    _both_serving(gw)  # before the signal
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body) as response:
        chunks = response.iter_raw()
        next(chunks)
        gw.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # past the drain delay (0.5 s) every copy of the listening socket is closed
            started = time.monotonic()
            try:
                httpx.get(gw.url + "/health", timeout=5)
            except httpx.ConnectError:
                break
            except httpx.TransportError:
                pass  # accepted into the backlog just as the last listener closed: reset
            assert time.monotonic() < deadline, "still accepting connections 10 s after SIGTERM"
            time.sleep(0.05)
        assert time.monotonic() - started < 1.0  # refused at once, not queued and reset later
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")  # the stream in flight finished
    assert gw.proc.wait(20) == 0
