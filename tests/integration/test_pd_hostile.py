"""Hostile inputs and backends in front of a prefill/decode (PD) pool (issue 13): garbage prefill
answers, dead legs, batches and n>1, token accounting; every answer an OpenAI-shaped error or a
clean stream, no leg left running, the in-flight gauges back to 0."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from gateway.sim.config import SimFaults
from gateway.config import parse_config
from gateway.reload import apply_config
from tests.integration.pd_support import ENGINE, StartSim, pd_group
from tests.support import RunningGateway, pool

StartGateway = Callable[..., RunningGateway]
MODES = ["sglang", "vllm-nixl", "vllm-mooncake"]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hostile prefill and decode"}],
        "max_tokens": 8}


def _settled(group, gw: RunningGateway) -> None:  # type: ignore[no-untyped-def]
    for sim in group.all():
        engine = sim.engine
        engine.wait_for(lambda e=engine: all(r.finished_at is not None for r in e.records) or None)
    gw.wait_until_idle()
    assert gw.metric("kimi_gateway_in_flight{") == 0


@pytest.mark.parametrize("body", ["not json at all", "[1, 2]", "null"])
def test_nixl_prefill_answering_garbage_is_a_clean_502(start_sim: StartSim, start_gateway: StartGateway,
                                                       body: str) -> None:
    group = pd_group(start_sim, "vllm-nixl")
    group.prefill[0].engine.set_faults(SimFaults(fail_status=200, fail_body=body))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code in (502, 503), response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert group.decode[0].engine.records == []
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_usage_is_counted_once_from_the_decode_leg(start_sim: StartSim, start_gateway: StartGateway,
                                                   mode: str) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    _settled(group, gw)
    assert gw.metric('kimi_gateway_tokens_total{kind="completion"') == usage["completion_tokens"]
    assert gw.metric('kimi_gateway_tokens_total{kind="prompt"') == usage["prompt_tokens"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_batched_completions(start_sim: StartSim, start_gateway: StartGateway, mode: str,
                                      stream: bool) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": ["one", "two", "three"],
                                                        "max_tokens": 4, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    if not stream:
        assert len(response.json()["choices"]) == 3
    else:
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_decode_dying_mid_stream_ends_with_one_sse_error(start_sim: StartSim, start_gateway: StartGateway,
                                                         mode: str) -> None:
    group = pd_group(start_sim, mode)
    group.decode[0].engine.set_faults(SimFaults(drop_after_chunks=2))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert response.status_code == 200
    assert response.text.count('"error"') == 1 and "[DONE]" not in response.text
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_decode_refusing_the_request_is_an_openai_error(start_sim: StartSim, start_gateway: StartGateway,
                                                        mode: str) -> None:
    group = pd_group(start_sim, mode)
    group.decode[0].engine.set_faults(SimFaults(fail_status=400))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}
    _settled(group, gw)


def _reload(gw: RunningGateway, pools: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """Apply a new pool list to the running gateway, as SIGHUP / POST /admin/reload do."""
    new = parse_config({"pools": pools, "health": {"interval": 0.5, "timeout": 1.0, "verify_models": False}},
                       environ={})

    async def apply() -> list[str]:
        return apply_config(gw.server.app.state.gateway, new).changes

    return gw.server.call(apply())


@pytest.mark.parametrize("mode", MODES)
def test_reload_aggregated_to_pd_and_back_while_streams_flow(start_sim: StartSim, start_gateway: StartGateway,
                                                             mode: str) -> None:
    aggregated = start_sim(ENGINE[mode], tpot_s=0.02)
    group = pd_group(start_sim, mode, tpot_s=0.02)
    agg_pool = pool("p", ENGINE[mode], [aggregated.url], 131072)
    gw = start_gateway([agg_pool])
    stream_body = {**CHAT, "stream": True, "max_tokens": 20}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=stream_body, timeout=10) as first:
        assert first.status_code == 200
        chunks = first.iter_bytes()
        next(chunks)
        changes = _reload(gw, [group.pool("p")])
        assert changes
        rest = b"".join(chunks)
    assert rest.rstrip().endswith(b"data: [DONE]")
    pd_answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert pd_answer.status_code == 200, pd_answer.text
    assert pd_answer.headers["x-kimi-gateway-decode-worker"].startswith("p/")
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=stream_body, timeout=10) as second:
        assert second.status_code == 200
        chunks = second.iter_bytes()
        next(chunks)
        _reload(gw, [agg_pool])
        rest = b"".join(chunks)
    assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
    back = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert back.status_code == 200, back.text
    assert "x-kimi-gateway-prefill-worker" not in back.headers
    _settled(group, gw)
    deadline = time.monotonic() + 5  # the removed PD workers' series go at the next retired-worker sweep (1 s)
    while gw.metric("kimi_gateway_worker_role{") != 0:
        assert time.monotonic() < deadline, "the removed PD workers' role series stayed"
        time.sleep(0.05)
