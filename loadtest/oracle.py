"""Offline reference hit ratios for a trace, computed from its hash ids alone (no servers).

Each worker is modelled as an LRU cache of `capacity_tokens` holding whole 512-token trace blocks;
a request hits its longest cached prefix of blocks (a block counts with its real token count, so
the partly filled last block counts partly). Two references:

- `round_robin`: requests dealt to N workers in turn, each with its own cache;
- `ideal`: one cache of N x `capacity_tokens` (every request sees every earlier prompt), an upper
  bound for any router, with perfect load balance ignored.

Concurrency, pinning and the simulator's 16-token blocks are ignored, so the simulator's figures
differ by a few points; the gap between the two references is what routing can win.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest


class BlockLRU:
    """An LRU cache of trace blocks with a capacity in tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()

    def hit_tokens(self, blocks: list[tuple[int, int]]) -> int:
        """Tokens of the longest cached prefix of `blocks` ((id, tokens) pairs)."""
        hit = 0
        for block_id, tokens in blocks:
            if block_id not in self._blocks:
                break
            hit += tokens
        return hit

    def insert(self, blocks: list[tuple[int, int]]) -> None:
        """Cache (or refresh) every block, then evict the least recently used beyond capacity."""
        for block_id, tokens in blocks:
            if block_id in self._blocks:
                self._blocks.move_to_end(block_id)
            else:
                self._blocks[block_id] = tokens
                self.used_tokens += tokens
        while self.used_tokens > self.capacity_tokens and self._blocks:
            _, tokens = self._blocks.popitem(last=False)
            self.used_tokens -= tokens


def request_blocks(request: TraceRequest) -> list[tuple[int, int]]:
    """(hash id, tokens) per block of a request; the last block holds the remainder."""
    ids = request.hash_ids
    last = request.input_length - TRACE_BLOCK_TOKENS * (len(ids) - 1)
    return [(h, TRACE_BLOCK_TOKENS if i < len(ids) - 1 else last) for i, h in enumerate(ids)]


@dataclass(frozen=True, slots=True)
class OracleResult:
    """A reference: hit ratio (cached / prompt tokens) and busiest worker's prefill / mean."""

    name: str
    hit_ratio: float
    prefill_max_over_mean: float


def _simulate(rows: list[TraceRequest], workers: int, capacity_tokens: int) -> OracleResult:
    caches = [BlockLRU(capacity_tokens) for _ in range(workers)]
    prefill = [0] * workers
    hit_total = prompt_total = 0
    for i, row in enumerate(rows):
        w = i % workers
        blocks = request_blocks(row)
        hit = caches[w].hit_tokens(blocks)
        caches[w].insert(blocks)
        hit_total += hit
        prompt_total += row.input_length
        prefill[w] += row.input_length - hit
    mean = sum(prefill) / workers if workers else 0.0
    name = "round_robin" if workers > 1 else "ideal"
    return OracleResult(name, hit_total / prompt_total if prompt_total else 0.0,
                        max(prefill) / mean if mean else 0.0)


def references(rows: list[TraceRequest], workers: int, capacity_tokens: int) -> list[OracleResult]:
    """The `round_robin` and `ideal` references for `rows` (about 1 s for 8,000 requests)."""
    rr = _simulate(rows, workers, capacity_tokens)
    ideal = _simulate(rows, 1, capacity_tokens * workers)
    return [rr, OracleResult("ideal", ideal.hit_ratio, 1.0)]
