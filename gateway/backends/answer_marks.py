"""What a worker answered lately, for comparing a silent worker with its peers (outlier ejection).

A client that hangs up on a request whose worker sent nothing says something about that worker
only if the worker should have answered by then. Its own budget cannot tell (a non-streamed
answer's budget is minutes, its client's patience seconds); its peers can: if a peer answered a
request that was sent after this one and that the gateway gives at least as much time (its answer
budget, `dispatch/attempt.py` `budgets`: the first-content budget of a stream, the whole answer
budget of a non-streamed request, both growing with the prompt and the output limit), while this
worker answered nothing at all, this worker is behind its peers by more than any request's own
length explains (`Ledger.hang_up_verdict`).

Response headers are the answer compared: a stream's come before its prefill (vLLM, SGLang and
llama.cpp send them once the request is tokenized), a non-streamed request's with its whole answer.
So a silent stream compares with any answer its peers gave; a silent non-streamed request only with
non-streamed answers (a stream's headers say nothing of how long a whole answer takes).

State per worker: for each power of two of the budget (seconds), the latest request of that size
class that got its headers (when it was sent, its budget), twice (any answer, non-streamed answers):
`2 x BUCKETS` pairs of floats, no history.
"""

from __future__ import annotations

import math

BUCKETS = 40
"""Size classes: budgets below 2^-8 s share the first, above 2^31 s the last."""
_OFFSET = 8


def _bucket(budget: float) -> int:
    """The size class of a budget (seconds): its binary exponent, offset and clamped."""
    if budget <= 0.0:
        return 0
    return min(max(math.frexp(budget)[1] + _OFFSET, 0), BUCKETS - 1)


class _Latest:
    """Per size class, the latest answered request: when it was sent and its budget (seconds)."""

    __slots__ = ("budget", "sent")

    def __init__(self) -> None:
        self.sent = [-math.inf] * BUCKETS
        self.budget = [0.0] * BUCKETS

    def mark(self, sent_at: float, budget: float) -> None:
        i = _bucket(budget)
        if sent_at >= self.sent[i]:
            self.sent[i] = sent_at
            self.budget[i] = budget

    def since(self, since: float, budget: float) -> bool:
        i = _bucket(budget)
        if self.sent[i] >= since and self.budget[i] >= budget:
            return True
        return any(sent >= since for sent in self.sent[i + 1:])


class AnswerMarks:
    """A worker's latest answers by size class (see the module docstring). Times are
    `time.perf_counter()` seconds; budgets seconds. Touched only on the event loop."""

    __slots__ = ("_any", "_whole")

    def __init__(self) -> None:
        self._any = _Latest()
        self._whole = _Latest()

    def mark(self, sent_at: float, budget: float, stream: bool) -> None:
        """A request sent at `sent_at` with answer budget `budget` got its response headers
        (`stream`: a stream's, before its prefill; else its whole answer's)."""
        self._any.mark(sent_at, budget)
        if not stream:
            self._whole.mark(sent_at, budget)

    def answered_since(self, since: float, budget: float, stream: bool) -> bool:
        """Whether a request sent at or after `since` with a budget of at least `budget` got its
        headers here: any answer for a silent stream (`stream`), a whole answer for a silent
        non-streamed request. Exact within a size class but for the latest request of each
        (an earlier, larger one of the same class is forgotten: a miss, never a false match)."""
        return (self._any if stream else self._whole).since(since, budget)
