"""The engine's load model without HTTP: admission queue, latency formulas, counters, metrics.

Requests go through the ASGI app in-process (`_post`), which exercises the whole generation path
at a fraction of the cost of real sockets.
"""

from __future__ import annotations

import asyncio
import random
import string
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from gateway.sim import SimConfig, SimWorkerState, create_sim_app
from gateway.sim.app import SimApp
from gateway.sim.kvcache import PromptKey


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _post(app: SimApp, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, Any]:
    """One request through the ASGI app; (status, parsed JSON body)."""
    raw = orjson.dumps(body)
    delivered = False
    never = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    return status, orjson.loads(b"".join(chunks))


def _chat(text: str, max_tokens: int = 2) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters) for _ in range(n))


def _key(tokens: int) -> PromptKey:
    return PromptKey(tokens, tuple(range(1000 * tokens, 1000 * tokens + tokens // 16)))


def test_latency_formulas() -> None:
    engine = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=10_000, ttft_s=0.1, tpot_s=0.01,
                                 prefill_tokens_per_s=1000.0, decode_batch_slowdown=0.5))
    first = engine.start_running(500)
    assert engine.prefill_seconds(first) == pytest.approx(0.1 + 0.5)
    assert engine.decode_seconds() == pytest.approx(0.01)
    engine.start_running(10)
    engine.start_running(10)
    assert engine.decode_seconds() == pytest.approx(0.01 * (1 + 0.5 * 2))
    plain = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=10_000, ttft_s=0.1, tpot_s=0.01))
    assert plain.prefill_seconds(plain.start_running(500)) == 0.1
    assert plain.prompt_keys("chat", _chat("x" * 100), [29]) == []


def test_requests_waiting_for_their_kv_do_not_slow_a_decode_workers_batch() -> None:
    engine = SimWorkerState(SimConfig(engine="sglang", max_context_tokens=10_000, tpot_s=0.01,
                                      decode_batch_slowdown=0.5, pd_role="decode", pd_protocol="sglang"))
    for _ in range(3):
        engine.start_running(10)
    assert engine.decode_seconds() == pytest.approx(0.01 * (1 + 0.5 * 2))
    assert engine.pd is not None
    engine.pd.count(waiting_for_kv=2)  # what a decode leg does while its KV is on the way
    assert engine.decode_seconds() == pytest.approx(0.01)


@pytest.mark.anyio
async def test_queue_is_fifo_and_bounded_by_kv_room() -> None:
    engine = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=10_000, kv_capacity_tokens=1000))
    big = await engine.admit(800, [_key(800)])
    assert engine.try_admit(300, [_key(300)]) is None  # 800 + 300 > 1000
    second = asyncio.create_task(engine.admit(300, [_key(300)]))
    third = asyncio.create_task(engine.admit(100, [_key(100)]))  # would fit, but waits its turn
    await asyncio.sleep(0)
    assert (engine.stats().running, engine.stats().waiting) == (1, 2)
    engine.stop_running(big, "stop")
    admitted = await asyncio.wait_for(asyncio.gather(second, third), 1)
    assert [a.prompt_tokens for a in admitted] == [300, 100]
    stats = engine.sim_stats()
    assert (stats["running"], stats["waiting"], stats["max_running"], stats["max_waiting"]) == (2, 0, 2, 2)
    lone = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=10_000, kv_capacity_tokens=100))
    assert lone.try_admit(5000, [_key(5000)]) is not None  # alone, even a too-large request runs


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_the_queue_and_unblocks_the_next() -> None:
    engine = SimWorkerState(SimConfig(engine="sglang", max_context_tokens=10_000, max_num_seqs=1,
                                 kv_capacity_tokens=1000))
    running = engine.start_running(900, [_key(900)])
    head = asyncio.create_task(engine.admit(900, [_key(900)]))
    behind = asyncio.create_task(engine.admit(50, [_key(50)]))
    await asyncio.sleep(0)
    assert engine.stats().waiting == 2
    head.cancel()
    await asyncio.gather(head, return_exceptions=True)
    assert engine.stats().waiting == 1 and not behind.done()  # max_num_seqs=1 still holds it
    engine.stop_running(running, "length")
    assert (await asyncio.wait_for(behind, 1)).prompt_tokens == 50
    assert engine.stats().finished_by_reason == {"length": 1}


@pytest.mark.anyio
async def test_repeated_prompt_hits_and_counters_move() -> None:
    app = create_sim_app(SimConfig(engine="vllm", max_context_tokens=100_000, kv_capacity_tokens=50_000))
    engine = app.engine
    prompt = _text(8000, 1)  # 2000 tokens + 4 -> 125 full blocks of 16
    status, first = await _post(app, _chat(prompt))
    assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, second = await _post(app, _chat(prompt))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2000
    _, third = await _post(app, _chat(prompt[:4000] + _text(4000, 2)))
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(b"user\x1e") + 4000) // 64 * 16
    records = engine.records
    assert [(r.cached_tokens, r.prefill_tokens) for r in records[:2]] == [(0, 2004), (2000, 4)]
    stats = engine.sim_stats()
    assert stats["requests"] == stats["completed"] == 3 and stats["prompt_tokens"] == 3 * 2004
    assert stats["cached_tokens"] == 2000 + 992
    assert stats["prefill_tokens"] == stats["prompt_tokens"] - stats["cached_tokens"]
    assert stats["cache_tokens_now"] == (125 + 125 - 62) * 16 and stats["generated_tokens"] == 6
    text = generate_latest(engine.registry).decode()
    labels = '{engine="0",model_name="kimi-k3"}'
    assert f"vllm:prefix_cache_queries_total{labels} {3 * 2004}.0" in text
    assert f"vllm:prefix_cache_hits_total{labels} 2992.0" in text
    assert f"vllm:kv_cache_usage_perc{labels} 0.0" in text  # cached blocks nobody uses are free

    before = engine.reset_stats()
    assert before["requests"] == 3
    after = engine.sim_stats()
    assert after["requests"] == after["prompt_tokens"] == after["max_running"] == 0
    assert after["cache_tokens_now"] == stats["cache_tokens_now"]
    assert f"vllm:prefix_cache_hits_total{labels} 2992.0" in generate_latest(engine.registry).decode()
    assert engine.clear_cache() == stats["cache_tokens_now"]
    _, fourth = await _post(app, _chat(prompt))
    assert fourth["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.anyio
async def test_sglang_and_legacy_metric_names() -> None:
    app = create_sim_app(SimConfig(engine="sglang", max_context_tokens=100_000, kv_capacity_tokens=50_000))
    prompt = _text(4000, 3)  # 1004 tokens
    for _ in range(2):
        await _post(app, _chat(prompt))
    text = generate_latest(app.engine.registry).decode()
    assert 'sglang:cached_tokens_total{model_name="kimi-k3"} 992.0' in text
    rate = 992 / (2 * 1004)
    assert f'sglang:cache_hit_rate{{model_name="kimi-k3"}} {rate}' in text
    assert "sglang:token_usage" in text and "prefix_cache_queries" not in text
    legacy = SimWorkerState(SimConfig(engine="ascend", api_version="legacy", max_context_tokens=100))
    text = generate_latest(legacy.registry).decode()
    assert "vllm:gpu_prefix_cache_queries_total" in text and "vllm:gpu_prefix_cache_hits_total" in text
    assert "vllm:gpu_cache_usage_perc" in text


@pytest.mark.anyio
async def test_kv_usage_can_include_the_cache() -> None:
    app = create_sim_app(SimConfig(engine="vllm", max_context_tokens=100_000, kv_capacity_tokens=1000,
                                   kv_usage_includes_cache=True))
    await _post(app, _chat(_text(1600, 4)))  # 404 tokens, 25 blocks cached after it ends
    assert app.engine.stats().kv_usage == pytest.approx(400 / 1000)
    assert app.engine.sim_stats()["kv_used_tokens"] == 400


@pytest.mark.anyio
async def test_without_records_memory_stays_bounded() -> None:
    app = create_sim_app(SimConfig(engine="vllm", max_context_tokens=100_000, kv_capacity_tokens=40_000,
                                   keep_records=False))
    engine = app.engine
    shared = _text(40_000, 5)
    for i in range(150):  # 50 KB prompts, a shared 40 KB prefix and a unique tail
        status, _ = await _post(app, _chat(shared + f"{i:06d}" + _text(10_000, i), max_tokens=1))
        assert status == 200
    stats = engine.sim_stats()
    assert engine.records == [] and stats["requests"] == stats["completed"] == 150
    assert stats["cache_tokens_now"] <= 40_000 and stats["evicted_tokens"] > 0
    assert stats["cached_tokens"] >= 149 * 9_990  # the shared prefix stays hot (LRU)
    assert stats["running"] == 0 and engine.kv is not None and engine.kv.active_tokens == 0
