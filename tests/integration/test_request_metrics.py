"""Metrics that need a whole request to move: tokens via the usage patch, TPOT, Redis reachability."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai

from gateway.sim.config import SimFaults
from tests.support import OwnRedis, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
MESSAGES = [{"role": "user", "content": "count to five"}]


def test_streaming_client_without_include_usage_still_gets_its_tokens_counted(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("sglang", tpot_s=0.01)
    gw = start_gateway([pool("p", "sglang", [sim.url], 131072)])
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=5, stream=True))
    assert chunks and all(c.choices for c in chunks)  # no usage-only chunk reached this client
    assert sim.engine.records[-1].body["stream_options"] == {"include_usage": True}  # asked upstream
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 5
    assert gw.metric('kimi_gateway_tokens_total{kind="prompt",pool="p"}') > 0
    assert gw.metric('kimi_gateway_tpot_seconds_count{pool="p"}') == 1
    tpot = gw.metric('kimi_gateway_tpot_seconds_sum{pool="p"}')
    assert 0.005 < tpot < 0.5  # ~10 ms a token at the engine

    # A client that asks for usage gets the chunk, once, unchanged; the engine got its own options.
    chunks = list(client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 5 and chunks[-1].choices == []
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 10

    # Non-streaming answers carry usage already: nothing is patched.
    client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=5)
    assert "stream_options" not in sim.engine.records[-1].body
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 15
    assert gw.metric('kimi_gateway_tpot_seconds_count{pool="p"}') == 2  # streams only


def test_redis_up_follows_a_redis_outage(own_redis: OwnRedis, start_sim: StartSim,
                                         start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], redis_url=own_redis.url)
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)

    def redis_up_becomes(value: float, timeout: float = 12.0) -> None:
        deadline = time.monotonic() + timeout
        while gw.metric("kimi_gateway_redis_up ") != value:
            assert time.monotonic() < deadline, f"kimi_gateway_redis_up never became {value}"
            client.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=1)
            time.sleep(0.2)

    redis_up_becomes(1)
    own_redis.kill()
    redis_up_becomes(0)  # the next lookup fails: routing goes on without affinity
    own_redis.start()
    redis_up_becomes(1)


def test_a_client_that_did_not_ask_sees_no_usage_member_at_all(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    sim = start_sim("sglang")  # puts "usage": null on every chunk once usage is asked for, as OpenAI does
    gw = start_gateway([pool("p", "sglang", [sim.url], 131072)])
    for api, body in (("chat", {"messages": MESSAGES}), ("completions", {"prompt": "count to five"})):
        request = {"model": "kimi-k3", "max_tokens": 5, "stream": True, **body}
        with httpx.stream("POST", f"{gw.v1}/{api.replace('chat', 'chat/completions')}", json=request) as response:
            received = b"".join(response.iter_raw())
        assert received.count(b"\ndata: ") >= 5 and received.endswith(b"data: [DONE]\n\n")
        assert b'"usage"' not in received, api
    assert all(r.body["stream_options"] == {"include_usage": True} for r in sim.engine.records)
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 10


def test_usage_chunk_arriving_in_its_own_read_never_reaches_the_client(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    token = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    usage = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
             b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n')
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks([token, usage,
                                                                                        b"data: [DONE]\n\n"])))
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    for options in (None, {"include_usage": False}):
        body = {"model": "kimi-k3", "messages": MESSAGES, "stream": True, "stream_options": options}
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
            assert b"".join(response.iter_raw()) == token + b"data: [DONE]\n\n"
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 2
