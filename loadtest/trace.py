"""Read the Mooncake conversation trace and turn it into a replay schedule.

The trace (JSON Lines) has one request per line: `timestamp` (ms since the trace start),
`input_length` and `output_length` (tokens) and `hash_ids` (one id per 512-token prompt block;
equal ids = equal prefix up to the end of that block). Arrivals come in buckets about 3 s apart
that share one timestamp; `schedule` spreads each bucket's requests evenly over the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

TRACE_BLOCK_TOKENS = 512
"""Tokens per trace block (one `hash_ids` entry)."""

DEFAULT_BUCKET_MS = 3000
"""Width of the last timestamp bucket (and the cap for any bucket), milliseconds."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One row of the trace. `timestamp_ms` in ms; lengths in tokens."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A trace request with its replay time: `send_at_s` seconds after the replay starts."""

    request: TraceRequest
    send_at_s: float
    max_tokens: int


def read_trace(path: str | Path, minutes: float | None = None, limit: int | None = None,
               from_minutes: float = 0.0) -> list[TraceRequest]:
    """Rows with `from_minutes * 60,000 ms <= timestamp < minutes * 60,000 ms` (no upper bound when
    `minutes` is None), at most `limit` of them, in order; `index` counts the rows kept (0, 1, ...).

    Raises ValueError for a malformed row (names the line) or a file that is not sorted by time.
    """
    cutoff_ms = None if minutes is None else minutes * 60_000.0
    start_ms = from_minutes * 60_000.0
    rows: list[TraceRequest] = []
    last_ts = -1
    with Path(path).open("rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = orjson.loads(line)
                row = TraceRequest(len(rows), int(raw["timestamp"]), int(raw["input_length"]),
                                   int(raw["output_length"]), tuple(int(h) for h in raw["hash_ids"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad trace row: {exc}") from exc
            if row.timestamp_ms < last_ts:
                raise ValueError(f"{path}:{line_no}: timestamps are not sorted")
            last_ts = row.timestamp_ms
            if cutoff_ms is not None and row.timestamp_ms >= cutoff_ms:
                break
            if row.timestamp_ms < start_ms:
                continue
            if row.input_length <= 0 or len(row.hash_ids) != math.ceil(row.input_length / TRACE_BLOCK_TOKENS):
                raise ValueError(f"{path}:{line_no}: hash_ids do not match input_length")
            rows.append(row)
    return rows


def _buckets(rows: list[TraceRequest]) -> Iterator[tuple[int, int, list[TraceRequest]]]:
    """(timestamp ms, bucket width ms, rows) per distinct timestamp, in order."""
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j].timestamp_ms == rows[i].timestamp_ms:
            j += 1
        gap = rows[j].timestamp_ms - rows[i].timestamp_ms if j < len(rows) else DEFAULT_BUCKET_MS
        yield rows[i].timestamp_ms, min(gap, DEFAULT_BUCKET_MS), rows[i:j]
        i = j


def output_tokens(output_length: int, scale: float) -> int:
    """`max_tokens` for a trace output length: `round(output_length * scale)`, at least 1."""
    return max(1, round(output_length * scale))


def schedule(rows: list[TraceRequest], speedup: float = 1.0, output_scale: float = 1.0) -> list[ScheduledRequest]:
    """Replay times: the k-th of m rows sharing a timestamp arrives k/m of the way through its
    bucket; times are relative to the first row and divided by `speedup` (> 0)."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    if not rows:
        return []
    origin = rows[0].timestamp_ms
    out: list[ScheduledRequest] = []
    for ts, width, bucket in _buckets(rows):
        for k, row in enumerate(bucket):
            at_ms = ts - origin + width * k / len(bucket)
            out.append(ScheduledRequest(row, at_ms / 1000.0 / speedup, output_tokens(row.output_length, output_scale)))
    return out


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Totals of a schedule: request count, span (s, after speedup), prompt tokens, distinct blocks."""

    requests: int
    span_s: float
    prompt_tokens: int
    output_tokens: int
    distinct_blocks: int


def summarize(items: list[ScheduledRequest]) -> TraceSummary:
    """Totals of a schedule; the span is the last send time (s, at least 1 ms)."""
    if not items:
        return TraceSummary(0, 0.0, 0, 0, 0)
    blocks: set[int] = set()
    for item in items:
        blocks.update(item.request.hash_ids)
    span = max(max(item.send_at_s for item in items), 1e-3)
    return TraceSummary(len(items), span, sum(i.request.input_length for i in items),
                        sum(i.max_tokens for i in items), len(blocks))
