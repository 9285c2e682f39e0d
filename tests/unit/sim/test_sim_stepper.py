"""The stepped engine model (`SimConfig.scheduler="stepped"`, `gateway.sim.stepper`) through the
ASGI app in-process: a shared prefill budget with chunked prefill, decode steps that slow with the
batch, preemption under KV pressure, prefix-cache hits.

Times are wall-clock seconds of the sim's own asyncio sleeps. A sleep never ends early, so each
time is at least the model's prediction; a busy machine can only make it later, by at most `SLACK`
here (steps of ~0.1 s keep the prediction well apart from the alternatives).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from gateway.sim import SimConfig, create_sim_app
from gateway.sim.app import SimApp
from gateway.sim.tokens import output_text

OVERHEAD = 4  # tokens the sim adds per chat message
SLACK = 0.15  # seconds a loaded machine may add to a predicted time


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _app(**fields: Any) -> SimApp:
    base: dict[str, Any] = {"engine": "vllm", "max_context_tokens": 200_000, "scheduler": "stepped",
                            "chunk_tokens": 4096, "prefill_tokens_per_s": 40_960.0, "decode_step_s": 0.0,
                            "decode_s_per_seq": 0.0}
    return create_sim_app(SimConfig.model_validate({**base, **fields}))


def _chat(tokens: int, max_tokens: int = 1, salt: str = "a", stream: bool = False) -> dict[str, Any]:
    """A chat request whose prompt is exactly `tokens` tokens (4 bytes a token + the overhead)."""
    text = (salt * 4 * (tokens - OVERHEAD))[: 4 * (tokens - OVERHEAD)]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _post(app: SimApp, body: dict[str, Any]) -> tuple[float, float, bytes]:
    """One request through the ASGI app: (seconds to the first body byte after the headers, seconds
    to the end, body). For a JSON answer both are the time to the whole answer."""
    raw = orjson.dumps(body)
    delivered = False
    never = asyncio.Event()
    chunks: list[bytes] = []
    start = time.monotonic()
    first: float | None = None

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal first
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if first is None:
                first = time.monotonic() - start

    await app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
    end = time.monotonic() - start
    return (first if first is not None else end), end, b"".join(chunks)


@pytest.mark.anyio
async def test_concurrent_prefills_share_one_budget() -> None:
    # Prompts that fit one chunk together: both finish in the same steps, each ~2x the lone time.
    lone_app = _app(chunk_tokens=8192, prefill_tokens_per_s=15_000.0)
    lone, _, _ = await _post(lone_app, _chat(3000))
    pair_app = _app(chunk_tokens=8192, prefill_tokens_per_s=15_000.0)
    pair = await asyncio.gather(_post(pair_app, _chat(3000, salt="b")), _post(pair_app, _chat(3000, salt="c")))
    assert 0.2 <= lone <= 0.2 + SLACK  # 3000 / 15000
    for ttft, _, _ in pair:
        assert 0.4 <= ttft <= 0.4 + SLACK

    # Prompts longer than a chunk: first come, first served chunk by chunk, so the first is done at
    # the lone time and the second at twice it; the budget is shared all the same.
    long_lone, _, _ = await _post(_app(), _chat(16_384))
    app = _app()
    first, second = await asyncio.gather(_post(app, _chat(16_384, salt="b")), _post(app, _chat(16_384, salt="c")))
    assert 0.4 <= long_lone <= 0.4 + SLACK  # 4 chunks of 4096 at 0.1 s
    assert 0.4 <= first[0] <= 0.4 + SLACK
    assert 0.8 <= second[0] <= 0.8 + SLACK
    stats = app.engine.sim_stats()
    assert stats["prefill_tokens"] == 2 * 16_384 and stats["preemptions"] == 0


@pytest.mark.anyio
async def test_short_prompt_behind_a_long_one_waits_for_its_remaining_chunks() -> None:
    short_alone, _, _ = await _post(_app(), _chat(404))
    app = _app()
    stepper = app.engine.stepper
    assert stepper is not None
    long_task = asyncio.create_task(_post(app, _chat(16_384)))
    await app.engine.async_wait_for(lambda: stepper.steps_run >= 1, timeout=5)
    # The long prompt's 2nd chunk is in flight (up to 0.1 s left): 2 more full chunks take every
    # token of the next two steps (running requests come first), then the short prompt's 404.
    short, _, _ = await _post(app, _chat(404, salt="z"))
    long_ttft, _, _ = await long_task
    own = 404 / 40_960
    assert own <= short_alone <= own + SLACK
    # (the lower bound allows for a stalled loop catching up on step 2 after the short one arrived)
    assert 0.1 + own <= short <= 0.1 + 2 * 0.1 + own + SLACK
    assert 0.4 <= long_ttft <= 0.4 + SLACK  # the long prompt did not wait for the short one


@pytest.mark.anyio
async def test_decode_steps_slow_down_as_the_batch_grows() -> None:
    fields = {"decode_step_s": 0.01, "decode_s_per_seq": 0.005}
    _, alone, _ = await _post(_app(**fields), _chat(100, max_tokens=12))
    app = _app(**fields)
    batch = await asyncio.gather(*(_post(app, _chat(100, max_tokens=12, salt=str(i))) for i in range(8)))
    # alone: a prefill step (0.01 s + 100 tokens) then 11 decode steps of 0.01 + 0.005 s; batch of
    # 8: one prefill step for all 8 prompts, then 11 steps of 0.01 + 8 x 0.005 s
    alone_predicted = 0.01 + 100 / 40_960 + 11 * 0.015
    batch_predicted = 0.01 + 800 / 40_960 + 11 * 0.05
    assert alone_predicted <= alone <= alone_predicted + SLACK
    for _, total, _ in batch:
        assert batch_predicted <= total <= batch_predicted + SLACK
    assert app.engine.sim_stats()["max_running"] == 8


@pytest.mark.anyio
async def test_kv_pressure_preempts_the_youngest_and_it_still_completes() -> None:
    app = _app(engine="sglang", kv_capacity_tokens=1000, decode_step_s=0.001)
    engine = app.engine
    first = asyncio.create_task(_post(app, _chat(400, max_tokens=150, salt="p")))
    await engine.async_wait_for(lambda: engine.sim_stats()["running"] == 1, timeout=5)
    # 400 + 400 prompt tokens fit in 1000; the two outputs grow into the rest and one must go
    _, _, body = await _post(app, _chat(400, max_tokens=150, salt="q", stream=True))
    _, _, first_body = await first
    stats = engine.sim_stats()
    assert stats["preemptions"] == 1  # then the first finishes and frees the room it needs
    assert stats["completed"] == 2 and stats["generated_tokens"] == 300
    assert stats["running"] == stats["waiting"] == 0
    assert stats["prefill_tokens"] > 800  # the preempted request recomputed part of its KV
    text = generate_latest(engine.registry).decode()
    assert f'sglang:num_retracted_requests_total{{model_name="kimi-k3"}} {float(stats["preemptions"])}' in text

    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    payloads = [orjson.loads(e) for e in events[:-1]]
    words = "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads if c["choices"])
    assert words == output_text(150)
    assert payloads[-1]["usage"]["completion_tokens"] == 150
    assert orjson.loads(first_body)["usage"]["completion_tokens"] == 150


@pytest.mark.anyio
async def test_prefix_cache_hit_skips_the_cached_prefill() -> None:
    app = _app(kv_capacity_tokens=100_000)
    cold, _, cold_body = await _post(app, _chat(8000))
    warm, _, warm_body = await _post(app, _chat(8000))
    assert orjson.loads(cold_body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert orjson.loads(warm_body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 7984
    assert cold >= 0.15  # 8000 / 40960 ~ 0.2 s
    assert warm <= cold / 4
    text = generate_latest(app.engine.registry).decode()
    assert 'vllm:num_preemptions_total{engine="0",model_name="kimi-k3"} 0.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="kimi-k3"} 7984.0' in text
