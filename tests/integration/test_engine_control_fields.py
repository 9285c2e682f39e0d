"""Fields that steer the cluster are the gateway's to set (issues 25 §4 and 26 §6): a client's
`kv_transfer_params`, `bootstrap_host` / `bootstrap_port` / `bootstrap_room` and engine request ids
(`request_id`, SGLang's `rid`) never reach a worker as sent (the simulator's records are what the
worker received), unless a pool allows the KV ones; engines get the gateway's own request id, unique
per request and shared by both legs of a PD request, while the client keeps its `x-request-id`."""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.pd_support import pd_group
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
KV = {"kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "evil",
                             "remote_block_ids": [1, 2], "remote_host": "10.6.6.6", "remote_port": 5600},
      "bootstrap_host": "10.6.6.6", "bootstrap_port": 8998, "bootstrap_room": 4242}
IDS = {"request_id": "client-chosen-id", "rid": "client-chosen-rid"}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "completions": ("/completions", {"prompt": "hi", "max_tokens": 2}),
    "responses": ("/responses", {"input": "hi", "max_output_tokens": 2}),
    "messages": ("/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
}
ENGINE_ID = re.compile("[0-9a-f]{32}-[0-9]+")  # the gateway's id per request, then the attempt


def _post(gw: RunningGateway, api: str, extra: dict[str, Any], headers: dict[str, str] | None = None,
          stream: bool = False) -> httpx.Response:
    path, body = BODIES[api]
    answer = httpx.post(gw.v1 + path, json={"model": "kimi-k3", **body, **extra, "stream": stream},
                        headers={"anthropic-version": "2023-06-01", **(headers or {})}, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("offload", [False, True])
def test_kv_transfer_fields_and_engine_ids_never_reach_an_ordinary_worker(
        start_sim: StartSim, start_gateway: StartGateway, engine: str, offload: bool) -> None:
    sim = start_sim(engine)
    settings = {"parse_offload_bytes": 1} if offload else {}  # also through a parse process's ForwardBody
    gw = start_gateway([pool("p", engine, [sim.url], 131072)], **settings)
    for api in BODIES:
        _post(gw, api, {**KV, **IDS})
    assert len(sim.engine.records) == len(BODIES)
    for record in sim.engine.records:
        assert not set(record.body) & {*KV, *IDS}, (record.path, record.body)


def test_a_pool_may_allow_the_kv_fields_but_never_the_engine_ids(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, allow_kv_transfer_fields=True)])
    _post(gw, "chat", {**KV, **IDS})
    [record] = sim.engine.records
    assert {k: record.body[k] for k in KV} == KV and not set(record.body) & set(IDS)


def test_clients_sending_the_same_request_id_do_not_collide_on_an_engine(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM refuses a request whose id is already running (the simulator too: gateway/sim/request_ids.py):
    two clients that both send `x-request-id: same` (and body `request_id`) at once both get their answer,
    each with its own id echoed."""
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    with ThreadPoolExecutor(4) as threads:
        answers = list(threads.map(lambda args: _post(gw, *args), [
            ("chat", {"request_id": "same", "max_tokens": 8}, {"x-request-id": "same"}, stream)
            for stream in (False, True, False, True)]))
    assert [a.headers["x-request-id"] for a in answers] == ["same"] * 4
    assert all("already running" not in a.text for a in answers)
    sent = [r.headers["x-request-id"] for r in sim.engine.records]
    assert len(sent) == 4 and len(set(sent)) == 4 and all(ENGINE_ID.fullmatch(s) for s in sent), sent
    assert sim.engine.sim_stats()["max_running"] >= 2  # they did run at once


def test_both_legs_of_a_pd_request_carry_one_gateway_id(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl", tpot_s=0.05)
    gw = start_gateway([group.pool()])
    with ThreadPoolExecutor(2) as threads:
        answers = list(threads.map(lambda _: _post(gw, "chat", {"max_tokens": 6}, {"x-request-id": "same"}), [0, 1]))
    assert [a.headers["x-request-id"] for a in answers] == ["same", "same"]
    prefill = [r.headers["x-request-id"] for r in group.prefill[0].engine.records]
    decode = [r.headers["x-request-id"] for r in group.decode[0].engine.records]
    assert sorted(prefill) == sorted(decode) and len(set(decode)) == 2, (prefill, decode)
    assert all(ENGINE_ID.fullmatch(s) for s in decode)
