"""A committed stream whose decode leg is not open yet (a vLLM NIXL prefill that outlasts the hold
window), and the message its failure ends with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.dispatch.answers import RelayResponse
from gateway.errors import UpstreamError
from gateway.protocol.sse import sse_error_event
from gateway.streaming import KEEPALIVE_COMMENT, AttemptFailed, Holding, Migrating, UpstreamStream


def after_commit_message(exc: Exception) -> str:
    """The SSE error message of a committed stream whose legs failed (`exc`) before its first content."""
    if isinstance(exc, AttemptFailed) and exc.status is not None and 400 <= exc.status < 500:
        return f"The inference server refused the request ({exc.detail})."
    return f"The inference server failed before the first token ({exc}); the response is incomplete."


class DeferredStream:
    """A committed stream whose upstream is not open yet: a vLLM NIXL prefill leg that outlasts the
    hold window (`timeouts.hold_headers`). The client gets its 200 and `: keep-alive` comments every
    `keepalive` seconds while `start()` runs (the prefill leg's end, then the decode leg's opening);
    then the decode stream's bytes (`UpstreamStream.body`). A failure of `start()` ends the stream
    with one SSE error event (`on_failure(exc)` accounts it and returns its message), as any failure
    after a commit does. Owns `holding` (both slots, the prefill leg) until `start()` hands it to
    the decode stream; `aclose()` (idempotent) releases whatever it still holds. Quacks as
    `UpstreamStream` for the relay (`body`, `aclose`, `sse`) and for a migration (`migration`,
    `continuation`: handed to the decode stream once it opens, gateway/dispatch/migration.py)."""

    sse = True

    def __init__(self, start: Callable[[Holding], Awaitable[RelayResponse]], holding: Holding,
                 keepalive: float | None, on_failure: Callable[[Exception], str]) -> None:
        self._start = start
        self.holding = holding
        self._keepalive = keepalive
        self._on_failure = on_failure
        self._inner: RelayResponse | None = None
        self._closed = False
        self.migration: Migrating | None = None  # the decode stream's, once it opens
        self.continuation = False

    async def body(self) -> AsyncIterator[bytes]:
        """Keep-alives until the decode stream opened, then its bytes; one SSE error on failure."""
        task = asyncio.ensure_future(self._start(self.holding))
        try:
            while not task.done():
                await asyncio.wait((task,), timeout=self._keepalive)
                if not task.done():
                    yield KEEPALIVE_COMMENT
            try:
                self._inner = task.result()
            except (AttemptFailed, UpstreamError) as exc:
                yield sse_error_event(self._on_failure(exc))
                return
            inner = self._inner.stream
            if isinstance(inner, UpstreamStream):  # a mid-stream failure of the decode leg may migrate
                inner.migration, inner.continuation = self.migration, self.continuation
            async for chunk in inner.body():
                yield chunk
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
            await self.aclose()

    async def aclose(self) -> None:
        """Release what it still holds: the decode stream once open, else the Holding; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._inner is not None:
                await self._inner.stream.aclose()
        finally:
            if self.holding:
                await self.holding.aclose()
