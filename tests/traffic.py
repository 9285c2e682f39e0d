"""Steady streaming traffic through a gateway with the openai SDK, counting every failure."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import openai


@dataclass
class Traffic:
    """`clients` loops, each sending one streamed chat completion of `max_tokens` after another
    until `stop()`. A request counts as ok only when its stream ends with a finish reason and
    exactly `max_tokens` content chunks; anything else (an HTTP error, a cut stream, a short
    answer) is kept in `failures`. The SDK's own retries are off, so none is hidden. `api_key`
    is the client key sent (any string with auth off)."""

    base_url: str
    clients: int = 6
    max_tokens: int = 12
    api_key: str = "unused"
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _one(self, client: openai.AsyncOpenAI) -> None:
        chunks = 0
        finish = None
        stream = await client.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "count for me"}], stream=True,
            max_tokens=self.max_tokens)
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    chunks += 1
                finish = choice.finish_reason or finish
        if finish is None or chunks != self.max_tokens:
            raise AssertionError(f"incomplete stream: {chunks} chunks, finish_reason {finish}")

    async def _loop(self) -> None:
        async with openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0,
                                      timeout=30) as client:
            while not self._stopping.is_set():
                try:
                    await self._one(client)
                    self.ok += 1
                except Exception as exc:  # every failure is what the test counts
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(self.clients)]
        return self

    async def wait_ok(self, more: int, timeout: float = 20.0) -> None:
        """Wait until `more` further requests succeeded (traffic really flows)."""
        target = self.ok + more
        async with asyncio.timeout(timeout):
            while self.ok < target:
                assert not self.failures, self.failures[:3]
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Let every loop finish its current request, then return."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)
