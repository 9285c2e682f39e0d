"""What each engine kind serves near its context, end to end (real SDKs -> gateway -> simulated engines).

vLLM 0.32 serves a prompt that fits its context with an output limit that does not: it shortens the
output to what is left (finish_reason "length"; `get_max_tokens`, vllm/entrypoints/serve/utils/api_utils.py)
and without a limit generates to the end of the context. SGLang 0.5.23 refuses input + max_new_tokens
over its context (python/sglang/srt/managers/tokenizer_manager.py `_validate_one_request`). The gateway
routes by each pool's engine rule (`EngineSpec.accepts`) and sizes a whole answer's budget by what the
engine really generates, so neither a refusal nor a timeout of its own comes between the client and an
engine that would serve it. docs/routing.md "Context fit" and "Timeouts of a whole answer".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai

from gateway.routing.tokens import TokenEstimator
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

HEALTH = {"interval": 60, "passive_failures": 1, "ejection_base": 30}  # probes out of the way; one failure ejects


def text_of(tokens: int, gw: RunningGateway) -> str:
    """ASCII text the gateway estimates at about `tokens` tokens (at most that many)."""
    estimator = TokenEstimator(gw.config.estimation)
    n = int(tokens / (estimator.config.text_rates.latin * estimator.config.safety_margin))
    while estimator.text_tokens("x" * n) > tokens:
        n -= 1
    return "x" * n


def _ejections(gw: RunningGateway) -> float:
    return gw.metric("kimi_gateway_worker_ejections_total{")


def _healthy(gw: RunningGateway) -> bool:
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    return all(w["state"] == "healthy" for w in workers)


def test_claude_codes_32000_token_limit_is_served_by_a_vllm_pool_it_does_not_fit(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A 30K-token conversation with `max_tokens: 32000` on a 40K vLLM pool: vLLM shortens the
    answer to the ~10K tokens left (stop_reason max_tokens); the gateway used to answer 400."""
    sim = start_sim("vllm", max_context_tokens=40960)
    gw = start_gateway([pool("vllm-40k", "vllm", [sim.url], 40960, default_output_tokens=4096)])
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with client.messages.stream(model="kimi-k3", max_tokens=32000,  # streamed, as Claude Code asks
                                messages=[{"role": "user", "content": text_of(30000, gw)}]) as stream:
        message = stream.get_final_message()
        headers = stream.response.headers
    assert headers["x-kimi-gateway-pool"] == "vllm-40k" and headers["x-kimi-gateway-attempts"] == "1"
    assert message.stop_reason == "max_tokens"
    assert 0 < message.usage.output_tokens < 32000
    assert message.usage.input_tokens + message.usage.output_tokens == 40960
    assert sim.engine.records[-1].body["max_tokens"] == 32000  # sent as asked: the engine shortens it


def test_prompt_plus_limit_over_both_pools_goes_to_the_vllm_one_not_the_cheaper_sglang(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Two 8K pools, SGLang first (cheaper): 6K prompt + 4K limit fits neither whole. SGLang would
    refuse it, vLLM serves it shortened: the gateway sends it to vLLM at once."""
    sglang, vllm = start_sim("sglang", max_context_tokens=8192), start_sim("vllm", max_context_tokens=8192)
    gw = start_gateway([pool("sglang-8k", "sglang", [sglang.url], 8192, default_output_tokens=512),
                        pool("vllm-8k", "vllm", [vllm.url], 8192, default_output_tokens=512)])
    raw = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=4000, messages=[{"role": "user", "content": text_of(6000, gw)}])
    assert raw.headers["x-kimi-gateway-pool"] == "vllm-8k" and raw.headers["x-kimi-gateway-attempts"] == "1"
    assert raw.parse().choices[0].finish_reason == "length"
    assert not sglang.engine.records
    # a request both hold whole goes to the cheaper SGLang pool as before
    small = httpx.post(gw.v1 + "/chat/completions", json={"model": "kimi-k3", "max_tokens": 100,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert small.status_code == 200 and small.headers["x-kimi-gateway-pool"] == "sglang-8k"


def test_an_sglang_pool_alone_still_refuses_what_sglang_refuses(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    sglang = start_sim("sglang", max_context_tokens=8192)
    gw = start_gateway([pool("sglang-8k", "sglang", [sglang.url], 8192, default_output_tokens=512)])
    refused = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "max_tokens": 4000, "messages": [{"role": "user", "content": text_of(6000, gw)}]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "4000 output tokens" in refused.json()["error"]["message"]
    assert not sglang.engine.records  # refused before any engine saw it


def test_a_long_answer_without_a_limit_is_neither_504d_nor_ejects_its_worker(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM generates to the end of the context when a non-streamed request sets no limit. The pool's
    reservation (16 tokens) used to size the answer's budget (1.8 s here) while the engine took
    a few seconds: 504 after both workers redid the work, and both ejected. Now the budget counts the
    ~2000 tokens the engine may generate."""
    sims = [start_sim("vllm", max_context_tokens=2048, default_output_tokens=None, tpot_s=0.002) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 2048, default_output_tokens=16,
                             policy="round_robin")], health=HEALTH,
                       # 0.05 s a token: ~100 s for the ~2,000 tokens, room for a loaded machine's slow
                       # sim; the 16 reserved tokens would still give 1.8 s, short of even a quiet run's 4 s
                       timeouts={"first_byte_base": 0.5, "generation": 0.5, "generation_per_token": 0.05})
    for _ in range(3):
        response = httpx.post(gw.v1 + "/chat/completions", timeout=60,
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": "tell me"}]})
        assert response.status_code == 200, response.text
        assert response.headers["x-kimi-gateway-attempts"] == "1"
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 2048
    assert _ejections(gw) == 0 and _healthy(gw)
    assert sum(len(s.engine.records) for s in sims) == 3  # no work done twice


def test_a_whole_answer_that_outruns_its_budget_on_a_serving_worker_is_not_the_workers_fault(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A non-streamed request whose engine sends nothing within its budget while it answers others:
    the request's own doing. 504 without a retry elsewhere (the other worker would redo it), and no
    verdict against the worker (one failure would eject it here)."""
    sims = [start_sim("vllm"), start_sim("vllm")]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")], health=HEALTH,
                       timeouts={"first_byte_base": 2.0, "generation": 2.0, "generation_per_token": 0.0})
    chat: dict[str, Any] = {"model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: slow.update(r=httpx.post(
        gw.v1 + "/chat/completions", timeout=60, json={**chat, "x_sim_faults": {"hang_before_headers": True}})))
    thread.start()
    deadline = time.monotonic() + 10
    while not sims[0].engine.records:  # the hanging request reached the first worker (round robin)
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    # the same worker answers another request meanwhile (round robin: two requests to land one on it)
    served = [httpx.post(gw.v1 + "/chat/completions", json=chat) for _ in range(2)]
    assert all(r.status_code == 200 for r in served) and len(sims[0].engine.records) == 2
    thread.join(30)
    response = slow["r"]
    assert response.status_code == 504, response.text
    assert response.headers["x-should-retry"] == "false"
    assert len(sims[1].engine.records) == 1  # only the request that was served there: no retry
    assert _ejections(gw) == 0 and _healthy(gw)
