"""The simulator's prefix cache and load model over real HTTP: cached tokens in usage, prefill time,
LRU eviction, pinning of running requests, KV-bounded queueing, `/sim/stats`, metrics."""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
VLLM_LABELS = '{engine="0",model_name="kimi-k3"}'


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters + " ") for _ in range(n))


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, **extra}


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def test_repeated_prefix_is_cached_and_prefills_faster(start_sim: StartSim,
                                                       sse_payloads: Callable[[bytes], list[Any]]) -> None:
    srv = start_sim(max_context_tokens=100_000, kv_capacity_tokens=100_000, ttft_s=0.01,
                    prefill_tokens_per_s=30_000)
    prompt = _text(16_000, 1)  # 4,000 tokens + 4 for the message: 250 full blocks of 16 tokens
    timings, bodies = [], []
    for _ in range(2):
        start = time.monotonic()
        bodies.append(httpx.post(srv.url + CHAT, json=_chat(prompt)).json())
        timings.append(time.monotonic() - start)
    assert [_cached(b) for b in bodies] == [0, 4000]
    assert bodies[0]["usage"]["prompt_tokens"] == 4004
    # vLLM 0.32's `created_cache_tokens`: the full blocks the prefill wrote to the prefix cache
    assert [b["usage"]["prompt_tokens_details"]["created_cache_tokens"] for b in bodies] == [4000, 0]
    assert timings[0] >= 0.01 + 4004 / 30_000 - 0.01  # ~0.14 s of modelled prefill
    assert timings[0] - timings[1] >= 0.1  # the second prefills 4 tokens: ~0.13 s faster
    first, second = srv.app.engine.records
    assert (first.cached_tokens, first.prefill_tokens) == (0, 4004)
    assert (second.cached_tokens, second.prefill_tokens) == (4000, 4)
    assert second.first_byte_at - second.received_at < first.first_byte_at - first.received_at - 0.1

    events = sse_payloads(httpx.post(srv.url + CHAT, json=_chat(prompt, stream=True,
                                                                stream_options={"include_usage": True})).content)
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["prompt_tokens_details"] == {"cached_tokens": 4000,
                                                                              "created_cache_tokens": 0}

    other = httpx.post(srv.url + CHAT, json=_chat(_text(16_000, 2))).json()
    assert _cached(other) == 0
    half = httpx.post(srv.url + CHAT, json=_chat(prompt[:8000] + _text(8000, 3))).json()
    assert _cached(half) == (len(b"user\x1e") + 8000) // 64 * 16  # 125 blocks = 2,000 tokens


def test_token_id_prompts_are_cached_per_prompt(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=10_000)
    ids = list(range(100))
    httpx.post(srv.url + TEXT, json={"prompt": ids, "max_tokens": 1})
    body = httpx.post(srv.url + TEXT, json={"prompt": [ids, ids[:40]], "max_tokens": 1}).json()
    assert _cached(body) == (99 // 16) * 16 + (39 // 16) * 16  # 96 + 32: the last token recomputes


def test_lru_eviction_under_a_small_capacity(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=1000)
    a, b, c = (_text(1600, seed) for seed in (10, 11, 12))  # 404 tokens each, 25 blocks cached
    for prompt in (a, b, c):  # c needs room: the 13 tail blocks of a (LRU) are evicted
        assert _cached(httpx.post(srv.url + CHAT, json=_chat(prompt)).json()) == 0
    stats = httpx.get(srv.url + "/sim/stats").json()
    assert stats["evicted_tokens"] == 13 * 16 and stats["cache_tokens_now"] == (12 + 25 + 25) * 16
    assert _cached(httpx.post(srv.url + CHAT, json=_chat(c)).json()) == 400
    assert _cached(httpx.post(srv.url + CHAT, json=_chat(a)).json()) == 12 * 16  # only its head survived
    assert httpx.get(srv.url + "/sim/stats").json()["cache_tokens_now"] <= 1000


def test_blocks_of_a_running_request_are_not_evicted(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=1000, tpot_s=0.02)
    engine = srv.app.engine
    a, b, c = (_text(1600, seed) for seed in (20, 21, 22))
    slow = threading.Thread(target=lambda: httpx.post(srv.url + CHAT, json={**_chat(a), "max_tokens": 20}))
    slow.start()
    try:
        # a's first token means its prefill finished and its 25 blocks are cached and pinned
        engine.wait_for(lambda: engine.stats().generation_tokens_total >= 1, timeout=2)
        for prompt in (b, c):  # c's room comes from b's blocks; a's are pinned
            httpx.post(srv.url + CHAT, json=_chat(prompt))
        assert engine.stats().running == 1
        assert _cached(httpx.post(srv.url + CHAT, json=_chat(a)).json()) == 400
        assert _cached(httpx.post(srv.url + CHAT, json=_chat(b)).json()) < 400
    finally:
        slow.join(5)
    assert engine.stats().running == 0


def test_kv_room_queues_requests(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=1000, ttft_s=0.15)
    engine = srv.app.engine
    posts = [threading.Thread(target=lambda s=seed: httpx.post(srv.url + CHAT, json=_chat(_text(3200, s))))
             for seed in (30, 31)]  # 804 tokens each: two do not fit in 1,000
    for t in posts:
        t.start()
    engine.wait_for(lambda: engine.stats().running == 1 and engine.stats().waiting == 1, timeout=2)
    assert _metric(srv.url, "vllm:num_requests_waiting") == 1.0
    assert _metric(srv.url, "vllm:kv_cache_usage_perc") == pytest.approx(0.804)
    for t in posts:
        t.join(5)
    stats = httpx.get(srv.url + "/sim/stats").json()
    assert (stats["max_running"], stats["max_waiting"], stats["completed"]) == (1, 1, 2)
    # max_num_seqs queueing: test_sim_http.py::test_max_num_seqs_queues_requests_as_waiting and
    # tests/unit/sim/test_sim_engine_model.py (FIFO order, cancellation, peaks)


def test_sim_stats_totals_and_reset(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=10_000, max_context_tokens=2000)
    prompt = _text(2000, 40)  # 504 tokens
    for _ in range(2):
        httpx.post(srv.url + CHAT, json=_chat(prompt, max_tokens=3))
    assert httpx.post(srv.url + CHAT, json=_chat("x" * 9000)).status_code == 400  # context too long
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json={**_chat("bye"), "x_sim_faults": {"hang_before_headers": True}},
                   timeout=0.2)
    srv.app.engine.wait_for(lambda: srv.app.engine.sim_stats()["aborted"] == 1, timeout=2)
    stats = httpx.get(srv.url + "/sim/stats").json()
    assert stats == {
        "requests": 4, "completed": 2, "aborted": 1, "errors": 1,
        "prompt_tokens": 2 * 504, "cached_tokens": 496, "prefill_tokens": 504 + 8,
        "generated_tokens": 6, "evicted_tokens": 0, "preemptions": 0,
        "max_running": 1, "max_waiting": 0, "running": 0, "waiting": 0,
        "cache_tokens_now": 496, "kv_used_tokens": 496, "kv_capacity_tokens": 10_000, "kv_usage": 0.0,
    }
    assert httpx.delete(srv.url + "/sim/stats").json() == stats  # the totals just before the reset
    after = httpx.get(srv.url + "/sim/stats").json()
    assert after["requests"] == after["cached_tokens"] == after["max_running"] == 0
    assert after["cache_tokens_now"] == 496  # the cache survives a stats reset ...
    assert httpx.delete(srv.url + "/sim/cache").json() == {"dropped_tokens": 496}  # ... not this
    assert httpx.get(srv.url + "/sim/stats").json()["cache_tokens_now"] == 0
    assert _metric(srv.url, "vllm:prefix_cache_hits_total") == 496.0  # /metrics counters never reset
    assert _metric(srv.url, "vllm:prefix_cache_queries_total") == 2 * 504


def test_sim_stats_without_a_cache_and_without_records(start_sim: StartSim) -> None:
    srv = start_sim(keep_records=False)
    httpx.post(srv.url + CHAT, json=_chat("hello world", max_tokens=2))
    assert httpx.get(srv.url + "/sim/requests").json() == []
    assert srv.app.engine.records == []
    stats = httpx.get(srv.url + "/sim/stats").json()
    assert (stats["requests"], stats["completed"], stats["prompt_tokens"], stats["cached_tokens"]) == (1, 1, 7, 0)
    assert stats["prefill_tokens"] == 7 and stats["kv_capacity_tokens"] is None
    assert _metric(srv.url, "vllm:prefix_cache_queries_total") == 0.0  # no cache, no queries (as vLLM)


def test_sglang_reports_hit_rate(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", kv_capacity_tokens=10_000)
    prompt = _text(2000, 50)
    assert _metric(srv.url, "sglang:cache_hit_rate") == 0.0
    for _ in range(2):
        httpx.post(srv.url + CHAT, json=_chat(prompt))
    assert _metric(srv.url, "sglang:cache_hit_rate") == pytest.approx(496 / (2 * 504))
    assert _metric(srv.url, "sglang:cached_tokens_total") == 496.0
