"""The virtual-time tuning evaluator (loadtest/vtime.py): its clock, determinism, and that it tells
cache-keeping routing from cache-blind routing on a small synthetic trace."""

from __future__ import annotations

import asyncio

from loadtest import replay as rp
from loadtest.replay_settings import Settings
from loadtest.trace import ScheduledRequest, TraceRequest
from loadtest.vtime import VirtualTimeLoop, evaluate, prompt_key


def test_the_clock_jumps_to_the_next_timer() -> None:
    loop = VirtualTimeLoop()

    async def nap() -> tuple[float, float]:
        await asyncio.sleep(100.0)
        first = loop.time()
        await asyncio.gather(asyncio.sleep(5.0), asyncio.sleep(2.5))
        return first, loop.time()

    try:
        assert loop.run_until_complete(nap()) == (100.0, 105.0)
    finally:
        loop.close()


def test_prompt_keys_share_blocks_as_far_as_the_hash_ids_do() -> None:
    a = prompt_key((1, 2, 3), 1500, 16)
    b = prompt_key((1, 2, 9), 1500, 16)
    assert len(a.hashes) == 1500 // 16
    shared = next(i for i, (x, y) in enumerate(zip(a.hashes, b.hashes, strict=True)) if x != y)
    assert shared == 2 * 512 // 16


def _conversations(turns: int, talks: int) -> list[ScheduledRequest]:
    """`talks` conversations of `turns` turns, each turn's prompt the previous one plus 4 blocks."""
    items = []
    for turn in range(turns):
        for talk in range(talks):
            ids = tuple(talk * 1000 + b for b in range(4 * (turn + 1)))
            row = TraceRequest(len(items), 0, len(ids) * 512, 8, ids)
            items.append(ScheduledRequest(row, turn * 0.5 + talk * 0.01, 4))
    return items


def _settings() -> Settings:
    return rp.settings_from(rp.build_parser().parse_args(
        ["--workers", "2", "--kv-capacity", "200000", "--speedup", "1", "--no-gateway-time-scale"]))


def test_deterministic_and_affinity_keeps_more_of_the_cache_than_round_robin() -> None:
    s, items = _settings(), _conversations(turns=5, talks=3)
    first = evaluate(s, items, 50_000.0, "prefix_affinity")
    again = evaluate(s, items, 50_000.0, "prefix_affinity")
    blind = evaluate(s, items, 50_000.0, "round_robin")
    assert first.ttfts == again.ttfts and len(first.ttfts) == len(items)
    # Turn k > 0 finds k/(k+1) of its prompt cached on the conversation's worker: 0.56 over 5 turns.
    assert first.hit_ratio > 0.5
    assert blind.hit_ratio < first.hit_ratio - 0.2
    peer = evaluate(s, items, 50_000.0, "cache_aware")
    assert peer.hit_ratio > 0.5 and len(peer.ttfts) == len(items)
