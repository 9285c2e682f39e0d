"""The prompt tokens the engines served from their prefix cache, counted per pool and model in
`kimi_gateway_tokens_total{kind="cached"}` by the one accountant (gateway/dispatch/ledger.py), from
every API's usage shape: chat's and completions' `prompt_tokens_details.cached_tokens` (in the
include-usage chunk of a stream), Anthropic's `cache_read_input_tokens` (split over vLLM's
`message_start` / `message_delta`, SGLang's counted inside `input_tokens`); the Responses API's is
tests/integration/test_responses_api.py's. The count equals what the engines reused, request by request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
PROMPT = "A prompt long enough to fill several cache blocks, sent twice. " * 40


def body(api: str, stream: bool) -> dict[str, Any]:
    if api == "completions":
        return {"model": "kimi-k3", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    return {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": stream}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("chat", True), ("completions", False),
                                             ("completions", True), ("messages", False), ("messages", True)])
def test_cached_prompt_tokens_are_counted_per_pool_and_model(start_sim: StartSim, start_gateway: StartGateway,
                                                             engine: str, api: str, stream: bool) -> None:
    sim = start_sim(engine, kv_capacity_tokens=100_000)
    gw = start_gateway([pool("p", engine, [sim.url], 131072)])
    path = {"chat": "/chat/completions", "completions": "/completions", "messages": "/messages"}[api]
    for _ in range(3):
        answer = httpx.post(gw.v1 + path, json=body(api, stream), timeout=30)
        assert answer.status_code == 200, answer.text
    cached = sum(r.cached_tokens for r in sim.engine.records)
    assert cached > 0 and sim.engine.records[0].cached_tokens == 0
    assert gw.wait_for_metric('kimi_gateway_tokens_total{kind="cached",pool="p",model="kimi-k3"}',
                              lambda v: v >= cached) == cached
