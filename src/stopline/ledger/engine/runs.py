"""Runs and notes: create (a child of a fenced parent is born fenced), transitions, phases."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stopline.domain.model import CancelState, OperationRecord, RunRecord
from stopline.domain.transitions import RUN_TABLE, apply
from stopline.domain.vocab import Grant, LogKind, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import IllegalTransition, UnknownOperation, UnknownRun
from stopline.ledger import rows
from stopline.ledger.backend import Note, RunSpec
from stopline.ledger.engine.db import Db, Params
from stopline.ledger.engine.guards import run_moves
from stopline.ledger.engine.reads import (
    EVENT_SQL,
    attempt,
    chunks,
    found_op,
    found_run,
    load_ops,
    load_run,
    load_runs,
    op_query,
    run_query,
)

if TYPE_CHECKING:
    from stopline.ledger.engine.dialect import Dialect

__all__ = [
    "create_run",
    "move_query",
    "note",
    "note_many",
    "run_event",
    "run_event_batch",
    "run_events",
    "set_phase",
]


# A child of a run that may no longer initiate is born fenced: cancelling, without the
# grant to initiate (a cancel of its parent fenced the parent before the child existed).
# Written once, in SQL over the parent's row (``parent``), for every engine's insert.
_PARENT_FENCED = f"(parent.grants & {int(Grant.INITIATE)}) = 0"
_BORN_STATE = (
    f"CASE WHEN {_PARENT_FENCED} THEN '{RunState.CANCELLING.value}'"
    f" ELSE '{RunState.RUNNING.value}' END"
)
_BORN_GRANTS = (
    f"CASE WHEN {_PARENT_FENCED} THEN :grants & {int(Grant.all() & ~Grant.INITIATE)}"
    " ELSE :grants END"
)


def new_run_select(dialect: Dialect, *, child: bool) -> str:
    """The ``SELECT`` of a new run's row (``rows.RUN_COLUMNS``, ``:name`` parameters): a
    child's from its parent's row, locked (``FOR SHARE``: a cancel of the parent either
    fenced it already, and the child is born fenced, or waits for the child), and
    none if the parent is not there."""
    if not child:
        return (
            "SELECT :id, :name, :owner, :tenant, NULL, :state, 0, :grants, NULL, :policy,"
            " :now, :now, NULL, NULL, NULL"
        )
    return (
        f"SELECT :id, :name, :owner, :tenant, parent.id, {_BORN_STATE}, 0, {_BORN_GRANTS},"
        " NULL, :policy, :now, :now, NULL, NULL, NULL FROM (SELECT id, grants FROM runs"
        f" WHERE id = :parent{dialect.for_share}) parent"
    )


async def create_run(db: Db, spec: RunSpec) -> RunRecord:
    """The run, its ownership link (a child's) and its ``run_created`` event, written and
    read back with the commit: one statement where the engine has it (PostgreSQL), else
    one transaction. ``UnknownRun`` for a parent that is not there."""
    child = spec.parent_id is not None
    data = {"owner": spec.owner, "tenant": spec.tenant, "parent": spec.parent_id}
    params = {
        "id": spec.id, "name": spec.name, "owner": spec.owner, "tenant": spec.tenant,
        "state": RunState.RUNNING.value, "grants": int(spec.grants),
        "policy": spec.policy.value, "now": time.time(), "kind": LogKind.RUN_CREATED.value,
        "data": rows.dump_data(data),
    }  # fmt: skip
    if child:
        params.update(parent=spec.parent_id, exclusive=int(not spec.shared))
    insert = f"INSERT INTO runs ({rows.RUN_COLUMNS}) {new_run_select(db.dialect, child=child)}"
    then = [_LINK, _CREATED] if child else [_CREATED]  # each from the new run's row
    fused = db.dialect.create_sql(insert, then)
    if fused is not None:
        row = await db.commit_one(fused, params)
        found = [] if row is None else [row]
    else:
        writes = [(insert, params), *((f"{w} FROM runs WHERE id = :id", params) for w in then)]
        async with db.transaction():
            found = (await db.batch([*writes, run_query(spec.id)], commit=True))[-1]
    if not found and spec.parent_id is not None:
        raise UnknownRun(spec.parent_id)  # no parent row: nothing was written
    return found_run(found, spec.id)


# what follows a new run's row, each taking it from a source the engine names
_LINK = (
    "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
    " SELECT id, parent_id, :exclusive, :now"
)
_CREATED = f"{rows.EVENT_INTO} SELECT :now, id, NULL, :kind, NULL, state, :data"


Statements = list[tuple[str, Params]]


def run_event_batch(
    dialect: Dialect, run_id: str, kind: RunEvent, by: str, reason: str
) -> tuple[Statements, Callable[[Sequence[Sequence[Any]]], tuple[RunRecord, bool]]] | None:
    """``run_event`` as one batch: its statements (the last of their transaction: its
    ``COMMIT`` goes with them) and what makes its result of their rows, which raises
    ``UnknownRun`` or ``IllegalTransition``. None when no state moves by ``kind``. A
    backend may send them with other statements in one transaction (PostgreSQL's group
    commit, after the outcomes the run's calls deferred)."""
    moves = run_moves(dialect.unindexed("state"), kind)
    if moves is None:
        return None
    now = time.time()
    data = rows.dump_data({"by": by, "reason": reason})
    fused = dialect.move_sql(kind)  # one statement where the engine can (PostgreSQL)
    statements: Statements
    if fused is not None:
        statements = [(fused, {"run": run_id, "now": now, "kind": kind.value, "data": data})]
    else:
        target_of, movable = moves
        text = dialect.text
        statements = [
            run_query(run_id, dialect.for_update),
            (  # the event first: it reads the state the move leaves
                f"{rows.EVENT_INTO} SELECT ?, id, NULL, {text('?')}, state,"
                f" {target_of}, {text('?')} FROM runs WHERE id = ? AND {movable}",
                (now, kind.value, data, run_id),
            ),
            (
                f"UPDATE runs SET state = {target_of}, updated_at = ? WHERE id = ? AND {movable}",
                (now, run_id),
            ),
        ]

    def moved(found: Sequence[Sequence[Any]]) -> tuple[RunRecord, bool]:
        run = found_run(found[0], run_id)
        target = apply(RUN_TABLE, run.state, kind)  # illegal: the statements matched nothing
        return dataclasses.replace(run, state=target, updated_at=now), True

    return statements, moved


async def run_event(
    db: Db, run_id: str, kind: RunEvent, by: str, reason: str
) -> tuple[RunRecord, bool]:
    """A run transition other than cancel (which is the subtree fence, in ``fence``): the
    run locked and read, its event and its move sent with them and the commit, one
    statement on PostgreSQL. The event and the move match only a state the run table
    moves by ``kind`` (``guards.run_moves``: the table itself, in SQL), so an illegal
    move writes nothing and is raised from the state read; the run returned is the one
    read with what the move wrote (its state and instant)."""
    prepared = run_event_batch(db.dialect, run_id, kind, by, reason)
    if prepared is None:  # no state takes it: nothing to write, only the error to say
        run = await load_run(db, run_id)
        apply(RUN_TABLE, run.state, kind)  # raises IllegalTransition
        raise AssertionError(f"{kind.value}: the run table has no move for it")
    statements, moved = prepared
    if len(statements) == 1:  # one statement (PostgreSQL's): it commits by itself
        row = await db.commit_one(*statements[0])
        return moved([[] if row is None else [row]])
    async with db.transaction():
        found = await db.batch(statements, commit=True)
    return moved(found)


async def run_events(
    db: Db, items: Sequence[tuple[str, RunEvent]], by: str
) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
    """``run_event`` for many runs in one transaction, at one instant (a cancelled tree's
    runs settling together); an illegal move or an unknown run is returned in its
    place, writes nothing for that run, and the others are written.

    Set-based: the runs are read (and locked, in id order) in one statement, each
    move checked against the table as ``run_event`` checks it, and the runs making
    the same move are updated and logged together; each run returned is the one read
    with what the update wrote (its state and instant), not read again. A run named
    twice is moved in a later stretch, as one after the other."""
    now = time.time()
    data = rows.dump_data({"by": by, "reason": ""})
    out: dict[int, tuple[RunRecord, bool] | IllegalTransition | UnknownRun] = {}
    async with db.transaction():
        for stretch in _stretches([run_id for run_id, _ in items]):
            runs = await load_runs(db, [items[i][0] for i in stretch], lock=True)
            moves: dict[tuple[RunState, RunState, RunEvent], list[str]] = {}
            for i in stretch:
                run_id, kind = items[i]
                run = runs.get(run_id)
                if run is None:
                    out[i] = UnknownRun(run_id)
                    continue
                try:
                    target = apply(RUN_TABLE, run.state, kind)
                except IllegalTransition as exc:
                    out[i] = exc
                    continue
                moves.setdefault((run.state, target, kind), []).append(run_id)
                # what the update below writes of the run it read and holds (locked)
                out[i] = (dataclasses.replace(run, state=target, updated_at=now), True)
            for (source, target, kind), ids in moves.items():
                for chunk in chunks(ids):
                    await db.run(*move_query(db.dialect, chunk, source, target, now))
                logged = [(now, r, None, kind.value, source.value, target.value, data) for r in ids]
                await db.many(EVENT_SQL, logged)
    return [out[i] for i in range(len(items))]


def _stretches(ids: Sequence[str]) -> list[list[int]]:
    """The items' indexes, in order, cut where an id repeats."""
    stretches: list[list[int]] = [[]]
    seen: set[str] = set()
    for i, run_id in enumerate(ids):
        if run_id in seen:
            stretches.append([])
            seen = set()
        stretches[-1].append(i)
        seen.add(run_id)
    return stretches


def move_query(
    dialect: Dialect, run_ids: Sequence[str], source: RunState, target: RunState, now: float
) -> tuple[str, list[Any]]:
    """The statement moving the runs of ``run_ids`` (one chunk) from ``source``."""
    which, params = dialect.in_list("id", run_ids)
    state = dialect.unindexed("state")  # the ids' own index, not the state's
    sql = f"UPDATE runs SET state = ?, updated_at = ? WHERE {which} AND {state} = ?"
    return sql, [target.value, now, *params, source.value]


async def set_phase(
    db: Db, run_id: str, kind: PhaseKind, policy: Policy, token: str | None = None
) -> RunRecord:
    """The run's phase: the run locked and read, the change and its event (both only
    for a run that is there) sent with them and the commit, one round trip on
    PostgreSQL; the run returned as read with what the change wrote. ``token`` marks
    the attempt in the event (read back after a lost reply: ``attempt_logged``)."""
    text = db.dialect.text
    now = time.time()
    data = rows.dump_data(attempt({"phase": kind.value, "policy": policy.value}, token))
    async with db.transaction():
        found, _, _ = await db.batch(
            [
                run_query(run_id, db.dialect.for_update),
                (
                    "UPDATE runs SET phase = ?, policy = ?, updated_at = ? WHERE id = ?",
                    (kind.value, policy.value, now, run_id),
                ),
                (
                    f"{rows.EVENT_INTO} SELECT ?, id, NULL, {text('?')}, NULL, NULL, {text('?')}"
                    " FROM runs WHERE id = ?",
                    (now, LogKind.PHASE.value, data, run_id),
                ),
            ],
            commit=True,
        )
    run = found_run(found, run_id)
    return dataclasses.replace(run, phase=kind, policy=policy, updated_at=now)


async def note(
    db: Db, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None
) -> OperationRecord:
    """An event that changes no status (progress, cancel asked, a late copy): the
    operation locked and read, its cancel state set and the event logged (both only
    for an operation that is there) sent with them and the commit, one round trip on
    PostgreSQL; the operation returned as read with what the change wrote."""
    text = db.dialect.text
    now = time.time()
    statements: list[tuple[str, Params]] = [op_query(op_id, db.dialect.for_update)]
    if cancel_state is not None:
        statements.append(
            (
                "UPDATE operations SET cancel_state = ?, updated_at = ? WHERE id = ?",
                (cancel_state, now, op_id),
            )
        )
    statements.append(
        (
            f"{rows.EVENT_INTO} SELECT ?, run_id, id, {text('?')}, status, status, {text('?')}"
            " FROM operations WHERE id = ?",
            (now, kind, rows.dump_data(data), op_id),
        )
    )
    async with db.transaction():
        found, *_ = await db.batch(statements, commit=True)
    op = found_op(found, op_id)
    if cancel_state is None:
        return op
    return dataclasses.replace(op, cancel_state=CancelState.parse(cancel_state), updated_at=now)


async def note_many(db: Db, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
    """``note`` for many operations in one transaction, at one instant (a cancelled tree's
    provider answers); an unknown one is returned in its place and the others are
    written. Set-based: the operations read (and locked, in id order) together, the
    cancel states set together, the events logged together; an operation noted twice
    is noted in a later stretch, as one after the other."""
    now = time.time()
    out: dict[int, OperationRecord | UnknownOperation] = {}
    async with db.transaction():
        for stretch in _stretches([n.op_id for n in notes]):
            found = await load_ops(db, [notes[i].op_id for i in stretch], lock=True)
            states: dict[str, list[str]] = {}
            logged = []
            for i, op in zip(stretch, found, strict=True):
                if isinstance(op, UnknownOperation):
                    out[i] = op
                    continue
                n = notes[i]
                if n.cancel_state is not None:
                    states.setdefault(n.cancel_state, []).append(op.id)
                status = op.status.value
                logged.append(
                    (now, op.run_id, op.id, n.kind, status, status, rows.dump_data(n.data))
                )
            for state, ids in states.items():
                for chunk in chunks(ids):
                    which, params = db.dialect.in_list("id", chunk)
                    sql = f"UPDATE operations SET cancel_state = ?, updated_at = ? WHERE {which}"
                    await db.run(sql, (state, now, *params))
            await db.many(EVENT_SQL, logged)
            known = [i for i in stretch if i not in out]
            after = await load_ops(db, [notes[i].op_id for i in known])
            out.update(zip(known, after, strict=True))
    return [out[i] for i in range(len(notes))]
