"""Running counters of one simulated worker (`GET /sim/stats`) and its recent prefix-cache hit rate.

Counters only ever grow (so `/metrics` counters stay monotonic); `GET /sim/stats` reports them
minus a baseline taken by the last `DELETE /sim/stats`. Everything is O(1) per event: nothing scans
the request records.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields


@dataclass(slots=True)
class SimTotals:
    """Monotonic counters (requests or tokens) of one worker.

    - `requests`: generation requests received (body read).
    - `completed`: requests that ran to their finish reason ("stop" or "length").
    - `aborted`: requests whose client hung up before the response completed (while queued, in
      prefill or mid-stream).
    - `errors`: responses sent with an HTTP status >= 400 (context too long, injected faults, ...).
    - `prompt_tokens`: prompt tokens of admitted requests (as `vllm:prompt_tokens_total`).
    - `cached_tokens`: of those, tokens found in the prefix cache at admission.
    - `prefill_tokens`: uncached prompt tokens whose prefill finished (a request aborted during
      its prefill adds none; with the step scheduler a preempted request's recomputation counts
      again, as it is work done).
    - `generated_tokens`: output tokens generated.
    - `evicted_tokens`: tokens evicted from the prefix cache.
    - `preemptions`: running requests preempted for KV room (step scheduler only; vLLM's
      `vllm:num_preemptions`, SGLang's retractions).
    """

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    evicted_tokens: int = 0
    preemptions: int = 0

    def copy(self) -> SimTotals:
        """An independent copy."""
        return SimTotals(**asdict(self))

    def minus(self, baseline: SimTotals) -> SimTotals:
        """These counters minus `baseline` (counts since the baseline was taken)."""
        return SimTotals(**{f.name: getattr(self, f.name) - getattr(baseline, f.name) for f in fields(self)})

    def to_json(self) -> dict[str, int]:
        """The counters as a JSON-ready dict."""
        return asdict(self)


class HitRateWindow:
    """Prefix-cache hit rate (cached / prompt tokens, 0 to 1) over the last `size` admitted requests.

    Stands in for SGLang's `sglang:cache_hit_rate` gauge, which the scheduler sets from the tokens
    of its latest prefill batches (hit tokens / (new + hit tokens)): a recent rate, not a lifetime
    one.
    """

    def __init__(self, size: int = 64) -> None:
        self._items: deque[tuple[int, int]] = deque()
        self._size = size
        self._cached = 0
        self._prompt = 0

    def add(self, cached_tokens: int, prompt_tokens: int) -> None:
        """Note one admitted request."""
        self._items.append((cached_tokens, prompt_tokens))
        self._cached += cached_tokens
        self._prompt += prompt_tokens
        if len(self._items) > self._size:
            old_cached, old_prompt = self._items.popleft()
            self._cached -= old_cached
            self._prompt -= old_prompt

    @property
    def rate(self) -> float:
        """Cached / prompt tokens over the window (0.0 when empty)."""
        return self._cached / self._prompt if self._prompt > 0 else 0.0
