"""The default policy with engines that report a constant load offset (issue 37 item 16): an engine
that counts its own metrics scrape as a running request shows one more request than it runs, at
every scrape. Every healthy worker still gets traffic: the offset is the same on every worker and
says nothing about where a request waits less."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


def streamed_worker(client: openai.OpenAI, words: int) -> str:
    """Stream one chat request whose prompt no worker has cached; the worker that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": f"{uuid.uuid4().hex} " + "word " * words}],
        max_tokens=2, stream=True)
    assert list(raw.parse()), "the stream had no chunk"
    return raw.headers["x-kimi-gateway-worker"]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_every_healthy_worker_gets_traffic_when_engines_report_a_constant_offset(
        start_sim: StartSim, start_gateway: StartGateway, concurrency: int) -> None:
    """Three equal workers whose `/metrics` each report one running request more than they run,
    scraped every 50 ms; short prompts (~100 tokens, under the policy's `request_tokens`). One
    request at a time or three at once, 36 in all: each worker gets at least a sixth."""
    workers = [start_sim("vllm", prefill_tokens_per_s=50_000.0, faults=SimFaults(metrics_running_offset=1))
               for _ in range(3)]
    gw = start_gateway([pool("p", "vllm", [w.url for w in workers], 131072)], load={"interval": 0.05})
    gw.wait_until_idle()
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    with ThreadPoolExecutor(concurrency) as clients:
        served = Counter(clients.map(lambda _: streamed_worker(client, 100), range(36)))
    assert sum(served.values()) == 36
    assert min(served[f"p/{i}"] for i in range(3)) >= 6, served
