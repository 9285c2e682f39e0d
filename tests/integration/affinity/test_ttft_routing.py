"""ttft_cost through a real gateway: simulated workers of different prefill speeds, streamed
requests through the OpenAI SDK; the policy learns each worker's prefill rate from the TTFTs it
observes and sends less traffic to the slow one."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import openai

from gateway.state import AppState
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

FILLER = "The quick brown fox jumps over the lazy dog near the riverbank at dawn. " * 110  # ~2,000 tokens


def streamed_worker(client: openai.OpenAI) -> str:
    """Stream one chat request with a prompt no worker has cached; returns the worker that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": f"{uuid.uuid4().hex} {FILLER}"}],
        max_tokens=2, stream=True)
    chunks = list(raw.parse())
    assert chunks, "the stream had no chunk"
    return raw.headers["x-kimi-gateway-worker"]


def test_the_worker_with_the_slower_prefill_gets_less_traffic(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    # One request at a time, so both workers are idle at every choice: least_load would rotate
    # (12 each), and the slow worker comes first in the pool, so a policy that ignored the rates and
    # took the first of equals would favour it. Only the learned rates tell them apart.
    slow = start_sim("vllm", prefill_tokens_per_s=4_000.0)   # ~0.5 s to the first token
    fast = start_sim("vllm", prefill_tokens_per_s=200_000.0)  # ~0.01 s
    gw = start_gateway([pool("p", "vllm", [slow.url, fast.url], 131072, policy="ttft_cost")],
                       load={"enabled": False})
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    served = Counter(streamed_worker(client) for _ in range(24))
    assert served["p/1"] >= 18, served  # the fast worker took at least three quarters
    assert served["p/0"] + served["p/1"] == 24

    state: AppState = gw.server.app.state.gateway
    model = state.policies.policy("p").prefill_model
    assert model is not None
    slow_worker, fast_worker = state.registry.pools["p"]
    now = time.perf_counter()
    fast_rate = model.rate(state.prefill.of(fast_worker), now)
    assert fast_rate > 2 * model.rate(state.prefill.of(slow_worker), now)  # learned, tokens/s
    assert state.prefill.of(fast_worker).pending == state.prefill.of(slow_worker).pending == 0.0
