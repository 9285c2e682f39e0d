"""BatchWriter: batches of at most WRITE_BATCH, a full queue drops and counts, flush waits for the
writes in flight, stop(flush=True) writes what is queued first."""

from __future__ import annotations

import asyncio

import pytest

from gateway.affinity.batch_writer import WRITE_BATCH, BatchWriter


@pytest.mark.anyio
async def test_batches_drops_and_flush() -> None:
    batches: list[list[int]] = []
    dropped: list[int] = []
    gate = asyncio.Event()

    async def write(batch: list[int]) -> None:
        await gate.wait()
        batches.append(batch)

    writer: BatchWriter[int] = BatchWriter(write, capacity=WRITE_BATCH + 1, dropped=dropped.append, name="t")
    writer.start()
    writer.put(0)
    await asyncio.sleep(0)  # the task takes item 0 and waits at the gate with it
    for i in range(1, WRITE_BATCH + 3):
        writer.put(i)
    assert dropped == [1]  # capacity WRITE_BATCH + 1 queued behind the one in flight: the last is refused
    gate.set()
    await writer.flush()
    assert [len(b) for b in batches] == [1, WRITE_BATCH, 1]
    assert sorted(i for b in batches for i in b) == list(range(WRITE_BATCH + 2))
    writer.put(99)
    await writer.stop(flush=True)
    assert batches[-1] == [99]
    await writer.flush()  # after stop: returns at once
