"""PD roles on the stepped engine model: the gateway drives a prefill and a decode sim whose
scheduler is the step loop (`gateway.sim.stepper`); the decode worker computes only what the KV it
received does not cover."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from gateway.sim.tokens import output_text
from tests.integration.pd_support import StartSim, pd_group
from tests.support import RunningGateway

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "prefill and decode on steps " * 20}],
        "max_tokens": 6}


def _text(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in orjson.loads(line[6:]).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


@pytest.mark.parametrize(("mode", "stream"), [("sglang", True), ("vllm-nixl", False), ("vllm-mooncake", True)])
def test_pd_pair_on_the_step_scheduler(start_sim: StartSim, start_gateway: Callable[..., RunningGateway],
                                       mode: str, stream: bool) -> None:
    group = pd_group(start_sim, mode, scheduler="stepped", decode_step_s=0.002, kv_capacity_tokens=50_000)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    assert _text(response, stream) == output_text(6)
    prefill, decode = group.prefill[0].engine, group.decode[0].engine
    decode.wait_for(lambda: decode.sim_stats()["completed"] == 1)
    p_stats, d_stats = prefill.sim_stats(), decode.sim_stats()
    assert p_stats["prefill_tokens"] == p_stats["prompt_tokens"] > 100
    assert d_stats["prompt_tokens"] == p_stats["prompt_tokens"]
    assert d_stats["prefill_tokens"] < 16  # at most the tail of a block the KV pull left out
    assert d_stats["generated_tokens"] == 6 and d_stats["running"] == d_stats["waiting"] == 0
