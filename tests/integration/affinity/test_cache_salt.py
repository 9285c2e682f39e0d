"""`cache_salt` partitions the prefix cache, in the engines and so in the gateway's affinity: a
gateway with a real Redis affinity store in front of two simulated vLLM workers with a prefix cache."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

BLOCK = 16  # the sims' kv_block_tokens (vLLM's default block size on GPU)
# ~2,900 tokens: over the prefix_affinity policy's min_match_tokens (1024), so it alone routes
PROMPT = [{"role": "user", "content": "Summarise the shared design document, section by section. " * 200}]


def ask(gw: RunningGateway, **extra: Any) -> tuple[str, str, int, int]:
    """(worker, route reason, prompt tokens, cached tokens) of one chat request through the gateway."""
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="kimi-k3", messages=PROMPT, max_tokens=2,
                                                           extra_body=extra or None)
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    gw.flush_affinity()  # the affinity record is written in the background
    return raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-route-reason"], usage.prompt_tokens, cached


def test_salted_and_unsalted_prompts_route_and_cache_apart(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", kv_capacity_tokens=200_000, kv_block_tokens=BLOCK) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity")],
                       redis_url=shared_redis_url(), affinity={"key_prefix": f"test-{uuid.uuid4().hex[:10]}"},
                       load={"enabled": False})
    plain, _, prompt_tokens, cold = ask(gw)
    assert cold == 0
    again, reason, _, cached = ask(gw)
    assert (again, reason) == (plain, "affinity")
    # whole blocks, all but the block holding the last prompt token (which vLLM always recomputes)
    assert cached == (prompt_tokens - 1) // BLOCK * BLOCK > 0

    # The same prompt under a salt: no cache entry the engine could reuse, so no affinity either.
    salted, reason, _, cached = ask(gw, cache_salt="tenant-a")
    assert reason != "affinity" and cached == 0
    again, reason, _, cached = ask(gw, cache_salt="tenant-a")
    assert (again, reason) == (salted, "affinity") and cached == (prompt_tokens - 1) // BLOCK * BLOCK
    _, reason, _, cached = ask(gw, cache_salt="tenant-b")
    assert reason != "affinity" and cached == 0
    # the unsalted prompt still meets its own record and cache
    again, reason, _, cached = ask(gw)
    assert (again, reason, cached) == (plain, "affinity", (prompt_tokens - 1) // BLOCK * BLOCK)


def test_the_sim_partitions_its_prefix_cache_as_each_engine_does(start_sim: StartSim) -> None:
    """vLLM: `cache_salt` (chat, completions, Responses); SGLang: `cache_salt` and `extra_key`
    joined. Cached tokens are whole blocks of the worker's block size (here vLLM's 128 on CPU)."""
    block = 128
    vllm = start_sim("vllm", kv_capacity_tokens=200_000, kv_block_tokens=block)

    def cached(sim: RunningSim, path: str, body: dict[str, Any]) -> tuple[int, int]:
        answer = httpx.post(sim.url + path, json={"model": "kimi-k3", "max_tokens": 1, **body}, timeout=10)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        if "input_tokens" in usage:  # Responses
            return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
        # SGLang's usage has no details when nothing was cached (gateway/sim/sglang_shapes.py)
        return usage["prompt_tokens"], (usage["prompt_tokens_details"] or {"cached_tokens": 0})["cached_tokens"]

    text = "A long shared prefix for the cache. " * 120
    # a text per API (a Responses input renders as the chat messages would, sharing their cache)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "chat " + text}]}),
                       ("/v1/completions", {"prompt": "completions " + text}),
                       ("/v1/responses", {"input": "responses " + text, "max_output_tokens": 1})):
        tokens, first = cached(vllm, path, body)
        assert first == 0
        whole = (tokens - 1) // block * block
        assert cached(vllm, path, body) == (tokens, whole) and whole > 0
        assert cached(vllm, path, {**body, "cache_salt": "s1"}) == (tokens, 0)
        assert cached(vllm, path, {**body, "cache_salt": "s1"}) == (tokens, whole)
        assert cached(vllm, path, {**body, "cache_salt": "s2"}) == (tokens, 0)
        assert cached(vllm, path, {**body, "extra_key": "k"}) == (tokens, whole)  # vLLM ignores it

    sglang = start_sim("sglang", kv_capacity_tokens=200_000, kv_block_tokens=block)
    chat = {"messages": [{"role": "user", "content": text}]}
    tokens, _ = cached(sglang, "/v1/chat/completions", {**chat, "cache_salt": "ab"})
    whole = (tokens - 1) // block * block
    assert cached(sglang, "/v1/chat/completions", {**chat, "cache_salt": "a", "extra_key": "b"}) == (tokens, whole)
    assert cached(sglang, "/v1/chat/completions", {**chat, "extra_key": "c"}) == (tokens, 0)
    assert cached(sglang, "/v1/chat/completions", chat) == (tokens, 0)
