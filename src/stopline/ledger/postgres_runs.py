"""PostgreSQL transaction bodies for runs and operations other than the gate.

Runs: create (a child of a fenced parent is born fenced), transitions, phases,
listings. Operations: ``record`` (one statement whose status guard and target
come from the operation table), ``note``, and the reads. Each body runs on
one ``Tx``; the multi-statement ones inside ``Tx.transaction``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection
from typing import Any

from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE, apply
from stopline.domain.vocab import Grant, OpEvent, OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import UnknownOperation, UnknownRun
from stopline.ledger import rows
from stopline.ledger.backend import OutcomeUpdate, RunSpec
from stopline.ledger.postgres_txn import Tx, event, load_op, load_run
from stopline.ledger.schema import DEFAULT_UNRESOLVED, OPEN_STATUSES, OPEN_STATUSES_SQL

__all__ = [
    "create_run_txn",
    "list_runs_txn",
    "note_txn",
    "operations_txn",
    "record_txn",
    "run_event_txn",
    "set_phase_txn",
    "unresolved_txn",
]


# -- runs -----------------------------------------------------------------------------
async def create_run_txn(tx: Tx, spec: RunSpec) -> RunRecord:
    now = time.time()
    state, grants = RunState.RUNNING, spec.grants
    if spec.parent_id is not None:
        # FOR SHARE: a cancel of the parent either fenced it already or waits for us
        parent = await load_run(tx, spec.parent_id, lock="FOR SHARE")
        if not parent.grants & Grant.INITIATE:
            grants &= ~Grant.INITIATE  # born fenced
            state = RunState.CANCELLING
    await tx.run(
        f"INSERT INTO runs ({rows.RUN_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, 0, %s,"
        " NULL, %s, %s, %s, NULL, NULL, NULL)",
        (
            spec.id, spec.name, spec.owner, spec.tenant, spec.parent_id, state.value,
            int(grants), spec.policy.value, now, now,
        ),
    )  # fmt: skip
    if spec.parent_id is not None:
        await tx.run(
            "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
            " VALUES (%s, %s, %s, %s)",
            (spec.id, spec.parent_id, int(not spec.shared), now),
        )
    data = {"owner": spec.owner, "tenant": spec.tenant, "parent": spec.parent_id}
    await event(tx, now, spec.id, None, "run_created", None, state.value, data)
    return await load_run(tx, spec.id)


async def run_event_txn(
    tx: Tx, run_id: str, kind: RunEvent, by: str, reason: str
) -> tuple[RunRecord, bool]:
    """A run transition other than cancel (which is the subtree fence)."""
    run = await load_run(tx, run_id, lock="FOR UPDATE")
    target = apply(RUN_TABLE, run.state, kind)
    now = time.time()
    await tx.run(
        "UPDATE runs SET state = %s, updated_at = %s WHERE id = %s AND state = %s",
        (target.value, now, run_id, run.state.value),
    )
    data = {"by": by, "reason": reason}
    await event(tx, now, run_id, None, kind.value, run.state.value, target.value, data)
    return await load_run(tx, run_id), True


async def set_phase_txn(tx: Tx, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
    now = time.time()
    changed = await tx.run(
        "UPDATE runs SET phase = %s, policy = %s, updated_at = %s WHERE id = %s",
        (kind.value, policy.value, now, run_id),
    )
    if not changed:
        raise UnknownRun(run_id)
    data = {"phase": kind.value, "policy": policy.value}
    await event(tx, now, run_id, None, "phase", None, None, data)
    return await load_run(tx, run_id)


async def list_runs_txn(
    tx: Tx, state: RunState | None, owner: str | None, limit: int
) -> list[RunRecord]:
    sql, params = rows.list_runs_query(state, owner, limit, "%s")
    return [rows.run_from_row(r) for r in await tx.all(sql, params)]


# -- operations -----------------------------------------------------------------------
async def note_txn(
    tx: Tx, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None
) -> OperationRecord:
    await tx.run("SELECT 1 FROM operations WHERE id = %s FOR UPDATE", (op_id,))
    op = await load_op(tx, op_id)
    now = time.time()
    if cancel_state is not None:
        await tx.run(
            "UPDATE operations SET cancel_state = %s, updated_at = %s WHERE id = %s",
            (cancel_state, now, op_id),
        )
    await event(tx, now, op.run_id, op_id, kind, op.status.value, op.status.value, data)
    return await load_op(tx, op_id)


async def operations_txn(tx: Tx, run_id: str, descendants: bool) -> list[OperationRecord]:
    await load_run(tx, run_id)
    if not descendants:
        sql = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE run_id = %s ORDER BY created_at, id"
        return [rows.op_from_row(r) for r in await tx.all(sql, (run_id,))]
    sql = (
        "WITH RECURSIVE tree(id) AS (SELECT %s::text UNION"
        " SELECT o.run_id FROM run_owners o JOIN tree ON o.owner_run = tree.id"
        " WHERE o.exclusive = 1 AND o.released_at IS NULL)"
        f" SELECT {rows.OP_COLUMNS} FROM operations"
        " WHERE run_id IN (SELECT id FROM tree) ORDER BY created_at, id"
    )
    return [rows.op_from_row(r) for r in await tx.all(sql, (run_id,))]


async def unresolved_txn(
    tx: Tx, limit: int, statuses: Collection[OpStatus] | None
) -> list[OperationRecord]:
    """Open operations, through the partial index ``ops_open`` (its condition repeated)."""
    chosen = DEFAULT_UNRESOLVED if statuses is None else frozenset(statuses)
    if not chosen <= OPEN_STATUSES:
        raise ValueError(f"not open statuses: {sorted(s.value for s in chosen - OPEN_STATUSES)}")
    sql = (
        f"SELECT {rows.OP_COLUMNS} FROM operations WHERE status IN ({OPEN_STATUSES_SQL})"
        " AND status = ANY(%s) ORDER BY created_at, id LIMIT %s"
    )
    wanted = sorted(s.value for s in chosen)
    return [rows.op_from_row(r) for r in await tx.all(sql, (wanted, limit))]


# -- outcomes -------------------------------------------------------------------------
@functools.cache
def _record_sql(event_kind: OpEvent) -> str:
    """One statement: the compare-and-set derived from the operation table, and its event.

    The guard is the table's row for this event (``status IN (sources)``) and the
    target a ``CASE`` over the same rows, so storage and domain cannot disagree.
    """
    moves = {s: t for (s, e), t in OPERATION_TABLE.items() if e is event_kind}
    sources = ", ".join(f"'{s.value}'" for s in moves) or "NULL"
    case = " ".join(f"WHEN '{s.value}' THEN '{t.value}'" for s, t in moves.items())
    target = f"CASE old.status {case} END" if moves else "old.status"
    return f"""
WITH old AS (SELECT id, status, run_id, evidence FROM operations WHERE id = %(id)s FOR UPDATE),
upd AS (
    UPDATE operations o SET status = {target}, updated_at = %(now)s,
        evidence = CASE WHEN %(items)s::text IS NULL THEN old.evidence
            WHEN old.evidence = '[]' THEN '[' || %(items)s || ']'
            ELSE left(old.evidence, -1) || ',' || %(items)s || ']' END,
        cause = COALESCE(%(cause)s, o.cause), error = COALESCE(%(error)s, o.error),
        result = CASE WHEN %(has_result)s THEN %(result)s ELSE o.result END,
        has_result = CASE WHEN %(has_result)s THEN 1 ELSE o.has_result END,
        cancel_state = COALESCE(%(cancel_state)s, o.cancel_state)
    FROM old WHERE o.id = old.id AND old.status IN ({sources})
    RETURNING old.status AS source, o.*
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT %(now)s, upd.run_id, upd.id, %(kind)s, upd.source, upd.status, %(data)s FROM upd
)
SELECT old.status, upd.id IS NOT NULL,
    {", ".join(f"upd.{c.strip()}" for c in rows.OP_COLUMNS.split(","))}
FROM old LEFT JOIN upd ON true
"""


def _record_params(op_id: str, update: OutcomeUpdate, now: float) -> dict[str, Any]:
    result_text, has_result = rows.dump_result(update.result, update.has_result)
    items = ",".join(rows.dump_data(e.to_json()) for e in update.evidence) or None
    data: dict[str, Any] = {"evidence": [e.to_json() for e in update.evidence]}
    if update.cause is not None:
        data["cause"] = update.cause.value
    if update.error is not None:
        data["error"] = update.error
    if update.late:
        data["late"] = True
    return {
        "id": op_id,
        "now": now,
        "items": items,
        "cause": update.cause.value if update.cause else None,
        "error": update.error,
        "has_result": has_result,
        "result": result_text,
        "cancel_state": update.cancel_state,
        "kind": update.event.value,
        "data": rows.dump_data(data),
    }


async def record_txn(
    tx: Tx, op_id: str, update: OutcomeUpdate, *, single: bool = True
) -> OperationRecord:
    """Apply one transition (compare-and-set on the status read in the same statement)."""
    params = _record_params(op_id, update, time.time())
    sql = _record_sql(update.event)
    row = await (tx.write1(sql, params) if single else tx.one(sql, params))
    if row is None:
        raise UnknownOperation(op_id)
    if not row[1]:
        apply(OPERATION_TABLE, OpStatus(row[0]), update.event)  # raises IllegalTransition
        raise AssertionError(f"record of {op_id}: the table allows it but nothing changed")
    return rows.op_from_row(row[2:])
