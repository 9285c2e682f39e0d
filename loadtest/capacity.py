"""How busy the simulated workers are: the replay's capacity model, in one place.

The replay targets a utilisation (offered load / capacity) by choosing the speed-up of the trace
(`speedup_for_utilisation`) or, for `--prefill-tps auto`, the workers' prefill speed
(`prefill_for_utilisation`). Both invert `utilisation`, which reads the simulator's settings
(the `SimConfig` fields the workers are started with) through `service_seconds` and
`worker_capacity_rps`. When the simulator's service model changes, those two are the only
functions to update. Both of the simulator's models (`SimConfig.scheduler`) are covered:

- "stepped" (`gateway.sim.stepper`, one prefill budget per worker): the budget is busy
  `prompt_tokens / prefill_tokens_per_s + prompt_tokens / chunk_tokens x decode_step_s` seconds
  per request (its prefill, plus the fixed part of the steps its chunks take); decode steps fill
  the gaps between prefills and are not counted. Capacity = 1 / that requests/s.
- "per_request": a request holds one of `max_num_seqs` slots for `ttft_s + prompt_tokens /
  prefill_tokens_per_s + output_tokens x tpot_s x (1 + decode_batch_slowdown x (max_num_seqs -
  1))` seconds (decode counted at a full batch: an upper bound). Capacity = `max_num_seqs / that`.

Offered load counts every prompt token as uncached (no cache hit): a policy's cache hits and
balance then decide how far below capacity each worker really runs, which is what the replay
compares.

    utilisation = (requests / trace span at 1x x speedup / workers) / capacity of one worker
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.sim.config import SimConfig
from gateway.sim.stepper import DEFAULT_PREFILL_TOKENS_PER_S


@dataclass(frozen=True, slots=True)
class Workload:
    """What the trace offers, independent of the speed-up: `requests` over `span_s_1x` seconds of
    trace time (from the first to the last arrival), mean prompt and output tokens a request."""

    requests: int
    span_s_1x: float
    mean_prompt_tokens: float
    mean_output_tokens: float

    @property
    def rate_1x(self) -> float:
        """Arrivals per second of trace time (requests/s at speed-up 1)."""
        return self.requests / self.span_s_1x

    @classmethod
    def from_totals(cls, requests: int, span_s: float, speedup: float, prompt_tokens: int,
                    output_tokens: int) -> Workload:
        """From a schedule's totals (`loadtest.trace.TraceSummary`): `span_s` seconds at `speedup`."""
        if requests <= 0 or span_s <= 0 or speedup <= 0:
            raise ValueError("a workload needs requests, a positive span and a positive speed-up")
        return cls(requests, span_s * speedup, prompt_tokens / requests, output_tokens / requests)


def _field(sim: Mapping[str, Any], name: str) -> Any:
    """A SimConfig field of the workers: the given value, else the SimConfig default."""
    if name in sim:
        return sim[name]
    info = SimConfig.model_fields.get(name)
    return None if info is None else info.default


def stepped(sim: Mapping[str, Any]) -> bool:
    """True when the workers run the step scheduler (one shared prefill budget)."""
    return _field(sim, "scheduler") == "stepped"


def service_seconds(sim: Mapping[str, Any], load: Workload) -> float:
    """Mean seconds a request occupies a worker with no cache hit (see the module docstring): of
    its prefill budget (stepped) or of one of its slots (per_request).

    `sim`: SimConfig fields (missing ones take SimConfig's defaults). Raises ValueError when the
    request would take no time (no latency model: capacity is unbounded).
    """
    if stepped(sim):
        budget = float(_field(sim, "prefill_tokens_per_s") or DEFAULT_PREFILL_TOKENS_PER_S)
        steps = load.mean_prompt_tokens / float(_field(sim, "chunk_tokens"))
        return load.mean_prompt_tokens / budget + steps * float(_field(sim, "decode_step_s") or 0.0)
    prefill_tps = _field(sim, "prefill_tokens_per_s")
    slots = _field(sim, "max_num_seqs") or 1
    decode_factor = 1.0 + float(_field(sim, "decode_batch_slowdown") or 0.0) * (slots - 1)
    seconds = float(_field(sim, "ttft_s") or 0.0)
    if prefill_tps:
        seconds += load.mean_prompt_tokens / float(prefill_tps)
    seconds += load.mean_output_tokens * float(_field(sim, "tpot_s") or 0.0) * decode_factor
    if seconds <= 0:
        raise ValueError("the simulated workers take no time per request: set ttft_s, tpot_s or a prefill speed")
    return seconds


def worker_capacity_rps(sim: Mapping[str, Any], load: Workload) -> float:
    """Requests per second one simulated worker serves when always busy, with no cache hit.

    Raises ValueError, per request, without `max_num_seqs` (the simulator then runs every request
    at once: no capacity to speak of) or without a latency model.
    """
    if stepped(sim):
        return 1.0 / service_seconds(sim, load)
    slots = _field(sim, "max_num_seqs")
    if not slots:
        raise ValueError("utilisation needs max_num_seqs on the simulated workers (unlimited = no capacity)")
    return slots / service_seconds(sim, load)


def utilisation(sim: Mapping[str, Any], load: Workload, workers: int, speedup: float) -> float:
    """Offered load / capacity of the workers when the trace is replayed at `speedup` (0..; >1 = overload)."""
    return load.rate_1x * speedup / workers / worker_capacity_rps(sim, load)


def speedup_for_utilisation(target: float, sim: Mapping[str, Any], load: Workload, workers: int) -> float:
    """The speed-up at which `utilisation(...) == target` (> 0): utilisation is linear in it."""
    if target <= 0:
        raise ValueError("target utilisation must be positive")
    return target * workers * worker_capacity_rps(sim, load) / load.rate_1x


def prefill_for_utilisation(target: float, sim: Mapping[str, Any], load: Workload, workers: int,
                            speedup: float) -> float:
    """The prefill speed (`prefill_tokens_per_s`, tokens/s) at which the workers run at `target`
    utilisation at `speedup`. Solved by bisection on `utilisation` (it falls as the speed rises), so
    it follows whatever `service_seconds` models. Raises ValueError when even an instant prefill
    leaves the workers busier than `target` (decode or the fixed latency alone are too much).
    """
    if target <= 0:
        raise ValueError("target utilisation must be positive")

    def at(tps: float) -> float:
        return utilisation({**sim, "prefill_tokens_per_s": tps}, load, workers, speedup)

    lo, hi = 1e-3, 1e15
    if at(hi) > target:
        raise ValueError(f"decode, step overheads or the fixed latency alone exceed {target:.0%} utilisation; "
                         "lower --tpot, --ttft or --output-scale, or raise --max-num-seqs or --chunk-tokens")
    if at(lo) < target:
        return lo
    for _ in range(200):  # on a log scale: ~1e-15 relative width after 200 halvings of 60 decades
        mid = math.sqrt(lo * hi)
        if at(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return hi
