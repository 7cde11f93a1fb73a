"""Cancel your own workflow at every point it passes, and check the contract each time.

    matrix = await explore(workflow, make_providers)
    matrix.assert_ok()

``workflow(run, providers)`` is an async function using stopline;
``make_providers()`` returns fresh providers for one run: a ``FakeProvider``,
or a mapping, sequence or object holding ``FakeProvider``s (and, if the
workflow has points of its own, ``Barriers``). The explorer runs the
workflow once to discover the barrier points it passes, in order: the
providers' (``received``, ``accepted``, ``committed``, ``responding``),
the runtime's (``before_dispatch``, ``after_gate``, ``response_delivered``)
and the workflow's own. Then it re-runs it once per (point x action), each
time on a fresh ledger file and fresh providers, holds it at the point, acts,
lets it go, waits for the run to settle and checks R1, R2, R3/R4, R7 and R8
(``stopline.testing.checks``). No sleeps: every wait is on a barrier or on a
ledger change; a cell that hangs fails on its timeout.

Each cell prints as ``point=accepted/upload action=cancel seed=0`` and runs
alone with ``explore(..., only="point=accepted/upload action=cancel seed=0")``:
its run id (``x0-007``) is the same either way.
"""

from __future__ import annotations

import random
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stopline.domain.limits import check_wait
from stopline.errors import StoplineError
from stopline.runtime.ledger import Ledger, VerifyBudget
from stopline.runtime.run import Run
from stopline.testing._cell import CellRunner
from stopline.testing._sources import Sources, find_barriers, find_providers
from stopline.testing.actions import CORE_ACTIONS, DEFAULT_ACTIONS, Action, Point
from stopline.testing.matrix import (
    Cell,
    CellStatus,
    ExplorationFailed,
    Matrix,
    Violation,
    cell_id,
)

__all__ = [
    "CORE_ACTIONS",
    "DEFAULT_ACTIONS",
    "Action",
    "Cell",
    "CellStatus",
    "ExplorationFailed",
    "ExplorerError",
    "Matrix",
    "Violation",
    "explore",
    "find_barriers",
    "find_providers",
]

P = TypeVar("P")
Workflow = Callable[[Run, P], Awaitable[None]]

FAST_VERIFY = VerifyBudget(attempts=4, first_delay=0.01, factor=2.0, max_delay=0.05)
_CELL_ID = re.compile(r"^point=(?P<point>\S+) action=(?P<action>\S+) seed=(?P<seed>-?\d+)$")


class ExplorerError(StoplineError):
    """The exploration could not start: the workflow fails on its own, a bad ``only``."""


def _stdout(text: str) -> None:
    sys.stdout.write(text + "\n")


async def explore(
    workflow: Workflow[P],
    providers: Callable[[], P],
    *,
    actions: Sequence[Action] = DEFAULT_ACTIONS,
    seed: int = 0,
    ledger_url: str | None = None,
    only: str | Collection[str] | None = None,
    out: Callable[[str], None] | None = _stdout,
    cell_timeout: float = 20.0,
    verify: VerifyBudget = FAST_VERIFY,
) -> Matrix:
    """Run ``workflow`` once per (point x action) and return (and print) the matrix.

    ``ledger_url`` (``sqlite:///DIR/NAME.db``) keeps each cell's ledger as
    ``DIR/NAME-<run id>.db`` for inspection; by default they live in a
    temporary directory. ``out`` receives the report (``None``: silent).
    """
    check_wait("cell_timeout", cell_timeout)  # a NaN was anyio's bare ValueError, mid-matrix
    wanted = _parse_only(only)
    if wanted:
        seeds = {s for _, _, s in wanted}
        if len(seeds) > 1:
            raise ExplorerError(f"cells of different seeds in one run: {sorted(seeds)}")
        seed = seeds.pop()
    with tempfile.TemporaryDirectory(prefix="stopline-explore-") as tmp:
        files = _Files(ledger_url, Path(tmp))
        runner = CellRunner(workflow, providers, verify=verify, cell_timeout=cell_timeout)
        points, unsupported, baseline = await _discover(
            runner, files.url(f"x{seed}-discover"), actions
        )
        names = [a.name for a in actions]
        if len(set(names)) != len(names):
            raise ExplorerError(f"two actions share a name: {names}")
        grid = [(p, a) for p in points for a in actions]
        if wanted:
            known = {(p.id, a.name) for p, a in grid}
            missing = [(p, a) for p, a, _ in wanted if (p, a) not in known]
            if missing:
                raise ExplorerError(
                    f"no such cell(s) {missing}; points: {[p.id for p in points]}, actions: {names}"
                )
        todo = [
            (n, p, a)
            for n, (p, a) in enumerate(grid)
            if not wanted or (p.id, a.name, seed) in wanted
        ]
        random.Random(seed).shuffle(todo)  # cells are independent; the order is reproducible
        cells: dict[int, Cell] = {}
        for n, point, action in todo:
            run_id = f"x{seed}-{n:03d}"
            reason = unsupported.get(action.name) or action.applies(point)
            if reason is not None:
                cells[n] = Cell(point.id, action.name, seed, CellStatus.NOT_APPLICABLE, note=reason)
                continue
            cells[n] = await runner.run_cell(point, action, seed, run_id, files.url(run_id))
    ordered = tuple(cells[n] for n in sorted(cells))
    matrix = Matrix(
        points=tuple(dict.fromkeys(c.point for c in ordered)),
        actions=tuple(dict.fromkeys(c.action for c in ordered)),
        cells=ordered,
        seed=seed,
        baseline=baseline,
    )
    if out is not None:
        out(matrix.report())
    return matrix


async def _discover(
    runner: CellRunner[Any], url: str, actions: Sequence[Action]
) -> tuple[list[Point], dict[str, str], Cell]:
    """Run once, unheld: the points passed in order, and the actions this runtime lacks."""
    passed: list[tuple[str, str, str]] = []  # (kind, source, barrier point)
    unsupported: dict[str, str] = {}

    def observe(sources: Sources) -> None:
        for kind, source, barriers in sources.all():

            def on_reach(point: str, key: str, kind: str = kind, source: str = source) -> None:
                passed.append((kind, source, point))

            barriers.on_reach = on_reach

    def probe(ledger: Ledger) -> None:
        for action in actions:
            reason = action.unsupported(ledger)
            if reason is not None:
                unsupported[action.name] = reason

    baseline = await runner.run_plain(url, observe, probe)
    if baseline.status is CellStatus.ERROR:
        raise ExplorerError("the workflow does not run on its own:\n" + baseline.text())
    return _points(passed, runner.last_sources), unsupported, baseline


def _points(passed: Iterable[tuple[str, str, str]], sources: Sources | None) -> list[Point]:
    seen: dict[tuple[str, str, str], int] = {}
    points = []
    for kind, source, name in passed:
        seen[(kind, source, name)] = n = seen.get((kind, source, name), 0) + 1
        if kind == "provider":
            base = f"{name}/{source}"
        elif kind == "runtime":
            base, (name, _, source) = name, name.partition("/")
        else:
            base = name
        provider = sources.providers.get(source) if sources is not None else None
        points.append(
            Point(
                id=base if n == 1 else f"{base}#{n}",
                name=name,
                source=source,
                occurrence=n,
                kind=kind,
                provider=provider,
            )
        )
    return points


def _parse_only(only: str | Collection[str] | None) -> set[tuple[str, str, int]]:
    if only is None:
        return set()
    ids = [only] if isinstance(only, str) else list(only)
    out = set()
    for text in ids:
        m = _CELL_ID.match(text.strip())
        if m is None:
            raise ExplorerError(
                f"not a cell id: {text!r} (expected {cell_id('POINT', 'ACTION', 0)!r})"
            )
        out.add((m["point"], m["action"], int(m["seed"])))
    return out


class _Files:
    """Where each cell's ledger lives."""

    def __init__(self, ledger_url: str | None, tmp: Path) -> None:
        if ledger_url is None:
            self.dir, self.stem = tmp, "ledger"
        elif ledger_url.startswith("sqlite:///"):
            path = Path(ledger_url.removeprefix("sqlite:///").partition("?")[0])
            self.dir, self.stem = path.parent, path.stem
        else:
            raise ExplorerError(f"the explorer needs a sqlite:/// ledger URL, not {ledger_url!r}")

    def url(self, name: str) -> str:
        path = self.dir / f"{self.stem}-{name}.db"
        for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            stale.unlink(missing_ok=True)  # a fresh ledger file per cell, re-runs included
        return f"sqlite:///{path}"
