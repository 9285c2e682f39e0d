"""Issue 10 §1-§3: the gateway's transport to the engines. Dead pooled connections, hung and
black-holed workers, non-streaming budgets, and streams held until their first content."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def sdk(gw: RunningGateway, **options: object) -> openai.OpenAI:
    """The real OpenAI SDK against the gateway; no SDK retries unless asked (they would hide errors)."""
    options.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=gw.v1, api_key="unused", **options)  # type: ignore[arg-type]


def ask(client: openai.OpenAI, stream: bool) -> tuple[str, str]:
    """One chat through the SDK: (the answer's text, the worker that served it)."""
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    assert raw.headers["x-kimi-gateway-attempts"] == "1", raw.headers
    return text, raw.headers["x-kimi-gateway-worker"]


def wait_until(moment: float) -> None:
    """Let time pass up to `moment` (time.monotonic()): the idle gap is what these tests are about."""
    time.sleep(max(0.0, moment - time.monotonic()))


def worker_states(gw: RunningGateway) -> dict[str, dict[str, object]]:
    return {w["id"]: w for p in httpx.get(gw.url + "/admin/workers").json()["pools"] for w in p["workers"]}


# --- §1: a pooled connection the engine already closed ---------------------------------------------


def test_requests_after_the_engines_idle_close_are_resent_on_a_new_connection(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Engines that drop connections idle for 1.5 s; the pool keeps them 30 s (the old default):
    # every request 2 s later goes out on a connection the engine has closed.
    sims = [start_sim("vllm", keep_alive_s=1.5, idle_close_unannounced=True) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin",
                             upstream_keep_alive=30)], health={"interval": 60}, load={"enabled": False})
    client = sdk(gw)
    served = []
    for round_ in range(3):
        started = time.monotonic()
        for stream in (False, True):  # round robin: each worker gets one of each mode per round
            text, worker = ask(client, stream)
            assert len(text.split()) == 3
            served.append(worker)
        if round_ < 2:
            wait_until(started + 2.0)
    assert sorted(set(served)) == ["p/0", "p/1"]
    assert all(s.engine.idle_resets >= 1 for s in sims)  # the dead connections were met, and survived
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="ok"') == 6
    assert gw.metric("kimi_gateway_upstream_attempts_total{") == 6
    assert gw.metric("kimi_gateway_retries_total{") == 0
    for state in worker_states(gw).values():  # not held against the workers
        assert state["consecutive_failures"] == 0 and state["healthy"] and state["last_error"] is None, state


def test_the_pool_drops_idle_connections_before_the_engine_does(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", keep_alive_s=1.0, idle_close_unannounced=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, upstream_keep_alive=0.6)],
                       health={"interval": 1.3, "timeout": 1.0}, load={"interval": 1.3})
    for i in range(3):
        started = time.monotonic()
        response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": i % 2 == 1}, timeout=10)
        assert response.status_code == 200 and response.headers["x-kimi-gateway-attempts"] == "1"
        if i < 2:
            wait_until(started + 1.3)  # idle past the engine's keep-alive
    # Requests, probes and scrapes never went out on a connection the engine had dropped: the
    # pool (and the probes' client) let go of them first.
    assert sim.engine.idle_resets == 0
    assert worker_states(gw)["p/0"]["failed_probes"] == 0
