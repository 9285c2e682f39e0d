"""Outlier ejection by comparison with peers (issue 37 item 15): a worker whose clients hang up
on it while its peers answer later requests as large is ejected within the clients' patience,
with the default timeouts (whose non-streamed answer budget is minutes); a worker busy with a long
request of its own, whose peers answered only shorter ones meanwhile, is not."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PATIENCE_S = 2.0  # the clients' timeout: the issue's clients gave up after 6 s


def _state(gw: RunningGateway, worker: str) -> str:
    workers = httpx.get(gw.url + "/admin/workers", timeout=10).json()["pools"][0]["workers"]
    return next(w["state"] for w in workers if w["id"] == worker)


def _chat(i: int) -> dict[str, object]:
    """A short request of its own (no two share a cached prefix, which would draw them together)."""
    return {**CHAT, "messages": [{"role": "user", "content": f"hi {i}"}]}


def _impatient(gw: RunningGateway, body: dict[str, object]) -> str:
    """One non-streamed request from a client that gives up after `PATIENCE_S`: the worker that
    answered, or "hung"."""
    try:
        answer = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=PATIENCE_S)
    except httpx.ReadTimeout:
        return "hung"
    assert answer.status_code == 200, answer.text
    return answer.headers["x-kimi-gateway-worker"]


@pytest.mark.parametrize("policy", ["round_robin", "ttft_cost"])
def test_a_wedged_worker_is_ejected_while_its_peers_answer(start_sim: StartSim, start_gateway: StartGateway,
                                                           policy: str) -> None:
    """4 non-streamed requests a second, clients that give up after 2 s, one worker wedged (it
    accepts requests and answers none, its health probe green). Its requests' own budget (the
    defaults: ~120 s) outlasts every client, but each hang-up on it comes while the other worker
    answered later requests of the same size: after 3 (`passive_failures`) it is ejected, and new
    requests all go to the other worker."""
    wedged = start_sim("vllm", faults=SimFaults(hang_before_headers=True))
    steady = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [wedged.url, steady.url], 131072, policy=policy)],
                       health={"interval": 60, "ejection_base": 120})
    sent: list[Future[str]] = []
    started = time.monotonic()
    with ThreadPoolExecutor(16) as clients:
        for i in range(60):  # 15 s at most; the ejection is expected after ~3 hang-ups
            if _state(gw, "p/0") == "ejected":
                break
            time.sleep(max(0.0, started + 0.25 * i - time.monotonic()))
            sent.append(clients.submit(_impatient, gw, _chat(i)))
        outcomes = [f.result() for f in sent]
    assert _state(gw, "p/0") == "ejected", outcomes
    assert outcomes.count("hung") >= 3
    assert set(outcomes) <= {"hung", "p/1"}
    assert {_impatient(gw, _chat(100 + i)) for i in range(4)} == {"p/1"}
    assert _state(gw, "p/1") == "healthy"


def test_a_long_prefill_is_not_held_against_its_worker_when_peers_answer_shorter_ones(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A real engine busy with one long prefill (a ~4,000-token prompt at 1,000 tokens/s) answers
    nothing until it ends; its client leaves after 2 s. Meanwhile the other worker answers many
    short requests sent later (the default policy sends them there: the long prefill is queued on
    the first). None of them had the long one's budget, so the hang-up is held against nobody,
    even with one failure to eject."""
    workers = [start_sim("vllm", prefill_tokens_per_s=1000.0) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [w.url for w in workers], 131072)],
                       health={"interval": 60, "passive_failures": 1, "ejection_base": 120})
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 4000}]}
    with ThreadPoolExecutor(1) as client:
        long = client.submit(_impatient, gw, long_prompt)
        deadline = time.monotonic() + 30
        while not any(w.engine.stats().running for w in workers):
            assert time.monotonic() < deadline, "the long request never reached a worker"
            time.sleep(0.02)
        busy = next(i for i, w in enumerate(workers) if w.engine.stats().running)
        short = [_impatient(gw, _chat(i)) for i in range(5)]
        assert long.result() == "hung"
    assert set(short) == {f"p/{1 - busy}"}  # the premise: the peer answered later, shorter requests
    gw.wait_until_idle()
    assert _state(gw, f"p/{busy}") == "healthy"
    assert [_state(gw, f"p/{i}") for i in range(2)] == ["healthy", "healthy"]
