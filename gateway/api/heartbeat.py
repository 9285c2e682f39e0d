"""Heartbeats in a relayed SSE stream: a stage beside the relay that keeps idle proxies from cutting it.

A stream can go silent for long after its headers went out: a prefill longer than
`timeouts.hold_headers`, a reasoning step or a slow tool call between two events, a migration's
continuation prefilling. A load balancer or proxy with an idle timeout shorter than the silence
(60 s on AWS ALB) then cuts the connection. So once `timeouts.keepalive_interval` seconds passed
without a byte to the client, the gateway sends its API's heartbeat (`Dialect.heartbeat`), and again
every interval while the silence lasts:

- an SSE comment, `: keep-alive` and a blank line, on the OpenAI APIs (chat, completions,
  Responses). Comments are the SSE spec's heartbeat (https://html.spec.whatwg.org/multipage/server-sent-events.html:
  a line starting with ":" is ignored); the OpenAI Python SDK's decoder drops them
  (`openai/_streaming.py` `SSEDecoder.decode`), as the Node SDK's does;
- Anthropic's own heartbeat on the Messages API, `event: ping` with `data: {"type": "ping"}`, which
  Anthropic's API sends itself (https://docs.claude.com/en/docs/build-with-claude/streaming) and
  its SDKs skip (`anthropic/_streaming.py` `Stream.__stream__`: `if sse.event == "ping": continue`).

Where: only at an event boundary. The relay passes whole events (the stream cuts the engine's bytes
at event ends, `gateway.streaming.UpstreamStream.body`), and this stage checks it too: a heartbeat
goes out only while the last bytes relayed end an event (a blank line, `\\n\\n` or `\\r\\n\\r\\n`, as
`gateway.protocol.sse.event_end` reads them), so it never lands inside an engine's event, nor after
a last event that lacks its blank line. It is written after the stream's SSE tap: the usage, the
event count and the access log never see it.

Cost: no task or timer per chunk. One timer per stream wakes once per interval and compares the
time of the last relayed chunk (`passed`, an attribute write per chunk); a heartbeat is sent from a
short task of its own, and the relay waits for that send to finish before its next one
(`Heartbeat.beating`), so two writes never interleave and the stream's last message always comes
after the last heartbeat (`stop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
"""How the relayed bytes end when they end an SSE event (`gateway.protocol.sse.event_end`)."""


class Heartbeat:
    """The heartbeats of one relayed stream: `beat` (bytes: whole SSE events or comments) through
    `send` (the ASGI send of the started response) after every `interval` seconds without a relayed
    chunk, at event boundaries only (module docstring).

    The relay calls, per chunk: `await settle()` when `beating` is not None (a heartbeat's send still
    running), then `passed(chunk)`, then its own send; before the stream's last message `await stop()`;
    and `cancel()` in its cleanup (idempotent). `sent`: heartbeats sent so far."""

    __slots__ = ("_beat", "_interval", "_loop", "_send", "_timer", "at_boundary", "beating", "last", "sent",
                 "stopped")

    def __init__(self, send: Send, beat: bytes, interval: float) -> None:
        self._send = send
        self._beat = {"type": "http.response.body", "body": beat, "more_body": True}
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()  # event-loop seconds of the last relayed chunk (or heartbeat)
        self.at_boundary = True  # the bytes relayed so far end an event (nothing relayed yet: they do)
        self.beating: asyncio.Task[None] | None = None
        self.sent = 0
        self.stopped = False
        self._timer = self._loop.call_at(self.last + interval, self._due)

    def passed(self, chunk: bytes) -> None:
        """The relay is sending `chunk`: the silence restarts, and whether the stream is then at an
        event boundary is read from its end (an empty chunk changes nothing)."""
        self.last = self._loop.time()
        if chunk:
            self.at_boundary = chunk.endswith(EVENT_ENDS)

    def _due(self) -> None:
        """The timer: a heartbeat when the stream has been silent for an interval at an event
        boundary (and none is being sent), then the next check an interval after the later of now
        and the last chunk."""
        if self.stopped:
            return
        now = self._loop.time()
        due = self.last + self._interval
        if now >= due:
            if self.at_boundary and self.beating is None:
                self.beating = self._loop.create_task(self._send_beat())
            due = now + self._interval
        self._timer = self._loop.call_at(due, self._due)

    async def _send_beat(self) -> None:
        try:
            await self._send(self._beat)
            self.sent += 1
        except (OSError, RuntimeError):  # the client is gone: the relay learns it from its own send or hang-up watch
            pass
        finally:
            self.last = self._loop.time()
            self.beating = None

    async def settle(self) -> None:
        """Return once no heartbeat is being sent (the relay's next send may go)."""
        if self.beating is not None:
            await asyncio.wait((self.beating,))

    async def stop(self) -> None:
        """No heartbeat after this: the timer is cancelled and a heartbeat being sent is waited for
        (call before the stream's last message)."""
        self.stopped = True
        self._timer.cancel()
        await self.settle()

    def cancel(self) -> None:
        """Stop at once (the relay ends or is cancelled): the timer and any heartbeat being sent."""
        self.stopped = True
        self._timer.cancel()
        if self.beating is not None:
            self.beating.cancel()


def heartbeat(send: Send, beat: bytes | None, interval: float | None, sse: bool) -> Heartbeat | None:
    """The heartbeats of a stream just started on `send` (the ASGI send of its started response):
    None when off (`interval` None, no `beat` for its API, or a body that is not SSE)."""
    if interval is None or beat is None or not sse:
        return None
    return Heartbeat(send, beat, interval)
