"""One measured figure and the statistics behind it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["P99_MIN_SAMPLES", "Figure", "percentile", "quiet_heap"]


@contextlib.contextmanager
def quiet_heap() -> Iterator[None]:
    """Measure without the heap built before: collect it once, then freeze what
    survives, so a collection inside a window scans only what was made since (the
    window's own garbage is still collected, and charged to it). Without this a
    full collection of a benchmark's earlier heap (100-300 ms on a loaded 2-core
    machine) lands in a 100 ms window at random. For a figure and its baseline alike."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# below this many samples a p99 by nearest rank is their maximum: a p99 figure takes more
P99_MIN_SAMPLES = 100


def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by nearest rank."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[rank]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    name: str
    value: float
    unit: str
    baseline: float | None = None  # measured in the same run; None when there is none
    target: str = ""  # e.g. "ratio <= 2.0" or ">= 20000"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline

    def to_json(self) -> dict[str, Any]:
        return {
            "value": round(self.value, 3),
            "unit": self.unit,
            "baseline": None if self.baseline is None else round(self.baseline, 3),
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "target": self.target,
            "note": self.note,
        }

    def row(self, width: int) -> str:
        base = "-" if self.baseline is None else f"{self.baseline:,.1f}"
        ratio = "-" if self.ratio is None else f"{self.ratio:.2f}"
        return (
            f"{self.name:<{width}}  {self.value:>12,.1f} {self.unit:<6} {base:>12}  {ratio:>7}  "
            f"{self.target}".rstrip()
        )
