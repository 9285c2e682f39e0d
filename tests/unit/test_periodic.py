"""PeriodicEach: one loop per item, so a stuck item holds back no other."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends.periodic import PeriodicEach


@pytest.mark.anyio
async def test_a_stuck_item_delays_none_of_the_others() -> None:
    rounds: dict[str, int] = {"stuck": 0, "a": 0, "b": 0}
    three_each = asyncio.Event()
    never = asyncio.Event()

    async def round_fn(item: str) -> None:
        rounds[item] += 1
        if item == "stuck":
            await never.wait()  # a worker that never finishes its answer
        if item == "b" and rounds[item] == 2:
            raise RuntimeError("one bad round")  # logged; the loop goes on
        if rounds["a"] >= 3 and rounds["b"] >= 3:
            three_each.set()

    loops = PeriodicEach("test", 0.01, ["stuck", "a", "b"], round_fn)
    loops.start()
    try:
        async with asyncio.timeout(5):
            await three_each.wait()
    finally:
        await loops.stop()
    assert rounds["stuck"] == 1 and rounds["a"] >= 3 and rounds["b"] >= 3
    counts = dict(rounds)
    await asyncio.sleep(0.05)  # stopped: no loop runs any more
    assert rounds == counts
