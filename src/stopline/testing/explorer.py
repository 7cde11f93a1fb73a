"""Cancel your own workflow at every point it passes, and check the contract each time.

    matrix = await explore(workflow, make_providers)
    matrix.assert_ok()

``workflow(run, providers)`` is an async function using stopline;
``make_providers()`` returns fresh providers for one run: a ``FakeProvider``,
or a mapping, sequence or object holding ``FakeProvider``s (and, if the
workflow has points of its own, ``Barriers``). The explorer runs the
workflow once to discover the barrier points it passes, in order: the
providers' (``received``, ``accepted``, ``committed``, ``responding``),
the runtime's (``before_dispatch``, ``after_gate``, ``returned`` for a tool of
your own, ``response_delivered``)
and the workflow's own. Then it re-runs it once per (point x action), each
time on a fresh ledger file and fresh providers, holds it at the point, acts,
lets it go, waits for the run to settle and checks R1, R2, R3/R4, R7 and R8
(``stopline.testing.checks``). No sleeps: every wait is on a barrier or on a
ledger change; a cell that hangs fails on its timeout.

Each cell prints as ``point=accepted/upload action=cancel seed=0`` and runs
alone with ``explore(..., only="point=accepted/upload action=cancel seed=0")``:
its run id (``x0-3f2a9c1e``) is the same either way. Run ids and the order
cells run in derive from the seed and the cell id only (never from the order
tasks happened to be scheduled in). Points are listed call by call, in the
order a call passes them; calls that ran at once, by tool name.

The checks know what a ``FakeProvider`` really did. A tool of your own has
no such ground truth unless ``ground_truth=`` tells it: the report names
every tool R3/R8 could not be checked against, and ``require_ground_truth=True``
fails the cells that called one.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stopline.domain.limits import check_wait
from stopline.errors import InvalidInput
from stopline.runtime.ledger import Ledger, VerifyBudget
from stopline.runtime.run import Run
from stopline.testing._cell import CellRunner, GroundTruth
from stopline.testing._errors import ExplorerError
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
    "GroundTruth",
    "Matrix",
    "Violation",
    "explore",
    "find_barriers",
    "find_providers",
]

P = TypeVar("P")
Workflow = Callable[[Run, P], Awaitable[None]]

# a read-back that hangs gives up after read_timeout, as in production (30 s there):
# the whole budget fits in the wait for the run to settle (``_settle_wait``)
FAST_VERIFY = VerifyBudget(
    attempts=4, first_delay=0.01, factor=2.0, max_delay=0.05, read_timeout=0.5
)
_CELL_ID = re.compile(r"^point=.+ action=.+ seed=(?P<seed>-?\d+)$")
BASELINE_POINT, BASELINE_ACTION = "(start)", "none"  # the discovery run's cell
# the order a call passes the points of its tool (a workflow's own points after)
_STAGES = (
    "before_dispatch",
    "after_gate",
    "received",
    "accepted",
    "committed",
    "responding",
    "returned",
    "response_delivered",
)


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
    ground_truth: GroundTruth[P] | None = None,
    require_ground_truth: bool = False,
) -> Matrix:
    """Run ``workflow`` once per (point x action) and return (and print) the matrix.

    ``ledger_url`` (``sqlite:///DIR/NAME.db``) keeps each cell's ledger as
    ``DIR/NAME-<run id>.db`` for inspection; by default they live in a
    temporary directory. ``out`` receives the report (``None``: silent).
    ``ground_truth(providers)`` returns, for each tool of your own, the keys
    (``ctx.key``) of every effect its destination holds; ``require_ground_truth``
    fails every cell that called an effectful tool with none.

    Raises ``InvalidInput`` for an argument it cannot use (a seed that is not an
    int, an empty ``actions``, an action class instead of an instance, ...), before
    any run; ``ExplorerError`` when the exploration cannot go on: the workflow or
    the providers factory fails on its own, two providers share a name, an
    action has no name, an ``only`` names no cell.
    """
    _check_inputs(workflow, providers, seed, cell_timeout, out, verify, ground_truth)
    if not isinstance(require_ground_truth, bool):  # "no" was true: every tool required
        raise InvalidInput("require_ground_truth", f"{require_ground_truth!r}: True or False")
    names = _check_actions(actions)
    wanted, seed = _parse_only(only, seed)
    with tempfile.TemporaryDirectory(prefix="stopline-explore-") as tmp:
        files = _Files(ledger_url, Path(tmp))
        runner = CellRunner(
            workflow,
            providers,
            verify=verify,
            cell_timeout=cell_timeout,
            ground_truth=ground_truth,
            require_ground_truth=require_ground_truth,
        )
        discovery = f"x{seed}-discover"
        points, unsupported, baseline = await _discover(
            runner, seed, discovery, files.url(discovery), actions
        )
        grid = {cell_id(p.id, a.name, seed): (p, a) for p in points for a in actions}
        selective = bool(wanted)
        wanted.discard(cell_id(BASELINE_POINT, BASELINE_ACTION, seed))  # it always runs
        missing = sorted(wanted - set(grid))
        if missing:
            raise ExplorerError(
                f"no such cell(s) {missing}; points: {[p.id for p in points]}, actions: {names}"
            )
        todo = [c for c in grid if not selective or c in wanted]
        run_ids = {c: _run_id(seed, c) for c in grid}
        if len(set(run_ids.values())) != len(run_ids):  # 32 bits: never seen, but say so
            raise ExplorerError("two cells drew the same run id: pick another seed")
        cells: dict[str, Cell] = {}
        # cells are independent; the order is the seed's, whichever cells are asked for
        for cid in sorted(todo, key=lambda c: _digest(f"order {seed} {c}")):
            point, action = grid[cid]
            reason = unsupported.get(action.name) or _why_not(action, "applies", point)
            if reason is not None:
                cells[cid] = Cell(
                    point.id, action.name, seed, CellStatus.NOT_APPLICABLE, note=reason
                )
                continue
            run_id = run_ids[cid]
            cells[cid] = await runner.run_cell(point, action, seed, run_id, files.url(run_id))
    ordered = tuple(cells[c] for c in grid if c in cells)
    if not selective and all(c.status is CellStatus.NOT_APPLICABLE for c in ordered):
        # as a workflow passing no point: the test would pass having explored nothing
        why = sorted({f"{c.action}: {c.note}" for c in ordered})
        raise ExplorerError(f"every cell is n/a: nothing was explored ({'; '.join(why)})")
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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _run_id(seed: int, cell: str) -> str:
    """A cell's run id: from the seed and the cell id only."""
    return f"x{seed}-{_digest(f'run {seed} {cell}')[:8]}"


def _check_inputs(
    workflow: object,
    providers: object,
    seed: object,
    cell_timeout: object,
    out: object,
    verify: object,
    ground_truth: object,
) -> None:
    """``InvalidInput`` naming the first argument ``explore`` cannot use, before any run
    (each was found mid-matrix, blamed on the workflow, or not at all)."""
    # a seed prints in every cell id and re-run line, which only an integer parses back
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidInput("seed", f"{seed!r}: must be an int (it is in every cell id)")
    if not check_wait("cell_timeout", cell_timeout) > 0:  # NaN was anyio's bare ValueError
        raise InvalidInput("cell_timeout", f"{cell_timeout}: must be more than 0 s")
    for what, fn, hint in (
        ("workflow", workflow, "async def workflow(run, providers)"),
        ("providers", providers, "a factory making fresh ones: lambda: FakeProvider(...)"),
    ):
        if not callable(fn):
            raise InvalidInput(what, f"{fn!r} is not callable: give {hint}")
    for what, fn in (("out", out), ("ground_truth", ground_truth)):
        if fn is not None and not callable(fn):
            raise InvalidInput(what, f"{fn!r} is not callable (or None)")
    if not isinstance(verify, VerifyBudget):
        raise InvalidInput("verify", f"{verify!r}: must be a VerifyBudget")


def _check_actions(actions: Sequence[Action]) -> list[str]:
    if isinstance(actions, str | bytes) or not isinstance(actions, Sequence):
        raise InvalidInput("actions", f"{actions!r}: must be a sequence of Action instances")
    if not actions:
        raise InvalidInput("actions", "empty: nothing would be explored")
    for action in actions:
        if isinstance(action, type):
            raise InvalidInput(
                "actions", f"{action.__name__} is a class: pass an instance ({action.__name__}())"
            )
        if not isinstance(action, Action):  # "cancel", as the table prints it, was "no name"
            raise InvalidInput(
                "actions",
                f"{action!r} is not an Action: pass instances of stopline.testing.actions "
                "(Cancel(), CrashWorker(), ...) or of a subclass of Action",
            )
    names = [getattr(a, "name", "") for a in actions]
    for action, name in zip(actions, names, strict=True):
        if not isinstance(name, str) or not name.strip():
            raise ExplorerError(
                f"the action {type(action).__name__} has no name: give its class a "
                "`name = ...` (each cell prints and re-runs by it)"
            )
    if len(set(names)) != len(names):
        raise ExplorerError(f"two actions share a name: {names}")
    return names


async def _discover(
    runner: CellRunner[Any], seed: int, run_id: str, url: str, actions: Sequence[Action]
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
            reason = _why_not(action, "unsupported", ledger)
            if reason is not None:
                unsupported[action.name] = reason

    baseline = await runner.run_plain(seed, run_id, url, observe, probe)
    if baseline.status is CellStatus.ERROR:
        raise ExplorerError(
            "the discovery run (the workflow on its own, no action) could not be played:\n"
            + baseline.text()
        )
    if not passed:  # a matrix of no cell is ok: the test would pass having explored nothing
        raise ExplorerError(
            "the discovery run passed no point: nothing to explore (does the workflow call "
            "its tools with run.call, and do its providers come from the factory?)"
        )
    return _ordered(_points(passed, runner.last_sources)), unsupported, baseline


def _why_not(action: Action, asked: str, of: object) -> str | None:
    """``action.applies(point)`` or ``action.unsupported(ledger)``: why the action means
    nothing there, or None. Anything else is refused (``ExplorerError``): ``True``
    ("it applies") made every cell n/a, and the exploration of nothing passed."""
    reason = getattr(action, asked)(of)
    if reason is None or (isinstance(reason, str) and reason):
        return reason
    raise ExplorerError(
        f"{type(action).__name__}.{asked}() returned {reason!r}: it returns why the "
        "action means nothing there (a non-empty str), or None where it does"
    )


def _ordered(points: list[Point]) -> list[Point]:
    """The points as listed, whatever order this run's scheduling passed them in.

    Each call (tool and occurrence; a workflow's own point by name) is a lane, its
    points in the order a call passes them. Lanes that overlapped in the discovery
    run ran at once, and the scheduler chose their order: they are listed by name.
    Lanes one after another keep the order the workflow ran them in."""
    span: dict[tuple[str, ...], list[int]] = {}
    for at, point in enumerate(points):
        span.setdefault(_lane(point), [at, at])[1] = at
    rank: dict[tuple[str, ...], tuple[int, tuple[str, ...]]] = {}
    start, end = -1, -1
    for lane, (first, last) in sorted(span.items(), key=lambda item: item[1][0]):
        if first > end:  # no overlap with the lanes before: a new group
            start = first
        end = max(end, last)
        rank[lane] = (start, lane)
    return sorted(points, key=lambda p: (rank[_lane(p)], _stage(p), p.occurrence))


def _lane(point: Point) -> tuple[str, ...]:
    if point.kind == "workflow":
        return ("workflow", point.source, point.name)
    return ("call", point.source, f"{point.occurrence:09d}")


def _stage(point: Point) -> int:
    return _STAGES.index(point.name) if point.kind != "workflow" else 0


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


def _parse_only(only: str | Collection[str] | None, seed: int) -> tuple[set[str], int]:
    """The cell ids asked for, exactly as printed, and the seed they name."""
    if only is None:
        return set(), seed
    if isinstance(only, bytes) or not isinstance(only, str | Collection):
        raise InvalidInput("only", f"{only!r}: a cell id as printed, or a collection of them")
    ids = [only] if isinstance(only, str) else list(only)
    if not ids:
        raise InvalidInput("only", "empty: name at least one cell (None runs them all)")
    wanted: set[str] = set()
    seeds: set[int] = set()
    for text in ids:
        m = _CELL_ID.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ExplorerError(
                f"not a cell id: {text!r} (expected {cell_id('POINT', 'ACTION', 0)!r})"
            )
        wanted.add(text.strip())
        seeds.add(int(m["seed"]))
    if len(seeds) > 1:
        raise ExplorerError(f"cells of different seeds in one run: {sorted(seeds)}")
    return wanted, seeds.pop() if seeds else seed


class _Files:
    """Where each cell's ledger lives."""

    def __init__(self, ledger_url: str | None, tmp: Path) -> None:
        self.query = ""
        if ledger_url is None:
            self.dir, self.stem = tmp, "ledger"
        elif isinstance(ledger_url, str) and ledger_url.startswith("sqlite:///"):
            name, mark, query = ledger_url.removeprefix("sqlite:///").partition("?")
            self.query = mark + query  # each cell's ledger is opened with its options
            if name in ("", ":memory:"):  # was a file named ":memory:-<run id>.db" here
                raise ExplorerError(
                    f"the explorer keeps a ledger file per cell: {ledger_url!r} names no "
                    "file (sqlite:///DIR/NAME.db; None: a temporary directory)"
                )
            path = Path(name)
            self.dir, self.stem = path.parent, path.stem
        else:
            raise ExplorerError(f"the explorer needs a sqlite:/// ledger URL, not {ledger_url!r}")

    def url(self, name: str) -> str:
        path = self.dir / f"{self.stem}-{name}.db"
        for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            stale.unlink(missing_ok=True)  # a fresh ledger file per cell, re-runs included
        return f"sqlite:///{path}{self.query}"
