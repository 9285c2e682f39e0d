"""Load signals come from the engines' own /metrics, so load sent by others (another gateway
replica, a direct client) steers this gateway's choices."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.load import parse_engine_load
from tests.support import RunningGateway, RunningSim, pool


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_busy_with_other_clients_gets_no_new_work(engine: str, start_sim: Callable[..., RunningSim],
                                                         start_gateway: Callable[..., RunningGateway]) -> None:
    busy, idle = start_sim(engine, tpot_s=0.05), start_sim(engine)
    gw = start_gateway([pool("p", engine, [busy.url, idle.url], 131072, policy="least_load")],
                       load={"interval": 0.1})
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "x"}], "max_tokens": 60}
    direct = [threading.Thread(target=httpx.post, args=(busy.url + "/v1/chat/completions",),
                               kwargs={"json": body, "timeout": 30}) for _ in range(3)]
    for thread in direct:
        thread.start()
    try:
        deadline = time.monotonic() + 5
        while True:  # wait until the gateway has scraped the busy engine
            workers = httpx.get(gw.url + "/ready").json()["pools"]["p"]
            if workers[0]["engine_running"] == 3:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.05)
        for _ in range(4):
            response = httpx.post(gw.v1 + "/chat/completions", json={**body, "max_tokens": 1})
            assert response.headers["x-kimi-gateway-worker"] == "p/1"
    finally:
        for thread in direct:
            thread.join()
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_engine_load{pool="p",signal="running",worker="p/0"}' in metrics


@pytest.mark.parametrize(("engine", "text", "expected"), [
    ("vllm", 'vllm:num_requests_running{engine="0",model_name="k"} 2.0\n'
             'vllm:num_requests_waiting{engine="0",model_name="k"} 1.0\n'
             'vllm:num_requests_running{engine="1",model_name="k"} 3.0\n'
             'vllm:kv_cache_usage_perc{engine="0",model_name="k"} 0.25\n'
             'vllm:prompt_tokens_total{model_name="k"} 99.0\n', (5.0, 1.0, 0.25)),
    ("vllm", "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\n"
             'vllm:gpu_cache_usage_perc{model_name="k"} 0.5\nvllm:num_requests_running{model_name="k"} 1\n',
     (1.0, None, 0.5)),
    ("sglang", 'sglang:num_running_reqs{model_name="k"} 4\nsglang:num_queue_reqs{model_name="k"} 2\n'
               'sglang:token_usage{model_name="k"} 0.75\n', (4.0, 2.0, 0.75)),
    ("llamacpp", "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n", (1.0, 0.0, None)),
])
def test_parse_engine_load(engine: str, text: str, expected: tuple[float | None, ...]) -> None:
    assert parse_engine_load(text, ENGINES[engine]) == expected
