"""The order of the replay's runs: load levels x repetitions x layouts, rotated for fairness.

Every layout (a gateway policy, a peer router, ...) of one load level runs once per repetition.
Repetition i starts with layout i mod n and keeps the list's cyclic order from there, so across n
repetitions every layout is first (on a fresh machine, and before any drift) exactly once. Levels
run inside each repetition, so the repetitions of one figure are spread over the whole session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Level:
    """One load level: the target `utilisation` (None when the speed-up was given directly), the
    `speedup` that reaches it, and the workers' `prefill_tps` (tokens/s; None = no prefill model)."""

    utilisation: float | None
    speedup: float
    prefill_tps: float | None

    @property
    def label(self) -> str:
        """"80%" for a utilisation target, else "20x"."""
        return f"{self.utilisation:.0%}" if self.utilisation is not None else f"{self.speedup:g}x"


@dataclass(frozen=True)
class Slot:
    """One run: repetition (0-based), index of its level, index of its layout in the layout list."""

    repeat: int
    level: int
    layout: int


def rotated(items: Sequence[T], start: int) -> list[T]:
    """`items` in cyclic order beginning at index `start mod len(items)`."""
    if not items:
        return []
    k = start % len(items)
    return [*items[k:], *items[:k]]


def run_order(layouts: int, levels: int, repeats: int) -> list[Slot]:
    """Every (repetition, level, layout) once: repetitions outermost, then levels, then the layouts
    rotated by the repetition's index. Raises ValueError for a negative count."""
    if min(layouts, levels, repeats) < 0:
        raise ValueError("counts must not be negative")
    order = list(range(layouts))
    return [Slot(rep, level, layout) for rep in range(repeats) for level in range(levels)
            for layout in rotated(order, rep)]
