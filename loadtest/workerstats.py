"""Per-worker totals of a run, read from the simulated engines themselves (and their request timings,
`GET /sim/timings`, for `loadtest.ttft_split`).

Preferred source: `GET /sim/stats` (counters in requests and tokens: `prompt_tokens`,
`cached_tokens`, `prefill_tokens`, ...), restarted with `DELETE /sim/stats` just before the replay.
Fallback for a simulator without it: the engine's Prometheus counter of prompt tokens on
`/metrics` (then cached tokens are unknown here and prefill = prompt tokens), as a difference of
two readings.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import httpx

COUNTERS = ("requests", "completed", "aborted", "errors", "prompt_tokens", "cached_tokens", "prefill_tokens",
            "generated_tokens", "evicted_tokens", "pd_transfers", "pd_transfer_seconds", "pd_transferred_tokens")
"""Monotonic `/sim/stats` fields, summed over a run (requests, tokens, or seconds). `pd_*` are a PD
worker's KV hand-over counters (`/sim/stats` `pd.transfers` ..., lifetime values: the run's are
differences from the baseline)."""

PEAKS = ("max_running", "max_waiting")
"""`/sim/stats` peak fields (requests) since the last reset."""

PROMPT_COUNTER_SUFFIX = "prompt_tokens_total"
"""Ending of the engines' prompt-token counter on /metrics (`sglang:prompt_tokens_total`)."""


@dataclass
class WorkerTotals:
    """One worker's totals over a run; `source` is "sim/stats" or "metrics"."""

    url: str
    source: str
    counters: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> float:
        return self.counters.get("prompt_tokens", 0.0)

    @property
    def cached_tokens(self) -> float | None:
        """Cached prompt tokens, None when the source does not know them."""
        return self.counters.get("cached_tokens")

    @property
    def prefill_tokens(self) -> float:
        """Uncached prompt tokens the worker computed."""
        if "prefill_tokens" in self.counters:
            return self.counters["prefill_tokens"]
        return self.prompt_tokens - (self.cached_tokens or 0.0)


def _prometheus_sum(text: str, suffix: str) -> float | None:
    """Sum of the samples of every metric whose name ends with `suffix` (None when absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(suffix):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


class StatsReader:
    """Takes a baseline of every worker before the replay and their totals after it."""

    def __init__(self, urls: list[str], timeout: float = 5.0) -> None:
        self.urls = urls
        self.timeout = timeout
        self._baseline: dict[str, tuple[str, dict[str, float]]] = {}

    async def _read(self, client: httpx.AsyncClient, url: str) -> tuple[str, dict[str, Any]]:
        try:
            resp = await client.get(url + "/sim/stats")
            if resp.status_code == 200:
                data = dict(resp.json())
                pd = data.get("pd")
                if isinstance(pd, dict):
                    data.update({f"pd_{key}": value for key, value in pd.items()})
                return "sim/stats", data
            resp = await client.get(url + "/metrics")
            value = _prometheus_sum(resp.text, PROMPT_COUNTER_SUFFIX) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return "unavailable", {}
        return ("metrics", {"prompt_tokens": value}) if value is not None else ("unavailable", {})

    async def start(self) -> None:
        """Restart `/sim/stats` (counters and peaks) and clear `/sim/timings` where supported, then
        note the counters as the baseline (about zero after a restart; the totals so far with the
        fallback)."""
        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
            for url in self.urls:
                with contextlib.suppress(httpx.HTTPError):
                    await client.delete(url + "/sim/stats")
                with contextlib.suppress(httpx.HTTPError):
                    await client.delete(url + "/sim/timings")
                source, data = await self._read(client, url)
                numbers = {k: float(v) for k, v in data.items() if k in COUNTERS and v is not None}
                self._baseline[url] = (source, numbers)

    async def finish(self) -> list[WorkerTotals]:
        """Every worker's counters since `start()` (peaks as reported)."""
        out = []
        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
            for url in self.urls:
                source, data = await self._read(client, url)
                _, base = self._baseline.get(url, (source, {}))
                counters = {k: float(data[k]) - base.get(k, 0.0) for k in COUNTERS if data.get(k) is not None}
                peaks = {k: float(data[k]) for k in PEAKS if data.get(k) is not None}
                out.append(WorkerTotals(url, source, counters, peaks))
        return out

    async def timings(self) -> tuple[list[list[dict[str, Any]]], int]:
        """Every worker's request timings since `start()` (`GET /sim/timings`, worker order; an
        empty list for a worker without them) and how many they dropped (their bound was reached)."""
        out: list[list[dict[str, Any]]] = []
        dropped = 0
        async with httpx.AsyncClient(timeout=max(self.timeout, 30.0), trust_env=False) as client:
            for url in self.urls:
                try:
                    resp = await client.get(url + "/sim/timings")
                    data = resp.json() if resp.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    data = {}
                timings = data.get("timings") if isinstance(data, dict) else None
                out.append(list(timings) if isinstance(timings, list) else [])
                dropped += int(data.get("dropped") or 0) if isinstance(data, dict) else 0
        return out, dropped
