"""The request path end to end: real openai SDK → gateway → simulated vLLM/SGLang/Ascend engines."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from gateway.routing.tokens import TokenEstimator
from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


@pytest.fixture
def three_pools(start_sim: StartSim, start_gateway: StartGateway) -> tuple[RunningGateway, dict[str, RunningSim]]:
    """128K vLLM (served as `moonshotai/Kimi-K3`), 512K SGLang, 1M vLLM, each with one simulated worker."""
    sims = {
        "vllm-128k": start_sim("vllm", max_context_tokens=131072, served_model_names=["moonshotai/Kimi-K3"]),
        "sglang-512k": start_sim("sglang", max_context_tokens=524288),
        "nvl72-1m": start_sim("vllm", max_context_tokens=1048576),
    }
    gw = start_gateway([
        pool("vllm-128k", "vllm", [sims["vllm-128k"].url], 131072, served_model_name="moonshotai/Kimi-K3",
             default_output_tokens=4096),
        pool("sglang-512k", "sglang", [sims["sglang-512k"].url], 524288, default_output_tokens=8192),
        pool("nvl72-1m", "vllm", [sims["nvl72-1m"].url], 1048576, default_output_tokens=8192),
    ])
    return gw, sims


def client(gw: RunningGateway, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]


def prompt_of_estimate(target_tokens: int, estimator: TokenEstimator) -> str:
    """An ASCII user message whose chat estimate (with the template overheads) is `target_tokens`."""
    overhead = estimator.config.tokens_per_message + estimator.config.tokens_per_request
    text_tokens = target_tokens - overhead
    n = int(text_tokens / (estimator.config.text_rates.latin * estimator.config.safety_margin))
    while estimator.text_tokens("x" * n) < text_tokens:
        n += 1
    while estimator.text_tokens("x" * n) > text_tokens:
        n -= 1
    text = "x" * n
    assert estimator.text_tokens(text) + overhead == target_tokens
    return text


def test_chat_non_streaming_sync(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = three_pools
    raw = client(gw).chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert raw.headers["x-kimi-gateway-pool"] == "vllm-128k"
    assert raw.headers["x-kimi-gateway-worker"] == "vllm-128k/0"
    assert raw.headers["x-request-id"]
    assert len(sims["vllm-128k"].engine.records) == 1


def test_chat_streaming_sync(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    stream = client(gw).chat.completions.create(
        model="kimi-k3", messages=[{"role": "user", "content": "Count."}], max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 7
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7


@pytest.mark.anyio
async def test_chat_async_client_streaming_and_not(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    async with openai.AsyncOpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as aclient:
        completion = await aclient.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        stream = await aclient.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len("".join(pieces).split()) == 4


def test_completions_streaming_and_not(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = three_pools
    c = client(gw)
    completion = c.completions.create(model="kimi-k3", prompt="Once upon a time", max_tokens=6)
    assert completion.object == "text_completion"
    assert len(completion.choices[0].text.split()) == 6
    pieces = [ch.choices[0].text for ch in c.completions.create(model="kimi-k3", prompt="Once", max_tokens=4,
                                                                 stream=True) if ch.choices]
    assert len("".join(pieces).split()) == 4
    assert [r.path for r in sims["vllm-128k"].engine.records] == ["/v1/completions", "/v1/completions"]


def test_models_list_has_model_and_aliases(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    ids = [m.id for m in client(gw).models.list()]
    assert ids == ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3"]


def test_image_data_uri_from_shared_images(three_pools: tuple[RunningGateway, dict[str, RunningSim]],
                                           shared_data: Path) -> None:
    gw, sims = three_pools
    image = shared_data / "images" / "astronaut_512.jpg"
    uri = "data:image/jpeg;base64," + base64.b64encode(image.read_bytes()).decode()
    raw = client(gw).chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image_url", "image_url": {"url": uri}}]}])
    assert raw.parse().choices[0].message.content
    # 512x512 px at 28x28 px per token is 19*19 = 361 image tokens, plus the text and template.
    estimate = int(raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
    assert "method=bytes+pixels" in raw.headers["x-kimi-gateway-estimated-prompt-tokens"]
    assert 361 < estimate < 450
    sent = sims["vllm-128k"].engine.records[-1].body
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == uri


@pytest.mark.parametrize(("pool_name", "limit", "next_pool"), [
    ("vllm-128k", 131072, "sglang-512k"),
    ("sglang-512k", 524288, "nvl72-1m"),  # SGLang 0.5.23 serves prompt + output == its context length
])
def test_routing_at_exact_pool_boundary(three_pools: tuple[RunningGateway, dict[str, RunningSim]],
                                        pool_name: str, limit: int, next_pool: str) -> None:
    gw, sims = three_pools
    estimator = TokenEstimator(gw.config.estimation)
    prompt_tokens = limit - 10000
    text = prompt_of_estimate(prompt_tokens, estimator)
    c = client(gw)

    def routed(max_tokens: int | None) -> str:
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        before = {name: len(sim.engine.records) for name, sim in sims.items()}
        raw = c.chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": text}], **extra)  # type: ignore[arg-type]
        assert raw.headers["x-kimi-gateway-estimated-prompt-tokens"].startswith(f"{prompt_tokens};")
        # Chosen right the first time: one attempt, and no other engine saw the request (an engine's
        # "too long" and the retry on the next pool would hide a wrong first choice).
        assert raw.headers["x-kimi-gateway-attempts"] == "1"
        chosen = raw.headers["x-kimi-gateway-pool"]
        assert {n: len(s.engine.records) - before[n] for n, s in sims.items()} == {
            n: int(n == chosen) for n in sims}
        return chosen

    assert routed(10000) == pool_name           # prompt + output == the usable limit: fits
    assert routed(10001) == next_pool           # one token over: the next pool
    reservation = gw.config.pool(pool_name).default_output_tokens
    assert reservation < 10000
    assert routed(None) == pool_name            # the pool's own reservation fits


def test_output_reservation_decides_when_max_tokens_absent(start_sim: StartSim,
                                                           start_gateway: StartGateway) -> None:
    small, big = start_sim("vllm", max_context_tokens=2048), start_sim("sglang", max_context_tokens=8192)
    gw = start_gateway([pool("small", "vllm", [small.url], 2048, default_output_tokens=1000),
                        pool("big", "sglang", [big.url], 8192, default_output_tokens=1000)])
    estimator = TokenEstimator(gw.config.estimation)
    c = client(gw)
    for prompt_tokens, expected in ((1048, "small"), (1049, "big")):
        raw = c.chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": prompt_of_estimate(prompt_tokens, estimator)}])
        assert raw.headers["x-kimi-gateway-pool"] == expected, prompt_tokens
        assert raw.headers["x-kimi-gateway-attempts"] == "1"
    assert len(small.engine.records) == 1 and len(big.engine.records) == 1


@pytest.mark.parametrize(("limits", "expected"), [
    ({"max_tokens": 100, "max_completion_tokens": 3000}, "big"),  # max_completion_tokens wins (OpenAI)
    ({"max_tokens": 3000, "max_completion_tokens": 100}, "small"),
    ({"max_completion_tokens": 3000}, "big"),
])
def test_max_completion_tokens_decides_the_output_reservation(start_sim: StartSim, start_gateway: StartGateway,
                                                              limits: dict[str, int], expected: str) -> None:
    small, big = start_sim("vllm", max_context_tokens=2048), start_sim("sglang", max_context_tokens=8192)
    gw = start_gateway([pool("small", "vllm", [small.url], 2048), pool("big", "sglang", [big.url], 8192)])
    response = httpx.post(gw.v1 + "/chat/completions",
                          json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], **limits})
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-pool"] == expected
    assert response.headers["x-kimi-gateway-attempts"] == "1"
    assert (len(small.engine.records), len(big.engine.records)) == ((1, 0) if expected == "small" else (0, 1))


def test_over_the_largest_pool_is_context_length_exceeded(
        three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    """A prompt that leaves no token of the largest context for output: no engine serves it."""
    gw, sims = three_pools
    estimator = TokenEstimator(gw.config.estimation)
    text = prompt_of_estimate(1048576, estimator)
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": text}],
                                           max_tokens=1)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert "1048576" in error["message"] and "1048577" in error["message"]
    assert all(not s.engine.records for s in sims.values())


def test_a_prompt_that_fits_with_an_output_limit_that_does_not_is_served_shortened(
        three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    """Prompt + max_tokens over the largest context, the prompt alone within it: the 1M pool's vLLM
    serves it with the output shortened to what is left (finish_reason "length"), as vLLM 0.32 does;
    the gateway used to answer context_length_exceeded."""
    gw, sims = three_pools
    estimator = TokenEstimator(gw.config.estimation)
    text = prompt_of_estimate(1048576 - 100, estimator)
    assert not sims["nvl72-1m"].engine.records
    raw = client(gw).chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": text}], max_tokens=101)
    answer = raw.parse()
    assert raw.headers["x-kimi-gateway-pool"] == "nvl72-1m" and raw.headers["x-kimi-gateway-attempts"] == "1"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.prompt_tokens + answer.usage.completion_tokens <= 1048576


@pytest.mark.parametrize("alias", ["kimi-k3", "Kimi-K3", "moonshotai/Kimi-K3"])
def test_alias_is_rewritten_to_the_pools_served_name(three_pools: tuple[RunningGateway, dict[str, RunningSim]],
                                                     alias: str) -> None:
    gw, sims = three_pools
    client(gw).chat.completions.create(model=alias, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert sims["vllm-128k"].engine.records[-1].body["model"] == "moonshotai/Kimi-K3"


def test_unknown_fields_reach_the_engine_unchanged(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = three_pools
    extra = {
        "top_k": 20,
        "chat_template_kwargs": {"thinking": True, "nested": [1, {"a": None}]},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "repetition_penalty": 1.05,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi", "name": "u1"}],
            "max_tokens": 2, "stream": True, **extra}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        assert response.status_code == 200
        response.read()
    received = sims["vllm-128k"].engine.records[-1].body
    assert received == {**body, "model": "moonshotai/Kimi-K3"}


def test_stream_relayed_byte_for_byte(start_sim: StartSim, start_gateway: StartGateway) -> None:
    event = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
             b'"delta":{"content":"caf\xc3\xa9 \xe6\x9d\xb1"}}]}\n\n')
    e_acute, kanji = event.index(b"\xc3\xa9"), event.index(b"\xe6\x9d\xb1")
    chunks = [
        b": keep-alive comment\n\n",
        event[:20], event[20:-1], event[-1:],           # one event split across three writes
        event[:e_acute + 1], event[e_acute + 1:],       # a 2-byte character split across writes
        event[:kanji + 1], event[kanji + 1:kanji + 2], event[kanji + 2:] + event[:10],  # a 3-byte one, 3 ways
        event[10:],                                     # ...and two events in one write, then the rest
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,'
        b'"completion_tokens":2,"total_tokens":5}}\n\n',
        b"data: [DONE]\n\n",
    ]
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)))
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}  # else the usage patch hides the usage chunk
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        received = b"".join(response.iter_raw())
        assert response.headers["content-type"].startswith("text/event-stream")
    assert received == b"".join(chunks)


def test_client_disconnect_mid_stream_aborts_the_engine_request(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "long answer"}], "stream": True,
            "max_tokens": 2000}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=5)
    assert record.completion_tokens_sent < 2000


def test_client_disconnect_before_first_byte_aborts_the_engine_request(start_sim: StartSim,
                                                                       start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", ttft_s=30.0)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "slow prefill"}], "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.v1 + "/chat/completions", json=body, timeout=httpx.Timeout(5.0, read=0.5))
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=5)
    assert record.first_byte_at is None


def test_spillover_when_a_pools_workers_are_down(start_sim: StartSim, start_gateway: StartGateway,
                                                 unused_port: int) -> None:
    big = start_sim("sglang", max_context_tokens=524288)
    dead = f"http://127.0.0.1:{unused_port}"
    gw = start_gateway([pool("small", "vllm", [dead], 131072), pool("big", "sglang", [big.url], 524288)])
    c = client(gw)
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-kimi-gateway-pool"] == "big"
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_spillovers_total{cause="unavailable",from_pool="small",to_pool="big"}' in metrics
    ready = httpx.get(gw.url + "/ready")  # the replica still routes (readiness.pools: any)
    assert ready.status_code == 200 and ready.json()["unready_pools"] == ["small"]


def test_no_spillover_when_the_pool_forbids_it(start_sim: StartSim, start_gateway: StartGateway,
                                               unused_port: int) -> None:
    big = start_sim("sglang", max_context_tokens=524288)
    gw = start_gateway([pool("small", "vllm", [f"http://127.0.0.1:{unused_port}"], 131072, spillover=False),
                        pool("big", "sglang", [big.url], 524288)])
    with pytest.raises(openai.InternalServerError) as info:
        client(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert not big.engine.records


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_too_long_is_retried_on_the_next_pool(start_sim: StartSim, start_gateway: StartGateway,
                                                     engine: str) -> None:
    # The small engine counts 1 token per byte, far more than the gateway's estimate.
    small = start_sim(engine, max_context_tokens=4096, bytes_per_token=1.0)
    big = start_sim("vllm", max_context_tokens=65536)
    gw = start_gateway([pool("small", engine, [small.url], 4096), pool("big", "vllm", [big.url], 65536)])
    text = "word " * 1000  # 5,000 bytes: the gateway estimates ~1,500 tokens, the small engine 5,000
    for stream in (False, True):
        raw = client(gw).chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": text}], max_tokens=4, stream=stream)
        assert raw.headers["x-kimi-gateway-pool"] == "big"
        assert raw.headers["x-kimi-gateway-attempts"] == "2"
    assert [r.status for r in small.engine.records] == [400, 400]
    assert len(big.engine.records) == 2
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_spillovers_total{cause="too_long",from_pool="small",to_pool="big"} 2.0' in metrics


def test_in_band_too_long_of_a_legacy_sglang_stream_is_retried(start_sim: StartSim,
                                                              start_gateway: StartGateway) -> None:
    # SGLang before 2026-04 answers a streaming request that is too long with 200 and an SSE error event.
    small = start_sim("sglang", api_version="legacy", max_context_tokens=4096, bytes_per_token=1.0)
    big = start_sim("vllm", max_context_tokens=65536)
    gw = start_gateway([pool("small", "sglang", [small.url], 4096), pool("big", "vllm", [big.url], 65536)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 1000}], "max_tokens": 4,
            "stream": True}
    direct = httpx.post(small.url + "/v1/chat/completions", json=body)
    assert direct.status_code == 200 and b'"error"' in direct.content  # the dialect is what it claims
    small.engine.clear_records()
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        received = response.read()
    assert response.status_code == 200
    assert (response.headers["x-kimi-gateway-pool"], response.headers["x-kimi-gateway-attempts"]) == ("big", "2")
    events = [e for e in received.split(b"\n\n") if e]
    assert b'"error"' not in received and events[-1] == b"data: [DONE]" and received.count(b"[DONE]") == 1
    assert len([e for e in events if b'"content"' in e]) >= 4
    assert [r.status for r in small.engine.records] == [200] and len(big.engine.records) == 1
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_upstream_attempts_total{outcome="too_long",pool="small",worker="small/0"} 1.0' in metrics


def test_engine_too_long_on_the_largest_pool_reaches_the_client(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    only = start_sim("vllm", max_context_tokens=4096, bytes_per_token=1.0)
    gw = start_gateway([pool("only", "vllm", [only.url], 4096)])
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "word " * 1000}],
                                           max_tokens=4)
    assert "maximum context length" in str(info.value)


def test_metrics_count_requests_and_ttft(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    c = client(gw)
    for _ in range(2):
        list(c.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       stream=True))
    text = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_requests_total{api="chat",model="kimi-k3",pool="vllm-128k",status_class="2xx"} 2.0' in text
    assert 'kimi_gateway_ttft_seconds_count{model="kimi-k3",pool="vllm-128k"} 2.0' in text
    decisions = [line for line in text.splitlines()
                 if line.startswith('kimi_gateway_route_decisions_total{pool="vllm-128k",')]
    counts = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in decisions}
    assert counts["no_match"] >= 1.0 and sum(counts.values()) == 2.0, counts  # the first had no cached prefix


def test_health_and_ready(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    assert httpx.get(gw.url + "/health").json() == {"status": "ok", "pid": os.getpid()}  # in-thread server
    ready = httpx.get(gw.url + "/ready")
    assert ready.status_code == 200
    assert set(ready.json()["pools"]) == {"vllm-128k", "sglang-512k", "nvl72-1m"}


# --- bad input ---------------------------------------------------------------------------------


def _post(gw: RunningGateway, content: bytes, path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(gw.v1 + path, content=content, headers={"content-type": "application/json"})


def _assert_openai_error(response: httpx.Response, status: int, code: str | None = None,
                         param: str | None = None) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(("content", "code", "param"), [
    (b"{not json", "invalid_json", None),
    (b"", "invalid_json", None),
    (b"[1, 2]", "invalid_json", None),
    (b'{"model": "kimi-k3"}', None, "messages"),
    (b'{"model": "kimi-k3", "messages": []}', None, "messages"),
    (b'{"model": "kimi-k3", "messages": "hi"}', None, "messages"),
    (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', None, "model"),
    (b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}', None,
     "max_tokens"),
    (b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', None, "stream"),
    (b'{"model": "kimi-k3", "messages": [{"role": "wizard", "content": "hi"}]}', None, "messages[0].role"),
    (b'{"model": "kimi-k3", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', None,
     "messages[0].content[0].image_url"),
    (b'{"model": "kimi-k3", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     b'{"url": "data:image/png;base64,@@@@"}}]}]}', "invalid_image_url", "messages[0].content[0].image_url.url"),
    (b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', None,
     "max_tokens"),
])
def test_bad_input_gets_an_openai_400(three_pools: tuple[RunningGateway, dict[str, RunningSim]], content: bytes,
                                      code: str | None, param: str | None) -> None:
    gw, sims = three_pools
    _assert_openai_error(_post(gw, content), 400, code, param)
    assert all(not s.engine.records for s in sims.values())
    # The gateway keeps serving.
    assert client(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "ok"}],
                                              max_tokens=1).choices


def test_unknown_model_is_404_model_not_found(three_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, _ = three_pools
    with pytest.raises(openai.NotFoundError) as info:
        client(gw).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    _assert_openai_error(_post(gw, json.dumps({"model": "nope", "prompt": "x"}).encode(), "/completions"), 404,
                         "model_not_found", "model")


def test_content_part_no_pool_accepts_is_400(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("text-only", "vllm", [sim.url], 131072, modalities=["text"])])
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
    for message in (audio, image):
        body = json.dumps({"model": "kimi-k3", "messages": [message]}).encode()
        error = _assert_openai_error(_post(gw, body), 400, "unsupported_content_type")
        assert "accepted: text" in str(error["message"])
    assert not sim.engine.records


def test_unknown_path_method_and_large_body(three_pools: tuple[RunningGateway, dict[str, RunningSim]],
                                            start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _ = three_pools
    _assert_openai_error(httpx.get(gw.url + "/v1/nothing"), 404, "not_found")
    wrong_method = httpx.get(gw.v1 + "/chat/completions")
    _assert_openai_error(wrong_method, 405, "method_not_allowed")
    assert wrong_method.headers["allow"] == "POST"  # RFC 9110: a 405 names the allowed methods
    assert "GET" in httpx.delete(gw.url + "/ready").headers["allow"]
    sim = start_sim("vllm")
    small = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_body_bytes=1000)
    _assert_openai_error(_post(small, b'{"model": "kimi-k3", "x": "' + b"a" * 2000 + b'"}'), 413,
                         "request_too_large")


# --- failover before the first byte, errors after it ---------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 429])
def test_failing_worker_before_first_byte_fails_over(start_sim: StartSim, start_gateway: StartGateway,
                                                     status: int) -> None:
    bad = start_sim("vllm", faults=SimFaults(fail_status=status, retry_after_s=3))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")])
    c = client(gw)
    for stream in (False, True, False, True):
        raw = c.chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream)
        assert raw.headers["x-kimi-gateway-worker"] == "p/1"
        assert raw.status_code == 200
    assert len(good.engine.records) == 4
    assert bad.engine.records, "round robin must have tried the failing worker"


@pytest.mark.parametrize("faults", [
    [SimFaults(fail_status=503), SimFaults(fail_status=503)],  # busy or broken: never the request's fault
    [SimFaults(fail_status=500, fail_body='{"error": {"message": "CUDA error"}}'),
     SimFaults(fail_status=500, fail_body='{"error": {"message": "engine loop dead"}}')],  # two causes
])
def test_every_worker_failing_is_a_502(start_sim: StartSim, start_gateway: StartGateway,
                                       faults: list[SimFaults]) -> None:
    sims = [start_sim("vllm", faults=f) for f in faults]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)])
    response = httpx.post(gw.v1 + "/chat/completions",
                          json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]})
    _assert_openai_error(response, 502, "upstream_error")
    assert response.headers["x-kimi-gateway-pool"] == "p"
    assert sum(len(s.engine.records) for s in sims) == 2


def test_failure_after_the_first_byte_is_one_sse_error_event_and_no_done(start_sim: StartSim,
                                                                        start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", faults=SimFaults(drop_after_chunks=3))
    other = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072), pool("q", "vllm", [other.url], 131072)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 50}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        received = b"".join(response.iter_raw())
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) == 4
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert b"[DONE]" not in received
    assert not other.engine.records, "no retry once bytes reached the client"
    with pytest.raises(openai.APIError):
        list(client(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "x"}],
                                                stream=True))
