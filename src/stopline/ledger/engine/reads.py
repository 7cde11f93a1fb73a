"""Loads and reads, and the one way an event is appended to the log.

Orderings are the same on both engines: operations and approvals by
``created_at, id``, events by ``seq``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from stopline.domain.lifecycle import ApprovalRecord, Checkpoint
from stopline.domain.model import EventRecord, OperationRecord, RunRecord
from stopline.domain.vocab import LogKind, OpEvent, OpStatus, RunState
from stopline.errors import NotFound, UnknownOperation, UnknownRun
from stopline.ledger import rows
from stopline.ledger.engine.db import Db, Params
from stopline.ledger.engine.guards import (
    DEFAULT_UNRESOLVED,
    FENCED,
    IN_FLIGHT,
    OPEN,
    OPEN_SQL,
    SETTLED,
    SETTLING_SQL,
    sql_values,
)
from stopline.ledger.leases import WorkerLease

if TYPE_CHECKING:
    from stopline.ledger.engine.dialect import Dialect

__all__ = [
    "EVENT_SQL",
    "approvals",
    "attempt",
    "attempt_event",
    "attempt_logged",
    "change_mark",
    "chunks",
    "compensations",
    "event_statement",
    "events",
    "fenced_among",
    "first_unsettled",
    "found_op",
    "found_run",
    "in_flight_where",
    "in_flight_workers",
    "last_checkpoint",
    "list_runs",
    "list_trees",
    "load_approval",
    "load_op",
    "load_ops",
    "load_run",
    "load_runs",
    "op_query",
    "operations",
    "operations_query",
    "ops_query",
    "run_query",
    "runs_and_operations",
    "runs_query",
    "trees_and_operations",
    "unresolved",
    "wanted_open",
]

# ids per statement in a read of many: a bounded result each (the ids themselves go as
# one array, whatever their number: ``Dialect.in_list``, ADR 0044)
_IDS_PER_STATEMENT = 4_096


def chunks(ids: Sequence[str]) -> list[list[str]]:
    """``ids`` without repeats, cut into lists of a bounded read each."""
    distinct = list(dict.fromkeys(ids))
    return [
        distinct[at : at + _IDS_PER_STATEMENT] for at in range(0, len(distinct), _IDS_PER_STATEMENT)
    ]


EVENT_SQL = f"{rows.EVENT_INTO} VALUES (?, ?, ?, ?, ?, ?, ?)"


def in_flight_where(column: str = "status") -> str:
    """The open index's own condition, verbatim (so it is used), then the in-flight statuses."""
    return f"{column} IN ({OPEN_SQL}) AND {column} IN ({sql_values(IN_FLIGHT)})"


def run_query(run_id: str, lock: str = "") -> tuple[str, tuple[str]]:
    """The statement ``load_run`` runs (for a ``Db.batch``); ``found_run`` reads its rows."""
    return f"SELECT {rows.RUN_COLUMNS} FROM runs WHERE id = ?{lock}", (run_id,)


def found_run(found: Sequence[Any], run_id: str) -> RunRecord:
    """The run in the rows of ``run_query``; ``UnknownRun`` if there is none."""
    if not found:
        raise UnknownRun(run_id)
    return rows.run_from_row(found[0])


async def load_run(db: Db, run_id: str, *, lock: str = "") -> RunRecord:
    return found_run(await db.all(*run_query(run_id, lock)), run_id)


async def change_mark(db: Db) -> str:
    """``Backend.change_mark``: the dialect's mark, as text."""
    return str((await db.one(db.dialect.change_mark))[0])


def op_query(op_id: str, lock: str = "") -> tuple[str, tuple[str]]:
    """The statement ``load_op`` runs (for a ``Db.batch``); ``found_op`` reads its rows."""
    return f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = ?{lock}", (op_id,)


def found_op(found: Sequence[Any], op_id: str) -> OperationRecord:
    """The operation in the rows of ``op_query``; ``UnknownOperation`` if there is none."""
    if not found:
        raise UnknownOperation(op_id)
    return rows.op_from_row(found[0])


async def load_op(db: Db, op_id: str, *, lock: str = "") -> OperationRecord:
    return found_op(await db.all(*op_query(op_id, lock)), op_id)


def runs_query(
    dialect: Dialect, run_ids: Sequence[str], *, lock: bool = False
) -> tuple[str, list[Any]]:
    """The statement reading the runs of ``run_ids`` (one chunk); with ``lock``, locked
    in id order (two writers locking the same runs never wait on each other in turn)."""
    which, params = dialect.in_list("id", run_ids)
    locked = f" ORDER BY id{dialect.for_update}" if lock and dialect.for_update else ""
    return f"SELECT {rows.RUN_COLUMNS} FROM runs WHERE {which}{locked}", params


def ops_query(
    dialect: Dialect,
    column: str,
    ids: Sequence[str],
    *,
    lock: bool = False,
    only: str | None = None,
) -> tuple[str, list[Any]]:
    """The statement reading the operations whose ``column`` (``id`` or ``run_id``) is
    one of ``ids`` (one chunk), in the operations' order; with ``lock``, locked in id
    order instead; with ``only``, those that condition also picks."""
    which, params = dialect.in_list(column, ids)
    if only is not None:
        which = f"{which} AND {only}"
    order = "created_at, id"
    if lock and dialect.for_update:
        order = f"id{dialect.for_update}"
    return f"SELECT {rows.OP_COLUMNS} FROM operations WHERE {which} ORDER BY {order}", params


async def load_runs(db: Db, run_ids: Sequence[str], *, lock: bool = False) -> dict[str, RunRecord]:
    """The runs of ``run_ids`` that exist, by id (with ``lock``, locked in id order)."""
    found: dict[str, RunRecord] = {}
    for chunk in chunks(sorted(run_ids)):
        runs = map(rows.run_from_row, await db.all(*runs_query(db.dialect, chunk, lock=lock)))
        found.update((run.id, run) for run in runs)
    return found


async def load_ops(
    db: Db, op_ids: Sequence[str], *, lock: bool = False
) -> list[OperationRecord | UnknownOperation]:
    """``load_op`` of many operations, a fixed number of statements per 4,096 ids; an
    unknown one is returned in its place. With ``lock``, locked in id order."""
    found: dict[str, OperationRecord] = {}
    async with db.transaction(snapshot=not lock):
        for chunk in chunks(sorted(op_ids) if lock else op_ids):
            for row in await db.all(*ops_query(db.dialect, "id", chunk, lock=lock)):
                op = rows.op_from_row(row)
                found[op.id] = op
    return [found[o] if o in found else UnknownOperation(o) for o in op_ids]


async def load_approval(db: Db, approval_id: str, *, lock: str = "") -> ApprovalRecord:
    sql = f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE id = ?{lock}"
    row = await db.one(sql, (approval_id,))
    if row is None:
        raise NotFound(f"unknown approval id {approval_id!r}")
    return rows.approval_from_row(row)


def event_statement(
    at: float,
    run_id: str,
    op_id: str | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    data: dict[str, Any],
) -> tuple[str, Params]:
    """The statement logging one event (for a ``Db.batch``)."""
    return EVENT_SQL, (at, run_id, op_id, kind, from_state, to_state, rows.dump_data(data))


def attempt(data: dict[str, Any], token: str | None) -> dict[str, Any]:
    """An event's data marked with the write attempt ``token`` (none: unmarked), so that
    after a lost reply ``attempt_logged`` can tell whether that very attempt landed."""
    return data if token is None else {**data, "attempt": token}


async def attempt_event(db: Db, where: str, params: Params, token: str) -> dict[str, Any] | None:
    """The data of the event ``where`` picks that the write attempt ``token`` logged (none:
    that attempt did not land)."""
    for (data,) in await db.all(f"SELECT data FROM events WHERE {where}", params):
        recorded = rows.load_data(data)
        if recorded.get("attempt") == token:
            return recorded
    return None


async def attempt_logged(db: Db, run_id: str, kind: str, token: str) -> bool:
    """Whether the run's log holds a ``kind`` event of the write attempt ``token``."""
    return await attempt_event(db, "run_id = ? AND kind = ?", (run_id, kind), token) is not None


async def events(db: Db, run_id: str) -> list[EventRecord]:
    await load_run(db, run_id)
    sql = (
        "SELECT seq, at, run_id, op_id, kind, from_state, to_state, data FROM events"
        " WHERE run_id = ? ORDER BY seq"
    )
    return [rows.event_from_row(r) for r in await db.all(sql, (run_id,))]


async def list_runs(
    db: Db, state: RunState | None, owner: str | None, limit: int
) -> list[RunRecord]:
    sql, params = rows.list_runs_query(state, owner, limit, "?")
    return [rows.run_from_row(r) for r in await db.all(sql, params)]


async def fenced_among(db: Db, run_ids: Collection[str]) -> list[str]:
    """Those of ``run_ids`` fenced now, in the given order (a cancel notified a while
    ago may have been followed by a resume: that run is not fenced any more)."""
    if not run_ids:
        return []
    which, params = db.dialect.in_list("id", run_ids)
    sql = f"SELECT id FROM runs WHERE {which} AND state IN ({sql_values(FENCED)})"
    fenced = {str(r[0]) for r in await db.all(sql, params)}
    return [r for r in run_ids if r in fenced]


async def operations(db: Db, run_id: str, descendants: bool) -> list[OperationRecord]:
    await load_run(db, run_id)
    found = await db.all(*operations_query(db.dialect, run_id, descendants))
    return [rows.op_from_row(r) for r in found]


async def run_and_operations(
    db: Db, run_id: str, descendants: bool = False
) -> tuple[RunRecord, list[OperationRecord]]:
    """The run and its operations (with ``descendants``, those of the runs it owns
    exclusively too), read from one snapshot: one round trip, one job on the writer."""
    reads = [run_query(run_id), operations_query(db.dialect, run_id, descendants)]
    found, ops = await db.snapshot(reads)
    return found_run(found, run_id), [rows.op_from_row(r) for r in ops]


async def runs_and_operations(
    db: Db, run_ids: Sequence[str], *, settling: bool = False
) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
    """``run_and_operations`` of many runs (their own operations), from one snapshot,
    two statements per 4,096 runs in one round trip; an unknown run is returned in its
    place. ``settling``: only what a settling step reads (``SETTLING_SQL``), so a step
    of a run with a long history does not read it all."""
    dialect = db.dialect
    reads = [runs_query(dialect, chunk) for chunk in chunks(sorted(run_ids))]
    of_runs = len(reads)
    only = SETTLING_SQL if settling else None
    reads += [ops_query(dialect, "run_id", chunk, only=only) for chunk in chunks(run_ids)]
    results = await db.snapshot(reads)
    found = {run.id: run for found in results[:of_runs] for run in map(rows.run_from_row, found)}
    ops: dict[str, list[OperationRecord]] = {}
    for op in (rows.op_from_row(row) for found in results[of_runs:] for row in found):
        ops.setdefault(op.run_id, []).append(op)
    return [(found[r], ops.get(r, [])) if r in found else UnknownRun(r) for r in run_ids]


async def trees_and_operations(
    db: Db, run_ids: Sequence[str]
) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
    """``run_and_operations`` with ``descendants`` of many runs, from one snapshot: per
    4,096 runs, the runs, the runs of their trees and the operations of those, three
    statements in one round trip (a page of 200 receipts was 200 reads, each its own
    moment). An unknown run is returned in its place. Each run's operations keep the
    order one run's read gives them (the statement's own order: ``created_at, id``)."""
    return await _trees_of(db, run_ids, None)


async def list_trees(
    db: Db, state: RunState | None, owner: str | None, limit: int
) -> list[tuple[RunRecord, list[OperationRecord]]]:
    """``list_runs`` and the ``trees_and_operations`` of those runs, from one snapshot
    (a page whose rows were read at one moment and their receipts at another could show
    a run ``running`` beside its receipt's "cancelled"). Two round trips on PostgreSQL,
    one job on SQLite's writer; the listed rows are the trees' roots (not read again)."""
    async with db.transaction(snapshot=True):
        listed = await list_runs(db, state, owner, limit)
        found = await _trees_of(db, [run.id for run in listed], {r.id: r for r in listed})
    return [tree for tree in found if not isinstance(tree, UnknownRun)]


async def _trees_of(
    db: Db, run_ids: Sequence[str], known: dict[str, RunRecord] | None
) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
    """``trees_and_operations``; with ``known``, the roots' rows as read already in
    this snapshot, so only the trees and their operations are read."""
    dialect = db.dialect
    per_chunk = 2 if known is not None else 3  # [the roots' rows,] the trees, their ops
    reads: list[tuple[str, Params]] = []
    for chunk in chunks(sorted(run_ids)):
        roots, params = dialect.each_of(chunk)
        if known is None:
            reads.append(runs_query(dialect, chunk))
        reads += [_trees(dialect, roots, params), _tree_ops(dialect, roots, params)]
    results = await db.snapshot(reads)
    found: dict[str, RunRecord] = dict(known or {})
    ops: dict[str, list[OperationRecord]] = {}
    for at in range(0, len(results), per_chunk):
        *roots_read, trees, tree_ops = results[at : at + per_chunk]
        for read in roots_read:
            found.update((r.id, r) for r in map(rows.run_from_row, read))
        members: dict[str, list[str]] = {}  # a run of a tree -> the trees it is in
        for root, member in trees:
            members.setdefault(member, []).append(root)
        for op in map(rows.op_from_row, tree_ops):
            for root in members.get(op.run_id, ()):
                ops.setdefault(root, []).append(op)
    return [(found[r], ops.get(r, [])) if r in found else UnknownRun(r) for r in run_ids]


def _trees(dialect: Dialect, roots: str, params: Params) -> tuple[str, Params]:
    """Each of ``roots`` (a row source, ``Dialect.each_of``) with every run of its tree:
    ``(root, member)`` rows. From the ids, as one run's read (a root that is no run has
    no tree): reading the roots' rows first, on a ledger it has not analyzed, PostgreSQL
    may scan every run for them."""
    step = dialect.owned_step(carry="tree.root, ")
    sql = f"WITH RECURSIVE tree(root, id) AS (SELECT value, value FROM {roots}{step})"
    return f"{sql} SELECT root, id FROM tree", params


def _tree_ops(dialect: Dialect, roots: str, params: Params) -> tuple[str, Params]:
    """The operations of the trees of ``roots``, in their order."""
    tree = f"WITH RECURSIVE tree(id) AS (SELECT value FROM {roots}{dialect.owned_step()})"
    return tree + _ops_of_tree(dialect), params


def _ops_of_tree(dialect: Dialect) -> str:
    which = dialect.in_rows("run_id", "SELECT id FROM tree")
    return f" SELECT {rows.OP_COLUMNS} FROM operations WHERE {which} ORDER BY created_at, id"


def operations_query(dialect: Dialect, run_id: str, descendants: bool) -> tuple[str, tuple[str]]:
    """The statement reading the run's operations (with ``descendants``, those of the
    runs it owns exclusively too), in their order."""
    if not descendants:
        return (
            f"SELECT {rows.OP_COLUMNS} FROM operations WHERE run_id = ? ORDER BY created_at, id",
            (run_id,),
        )
    tree = f"WITH RECURSIVE tree(id) AS (SELECT {dialect.text('?')}{dialect.owned_step()})"
    return tree + _ops_of_tree(dialect), (run_id,)


def wanted_open(statuses: Collection[OpStatus] | None) -> list[OpStatus]:
    """The open statuses asked for (the default: what recovery looks at); else ``ValueError``."""
    chosen = DEFAULT_UNRESOLVED if statuses is None else frozenset(statuses)
    if not chosen <= OPEN:
        raise ValueError(f"not open statuses: {sorted(s.value for s in chosen - OPEN)}")
    return sorted(chosen)


async def unresolved(
    db: Db, limit: int, statuses: Collection[OpStatus] | None
) -> list[OperationRecord]:
    """Open operations through the partial index ``ops_open``, never resolved history."""
    wanted, params = db.dialect.in_list("status", [s.value for s in wanted_open(statuses)])
    sql = (
        f"SELECT {rows.OP_COLUMNS} FROM operations{db.dialect.indexed_by('ops_open')}"
        f" WHERE status IN ({OPEN_SQL}) AND {wanted} ORDER BY created_at, id LIMIT ?"
    )
    return [rows.op_from_row(r) for r in await db.all(sql, (*params, limit))]


async def first_unsettled(db: Db, run_ids: Sequence[str]) -> tuple[str, str] | None:
    """The oldest operation of the runs not yet settled, as ``(id, status)``: R10 needs
    none (a checkpoint of a run, a resume of a tree)."""
    which, params = db.dialect.in_list("run_id", run_ids)
    row = await db.one(
        f"SELECT id, status FROM operations WHERE {which}"
        f" AND status NOT IN ({sql_values(SETTLED)}) ORDER BY created_at, id LIMIT 1",
        params,
    )
    return None if row is None else (row[0], row[1])


async def compensations(db: Db, op_id: str) -> list[OperationRecord]:
    sql = (
        f"SELECT {rows.OP_COLUMNS} FROM operations{db.dialect.indexed_by('ops_compensates')}"
        " WHERE compensates IS NOT NULL AND compensates = ? ORDER BY created_at, id"
    )
    return [rows.op_from_row(r) for r in await db.all(sql, (op_id,))]


async def in_flight_workers(db: Db) -> list[WorkerLease]:
    sql = (
        "SELECT o.worker, max(o.updated_at), count(*), w.host, w.pid, w.lease_until"
        f" FROM operations AS o{db.dialect.indexed_by('ops_open')}"
        " LEFT JOIN workers AS w ON w.id = o.worker"
        f" WHERE {in_flight_where('o.status')} GROUP BY o.worker, w.host, w.pid, w.lease_until"
        " ORDER BY o.worker"
    )
    return [rows.lease_from_row(row) for row in await db.all(sql)]


async def approvals(db: Db, run_id: str) -> list[ApprovalRecord]:
    await load_run(db, run_id)
    sql = f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE run_id = ? ORDER BY created_at, id"
    return [rows.approval_from_row(r) for r in await db.all(sql, (run_id,))]


async def last_checkpoint(db: Db, run_id: str) -> Checkpoint | None:
    await load_run(db, run_id)
    row = await db.one(
        "SELECT seq, name, at, state FROM checkpoints WHERE run_id = ? ORDER BY seq DESC LIMIT 1",
        (run_id,),
    )
    if row is None:
        return None
    # the operations that passed the gate before the checkpoint was taken
    ops = [
        r[0]
        for r in await db.all(
            "SELECT op_id FROM events WHERE run_id = ? AND kind = ? AND seq <"
            " (SELECT seq FROM events WHERE run_id = ? AND kind = ?"
            f" AND {db.dialect.json_int('data', 'seq')} = ?) ORDER BY seq",
            (run_id, OpEvent.GATE_PASSED, run_id, LogKind.CHECKPOINT, row[0]),
        )
    ]
    return Checkpoint(run_id, row[0], row[1], row[2], json.loads(row[3]), tuple(ops))
