"""The heartbeat stage (gateway/api/heartbeat.py) on a real event loop: a heartbeat only after an
interval of silence at an event boundary, never inside an event, none after `stop()`, and none
for a stream that is off or not SSE."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from gateway.api.heartbeat import Heartbeat, heartbeat

BEAT = b": keep-alive\n\n"
INTERVAL = 0.05


class Recorder:
    """An ASGI send that keeps what it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.bodies.append(message["body"])


async def silence(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def first_beat(send: Recorder, bound: float = 10.0) -> list[bytes]:
    """What `send` got once it got something (polled; AssertionError after `bound` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not send.bodies:
        assert loop.time() < deadline, "no heartbeat"
        await asyncio.sleep(INTERVAL / 5)
    return list(send.bodies)


def test_beats_come_only_at_event_boundaries_after_a_silence() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes], list[bytes], int]:
        send = Recorder()
        beat = Heartbeat(send, BEAT, INTERVAL)
        try:
            beat.passed(b"data: {\"a\": 1}\n\n")
            at_boundary = await first_beat(send)
            send.bodies.clear()
            beat.passed(b"data: {\"half")  # an event cut in two reads: no heartbeat may land inside it
            await silence(INTERVAL * 6)
            inside = list(send.bodies)
            beat.passed(b"\": 2}\r\n\r\n")
            after = await first_beat(send)
            await beat.stop()
            count = len(send.bodies)
            await silence(INTERVAL * 4)
            return at_boundary, inside, after, count - len(send.bodies)
        finally:
            beat.cancel()

    at_boundary, inside, after, after_stop = asyncio.run(scenario())
    assert at_boundary and set(at_boundary) == {BEAT}  # several intervals: one or more, only heartbeats
    assert inside == []
    assert after and set(after) == {BEAT}
    assert after_stop == 0


def test_a_busy_stream_gets_no_heartbeat() -> None:
    async def scenario() -> list[bytes]:
        send = Recorder()
        beat = Heartbeat(send, BEAT, 2.0)
        try:
            for _ in range(30):  # a chunk every 0.1 s for 3 s: never silent for a whole interval
                beat.passed(b"data: x\n\n")
                await silence(0.1)
            return send.bodies
        finally:
            beat.cancel()

    assert asyncio.run(scenario()) == []


def test_stop_waits_for_a_heartbeat_being_sent() -> None:
    async def scenario() -> tuple[bool, int]:
        release = asyncio.Event()
        sent: list[bytes] = []

        async def slow_send(message: MutableMapping[str, Any]) -> None:
            await release.wait()  # a client that is slow to read: the heartbeat's write waits
            sent.append(message["body"])

        beat = Heartbeat(slow_send, BEAT, INTERVAL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while beat.beating is None:
            assert loop.time() < deadline, "no heartbeat"
            await silence(INTERVAL / 5)
        stopping = asyncio.ensure_future(beat.stop())
        await silence(INTERVAL)
        waited = not stopping.done()
        release.set()
        await stopping
        beat.cancel()
        return waited, len(sent)

    waited, sent = asyncio.run(scenario())
    assert waited and sent == 1


def test_off_or_not_sse_means_no_stage() -> None:
    async def scenario() -> list[object]:
        send = Recorder()
        made = [heartbeat(send, BEAT, None, True), heartbeat(send, BEAT, 1.0, False)]
        on = heartbeat(send, BEAT, 1.0, True)
        assert on is not None
        on.cancel()
        return made

    assert asyncio.run(scenario()) == [None, None]
