"""The load generator: replay a schedule of chat requests against one endpoint and time them.

One `httpx.AsyncClient` sends every request at its scheduled time (seconds after the start) as a
streaming chat completion with `stream_options.include_usage`, so the client sees the time to the
first token (TTFT), the time per output token after it (TPOT) and the engine's usage (prompt and
cached tokens). Every request carries its id (`request_id_for`) twice: as `x-request-id` and as the
body's `x_request_tag`, so the simulated worker that served it can be found behind any router
(`gateway.sim.timings`: SGLang's router forwards the header and drops unknown body fields, the
gateway replaces the header with its own engine request id and relays the field). Bounds: at most
`max_concurrency` requests in flight (the dispatcher waits for a free slot, so later requests may
start late: the lag is recorded), nothing is sent after `max_seconds`, and requests still running
then get at most `drain_seconds` more before they are cancelled and counted as errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import orjson

from loadtest.trace import ScheduledRequest

WORKER_HEADER = "x-kimi-gateway-worker"
"""Response header naming the worker the gateway chose (absent behind other routers)."""


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. Times in seconds; tokens as the engine reported them.

    `scheduled_s` / `sent_s`: offsets from the replay start; `sent_at`: the send time on the host's
    monotonic clock (`time.monotonic()`, comparable with the simulated workers' record times on
    the same machine); `request_id`: the id it was sent with; `ttft_s`: from sending to the first
    content token; `tpot_s`: from the first to the last content token / (output tokens - 1), output
    tokens from the usage (else the content events), None for fewer than 2; `e2e_s`: from sending
    to the end of the stream. `cached_tokens` is None when the
    usage carried no `prompt_tokens_details`. `error` is None for a complete, successful stream.
    """

    index: int
    scheduled_s: float
    request_id: str | None = None
    sent_s: float | None = None
    sent_at: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    worker: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Bounds of one replay. Seconds, except `max_concurrency` (requests)."""

    max_concurrency: int = 256
    max_seconds: float = 600.0
    drain_seconds: float = 60.0
    read_timeout: float = 120.0


BodyBuilder = Callable[[ScheduledRequest, str], bytes]
"""Builds the JSON body of one scheduled request, given its request id (to put in the body as
`TAG_FIELD`)."""

TAG_FIELD = "x_request_tag"
"""The body field carrying the request id (`gateway.sim.timings.TAG_FIELD`, which the simulated
workers record)."""


def request_id_for(index: int) -> str:
    """The request id of the `index`-th request of a replay (`x-request-id` and `TAG_FIELD`)."""
    return f"replay-{index}"


def chat_body(model: str, text: str, max_tokens: int, tag: str | None = None) -> bytes:
    """A streaming chat completion request body with one user message (JSON bytes); `tag`, when
    given, goes into `TAG_FIELD` (a field engines and the gateway ignore)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tag is not None:
        body[TAG_FIELD] = tag
    return orjson.dumps(body)


class _StreamReader:
    """Incremental SSE parsing of one response: first-token time, usage, errors, `[DONE]`."""

    def __init__(self, result: RequestResult, started: float) -> None:
        self.result = result
        self.started = started
        self.done = False
        self._buffer = b""
        self._last_token_s: float | None = None
        self._content_events = 0

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                return
            line = self._buffer[:end].rstrip(b"\r")
            self._buffer = self._buffer[end + 1:]
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.result.error = f"bad SSE data: {data[:80]!r}"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            err = event["error"]
            message = err.get("message") if isinstance(err, dict) else err
            self.result.error = f"stream error: {str(message)[:200]}"
            return
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                self._last_token_s = time.monotonic() - self.started
                self._content_events += 1
                if self.result.ttft_s is None:
                    self.result.ttft_s = self._last_token_s
                break
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.result.prompt_tokens = usage.get("prompt_tokens")
            self.result.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.result.cached_tokens = int(details["cached_tokens"])

    def finish_tpot(self) -> None:
        """Set `tpot_s` once the stream ended: (last - first token time) / (output tokens - 1)."""
        tokens = self.result.completion_tokens or self._content_events
        first, last = self.result.ttft_s, self._last_token_s
        if first is not None and last is not None and tokens >= 2:
            self.result.tpot_s = (last - first) / (tokens - 1)


async def send_one(client: httpx.AsyncClient, url: str, body: bytes, result: RequestResult, t0: float) -> None:
    """Send one streaming request and fill `result` (never raises for HTTP or protocol errors)."""
    started = time.monotonic()
    result.sent_s, result.sent_at = started - t0, started
    headers = {"content-type": "application/json"}
    if result.request_id is not None:
        headers["x-request-id"] = result.request_id
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            result.status = resp.status_code
            result.worker = resp.headers.get(WORKER_HEADER)
            if resp.status_code != 200:
                raw = await resp.aread()
                result.error = f"HTTP {resp.status_code}: {raw[:200].decode('utf-8', 'replace')}"
                return
            reader = _StreamReader(result, started)
            async for chunk in resp.aiter_raw():
                reader.feed(chunk)
            if result.error is None and not reader.done:
                result.error = "stream ended without [DONE]"
            if result.error is None and result.ttft_s is None:
                result.error = "no content token"
            reader.finish_tpot()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:160]}"
    if result.error is None:
        result.e2e_s = time.monotonic() - started


async def replay(base_url: str, items: list[ScheduledRequest], build: BodyBuilder,
                 options: LoadOptions) -> tuple[list[RequestResult], float]:
    """Replay `items` against `base_url` + `/v1/chat/completions`.

    Returns one result per item (unsent items carry `error="not sent: deadline"`) and the wall time
    in seconds from the start until the last request finished or was cancelled.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=options.max_concurrency,
                          max_keepalive_connections=options.max_concurrency, keepalive_expiry=30.0)
    timeout = httpx.Timeout(connect=10.0, read=options.read_timeout, write=30.0, pool=None)
    results = [RequestResult(i, item.send_at_s, request_id_for(i)) for i, item in enumerate(items)]
    slots = asyncio.Semaphore(options.max_concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def run(item: ScheduledRequest, result: RequestResult, t0: float) -> None:
        try:
            await send_one(client, url, build(item, result.request_id or ""), result, t0)
        finally:
            slots.release()

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, http2=False) as client:
        t0 = time.monotonic()
        stop_at = t0 + options.max_seconds
        for item, result in zip(items, results, strict=True):
            now = time.monotonic()
            due = t0 + item.send_at_s
            if due > stop_at or now > stop_at:
                break
            if due > now:
                await asyncio.sleep(due - now)
            try:
                await asyncio.wait_for(slots.acquire(), timeout=max(0.0, stop_at - time.monotonic()))
            except TimeoutError:
                break
            task = asyncio.create_task(run(item, result, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=options.drain_seconds)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
    for result in results:
        if result.sent_s is None:
            result.error = "not sent: deadline"
        elif result.error is None and result.e2e_s is None:
            result.error = "cancelled: drain timeout"
    return results, wall
