"""Medians and spread of the replay's figures over repeated runs of one layout at one load level.

`spread` reduces one figure's values (None = not measured, left out) to median, min and max;
`aggregate` groups runs by (load level, layout) and does that for every figure in `FIGURES`.
Min-max is the spread reported: with the 3-5 repetitions a replay affords, quartiles would be
the extreme values or interpolations between them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class Measured(Protocol):
    """What `aggregate` reads of a run (loadtest.report.RunResult has it)."""

    name: str
    kind: str
    status: str
    level: str


FIGURES: tuple[str, ...] = ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                            "prefill_max_over_mean", "req_per_s", "errors", "send_lag_p99_s")
"""RunResult attributes summarised per (level, layout)."""


@dataclass(frozen=True)
class Spread:
    """Median, min and max of `n` values, and the values in run order."""

    median: float
    low: float
    high: float
    n: int
    values: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: Iterable[float | None]) -> Spread | None:
    """Median / min / max of the values that are not None; None when there are none."""
    kept = tuple(float(v) for v in values if v is not None)
    if not kept:
        return None
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept), kept)


@dataclass
class Aggregate:
    """One (level, layout) cell: its runs (ok or not) and the spread of each figure over the ok ones."""

    level: str
    name: str
    kind: str
    runs: int = 0
    ok_runs: int = 0
    statuses: list[str] = field(default_factory=list)
    figures: dict[str, Spread | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "name": self.name, "kind": self.kind, "runs": self.runs,
                "ok_runs": self.ok_runs, "statuses": self.statuses,
                "figures": {k: (v.to_json() if v is not None else None) for k, v in self.figures.items()}}


def aggregate(runs: Sequence[Measured], figures: Sequence[str] = FIGURES) -> list[Aggregate]:
    """Group `runs` by (level, name) in order of first appearance; spread of each figure over the
    runs whose status is "ok". A cell whose runs all failed or were skipped has figures of None."""
    cells: dict[tuple[str, str], Aggregate] = {}
    members: dict[tuple[str, str], list[Measured]] = {}
    for run in runs:
        key = (run.level, run.name)
        cell = cells.setdefault(key, Aggregate(run.level, run.name, run.kind))
        cell.runs += 1
        cell.statuses.append(run.status)
        if run.status == "ok":
            cell.ok_runs += 1
            members.setdefault(key, []).append(run)
    for key, cell in cells.items():
        ok = members.get(key, [])
        cell.figures = {name: spread(getattr(r, name) for r in ok) for name in figures}
    return list(cells.values())


def fmt_spread(value: Spread | None, pattern: str) -> str:
    """"median (min-max)" with `pattern` (e.g. ".3f"); the value alone for one run; "-" for none."""
    if value is None:
        return "-"
    if value.n == 1 or value.low == value.high:
        return format(value.median, pattern)
    return f"{format(value.median, pattern)} ({format(value.low, pattern)}-{format(value.high, pattern)})"
