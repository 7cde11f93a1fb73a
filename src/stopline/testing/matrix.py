"""What the explorer found: one cell per (point x action), as data and as a table.

A cell is ``pass``, ``n/a`` (the action means nothing there, or this runtime
does not support it yet), ``recover`` (a crash left operations that only a
recovery pass can resolve, and this runtime has none), ``error`` (the cell
could not be run: the point was not reached, the workflow hung), or the
rules it broke with the run id to look up in the ledger.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence

from stopline.domain.vocab import Headline

__all__ = ["Cell", "CellStatus", "ExplorationFailed", "Matrix", "Violation", "cell_id"]


class CellStatus(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_APPLICABLE = "n/a"
    NEEDS_RECOVERY = "recover"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule in one cell, with what showed it."""

    rule: str  # "R1", "R2", "R3", "R4", "R7", "R8"
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


def cell_id(point: str, action: str, seed: int) -> str:
    """The id a cell is printed with and re-run by (``explore(..., only=...)``)."""
    return f"point={point} action={action} seed={seed}"


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    point: str
    action: str
    seed: int
    status: CellStatus
    run_id: str = ""
    violations: tuple[Violation, ...] = ()
    headline: Headline | None = None
    note: str = ""  # why n/a, what went wrong, what the workflow raised
    # the tools the run called that no ground truth tells: R3/R8 not checked against them
    unverified: tuple[str, ...] = ()
    # ``tool: why`` for each operation the run left to human review
    reviews: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return cell_id(self.point, self.action, self.seed)

    @property
    def rules_broken(self) -> tuple[str, ...]:
        return tuple(sorted({v.rule for v in self.violations}))

    @property
    def ok(self) -> bool:
        """Nothing broken: ``pass``, ``n/a`` or ``recover`` (not this runtime's to prove yet)."""
        return self.status in (
            CellStatus.PASS,
            CellStatus.NOT_APPLICABLE,
            CellStatus.NEEDS_RECOVERY,
        )

    def short(self) -> str:
        """The matrix entry."""
        if self.status is CellStatus.FAIL:
            return f"{','.join(self.rules_broken)} {self.run_id}"
        return self.status.value

    def text(self) -> str:
        """A readable account: the id to re-run, then each broken rule."""
        out = [f"{self.status.value.upper()} {self.id} run={self.run_id or '-'}"]
        if self.headline is not None:
            out[0] += f" headline={self.headline.value}"
        out.extend(f"    {v}" for v in self.violations)
        if self.note:
            out.append(f"    note: {self.note}")
        return "\n".join(out)


class ExplorationFailed(AssertionError):
    """Raised by ``Matrix.assert_ok``: some cell broke a rule or could not run."""

    def __init__(self, matrix: Matrix) -> None:
        self.matrix = matrix
        super().__init__(matrix.report())


@dataclasses.dataclass(frozen=True, slots=True)
class Matrix:
    """Every cell of one exploration, in (point, action) order."""

    points: tuple[str, ...]
    actions: tuple[str, ...]
    cells: tuple[Cell, ...]
    seed: int = 0
    baseline: Cell | None = None  # the discovery run: the workflow with no action

    def __iter__(self) -> Iterator[Cell]:
        return iter(self.cells)

    def __len__(self) -> int:
        return len(self.cells)

    def cell(self, point: str, action: str) -> Cell:
        for c in self.cells:
            if c.point == point and c.action == action:
                return c
        raise KeyError(cell_id(point, action, self.seed))

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[Cell, ...]:
        """Cells that broke a rule or could not run (the discovery run first)."""
        every = (self.baseline, *self.cells) if self.baseline is not None else self.cells
        return tuple(c for c in every if not c.ok)

    def broken(self, rule: str) -> tuple[Cell, ...]:
        """The cells that broke ``rule`` ("R1" ...)."""
        return tuple(c for c in self.cells if rule in c.rules_broken)

    @property
    def unverified(self) -> tuple[str, ...]:
        """Tools some cell called with no ground truth to check R3/R8 against: their
        effects were taken on the ledger's word (``explore(..., ground_truth=...)``)."""
        every = (self.baseline, *self.cells) if self.baseline is not None else self.cells
        return tuple(sorted({t for c in every for t in c.unverified}))

    @property
    def reviews(self) -> dict[str, int]:
        """``tool: why`` of every operation some cell left to human review, with how
        many cells did so: a read-back that raises or hangs sends its calls there and
        passes every cell, on a reviewer's back."""
        every = (self.baseline, *self.cells) if self.baseline is not None else self.cells
        counts: dict[str, int] = {}
        for c in every:
            for why in c.reviews:
                counts[why] = counts.get(why, 0) + 1
        return counts

    def unverified_note(self) -> str:
        """The report's line naming the tools R3/R8 took on the ledger's word ("" if none)."""
        if not self.unverified:
            return ""
        return (
            f"NO GROUND TRUTH for {', '.join(map(repr, self.unverified))}: R3 and R8 were "
            "not checked against their effects (give explore(..., ground_truth=...); "
            "require_ground_truth=True fails such cells)"
        )

    def with_status(self, status: CellStatus) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.status is status)

    def table(self) -> str:
        """Points down, actions across; each entry ``pass``, ``n/a`` or the broken rules."""
        return render_table(self.points, self.actions, self.cells)

    def report(self) -> str:
        """The table, then every cell that is not ok, each with the id to re-run it alone."""
        counts = {s: len(self.with_status(s)) for s in CellStatus}
        summary = ", ".join(f"{n} {s.value}" for s, n in counts.items() if n)
        out = [f"stopline explorer (seed={self.seed}): {len(self.cells)} cells: {summary}"]
        out.append(self.table())
        if self.unverified:
            out.append(self.unverified_note())
        for why, n in self.reviews.items():
            out.append(f"LEFT TO REVIEW in {n} cell(s): {why}")
        for c in self.failures:
            out.append(c.text())
            out.append(f'    re-run alone: explore(..., only="{c.id}")')
        return "\n".join(out)

    def assert_ok(self) -> None:
        if not self.ok:
            raise ExplorationFailed(self)


def render_table(points: Sequence[str], actions: Sequence[str], cells: Sequence[Cell]) -> str:
    entries = {(c.point, c.action): c.short() for c in cells}
    rows = [["point", *actions]]
    rows.extend([p, *(entries.get((p, a), "") for a in actions)] for p in points)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(text.ljust(w) for text, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
