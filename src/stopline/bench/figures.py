"""One measured figure and the statistics behind it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["P99_MIN_SAMPLES", "Figure", "Heap", "percentile", "quiet_heap"]


class Heap:
    """When the collector ran inside a ``quiet_heap`` window (``perf_counter`` spans)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._started = 0.0

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        del info
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.spans.append((self._started, time.perf_counter()))

    def collector_s(self, start: float, end: float) -> float:
        """Seconds the collector ran between ``start`` and ``end`` (``perf_counter``)."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.spans)


@contextlib.contextmanager
def quiet_heap() -> Iterator[Heap]:
    """Measure without the heap built before: collect it once, then freeze what
    survives, so a collection inside a window scans only what was made since (the
    window's own garbage is still collected, and charged to it). Without this a
    full collection of a benchmark's earlier heap (100-300 ms on a loaded 2-core
    machine) lands in a 100 ms window at random. For a figure and its baseline alike.
    Yields the window's ``Heap``: how long the collector ran inside it."""
    gc.collect()
    gc.freeze()
    heap = Heap()
    gc.callbacks.append(heap._observe)
    try:
        yield heap
    finally:
        gc.callbacks.remove(heap._observe)
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
