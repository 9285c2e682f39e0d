"""Prefix-cache affinity through real gateways: conversations stick to one worker, replicas agree
through Redis, and a Redis that dies and comes back costs affinity, never requests."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.support import OwnRedis, RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

# ~1.6 KB (~480 tokens) shared by every request, like block 0 of the Mooncake trace: under the
# policy's default min_match_tokens (1024), so it alone must not pull traffic to one worker.
SYSTEM = "You are Kimi, a careful assistant. Follow the house style guide. " * 25


def mt_bench(shared_data: Path, n: int) -> list[list[str]]:
    lines = (shared_data / "text" / "mt_bench" / "question.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"] for line in lines[:n]]


def conversation_turns(turns: list[str], answer: str) -> Iterator[list[dict[str, str]]]:
    """The message lists of a two-turn chat; turn 2 repeats turn 1 and its answer as its prefix."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turns[0] * 24}]
    yield list(history)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": turns[1]}]
    yield history


def worker_of(gw: RunningGateway, messages: list[dict[str, str]]) -> tuple[str, str]:
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=3)
    return raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-route-reason"]


@pytest.fixture
def four_workers(start_sim: StartSim) -> list[RunningSim]:
    return [start_sim("sglang", max_context_tokens=131072) for _ in range(4)]


def affinity_pool(sims: list[RunningSim]) -> dict[str, object]:
    return pool("p", "sglang", [s.url for s in sims], 131072, policy="prefix_affinity")


def test_each_conversation_sticks_to_one_worker(four_workers: list[RunningSim], start_gateway: StartGateway,
                                                shared_data: Path) -> None:
    gw = start_gateway([affinity_pool(four_workers)], load={"enabled": False})
    first_turn_workers = set()
    for turns in mt_bench(shared_data, 8):
        (w1, r1), (w2, r2) = (worker_of(gw, m) for m in conversation_turns(turns, "Answer. " * 50))
        assert (w2, r2) == (w1, "affinity")
        assert r1 in ("no_match", "affinity")
        first_turn_workers.add(w1)
    # A system prompt shared by every conversation must not pull them all onto one worker.
    assert len(first_turn_workers) >= 3


def test_two_gateway_replicas_agree_through_redis(four_workers: list[RunningSim], start_gateway: StartGateway,
                                                  shared_data: Path) -> None:
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    settings = {"redis_url": shared_redis_url(), "affinity": {"key_prefix": prefix},
                "load": {"enabled": False}}
    replicas = [start_gateway([affinity_pool(four_workers)], **settings) for _ in range(2)]
    try:
        for i, turns in enumerate(mt_bench(shared_data, 8)):
            first, second = conversation_turns(turns, "Answer. " * 50)
            w1, _ = worker_of(replicas[i % 2], first)
            replicas[i % 2].flush_affinity()  # the record is written in the background
            w2, reason = worker_of(replicas[(i + 1) % 2], second)
            assert (w2, reason) == (w1, "affinity"), f"conversation {i}"
        for replica in replicas:
            replica.flush_affinity()
    finally:  # clean up first, assert after: a failure here must not leave keys behind
        client = redis.Redis.from_url(shared_redis_url())
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    assert keys, "affinity keys were written to Redis"


def test_redis_dies_and_returns(four_workers: list[RunningSim], start_gateway: StartGateway,
                                own_redis: OwnRedis, shared_data: Path) -> None:
    # The killed Redis refuses connections at once; `lookup_timeout` only has to outlast a live one's
    # answer on a busy machine (a lookup timing out is a miss and opens the breaker).
    gw = start_gateway([affinity_pool(four_workers)], redis_url=own_redis.url,
                       affinity={"retry_after": 0.3, "lookup_timeout": 1.0}, load={"enabled": False})
    conversations = [list(conversation_turns(t, "Answer. " * 50)) for t in mt_bench(shared_data, 20)]

    def turn_pair(conversation: list[list[dict[str, str]]]) -> tuple[str, str, str]:
        w1, _ = worker_of(gw, conversation[0])
        gw.flush_affinity()
        w2, reason = worker_of(gw, conversation[1])
        return w1, w2, reason

    w1, w2, reason = turn_pair(conversations[0])
    assert (w2, reason) == (w1, "affinity")

    own_redis.kill()
    for conversation in conversations[1:5]:   # every request still succeeds, without affinity
        _, _, reason = turn_pair(conversation)
        assert reason == "no_match"
    # The first call to meet the dead Redis opens the breaker: a lookup ("error") or the write after
    # a request ("skipped" lookups follow); either way the failure shows and no request failed.
    failed_lookups = sum(gw.metric(f'kimi_gateway_affinity_lookups_total{{pool="p",result="{result}"}}')
                         for result in ("error", "skipped"))
    assert failed_lookups >= 1
    redis_errors = sum(gw.metric(f'kimi_gateway_redis_errors_total{{op="{op}"}}') for op in ("lookup", "write"))
    assert redis_errors >= 1

    own_redis.start()                         # Redis is back (empty): affinity resumes by itself
    store = gw.server.app.state.gateway.affinity
    deadline = time.monotonic() + 5
    # The breaker skips Redis for `retry_after` (0.3 s). Each pooled connection to the killed server
    # fails once when next used (a lookup's, the writer's), opening the breaker again: wait until a
    # conversation gets its affinity back (every request meanwhile still succeeds), then it must hold.
    spare = iter(conversations[8:])
    while not (store.available and turn_pair(next(spare))[2] == "affinity"):
        assert time.monotonic() < deadline, "affinity did not resume after Redis came back"
        time.sleep(0.02)
    hits_before = gw.metric('kimi_gateway_affinity_lookups_total{pool="p",result="hit"}')
    for conversation in conversations[5:8]:
        w1, w2, reason = turn_pair(conversation)
        assert (w2, reason) == (w1, "affinity")
    assert gw.metric('kimi_gateway_affinity_lookups_total{pool="p",result="hit"}') >= hits_before + 3


def test_unreachable_redis_at_start_up_does_not_block(four_workers: list[RunningSim], start_gateway: StartGateway,
                                                      unused_port: int) -> None:
    started = time.monotonic()
    gw = start_gateway([affinity_pool(four_workers)], redis_url=f"redis://127.0.0.1:{unused_port}/0")
    assert time.monotonic() - started < 5
    assert worker_of(gw, [{"role": "user", "content": "hello"}])[1] == "no_match"
    assert httpx.get(gw.url + "/ready").status_code == 200
