"""SQLite transaction bodies for truth after the fact: leases, orphans, compensation links.

Each function runs on the writer thread inside one transaction. Every query
on operations goes through the partial index ``ops_open`` (its condition is
repeated verbatim so SQLite uses it): crash recovery never scans resolved
history. Status guards come from the operation table: the statuses an
orphan can leave are those with a ``lost`` transition.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Collection, Sequence

from stopline.domain.model import Evidence, OperationRecord, OperationSpec
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Cause, OpEvent
from stopline.ledger import rows
from stopline.ledger.backend import GateResult, GateVerdict, OutcomeUpdate
from stopline.ledger.leases import WorkerLease
from stopline.ledger.schema import OPEN_STATUSES_SQL

__all__ = [
    "begin_compensation_txn",
    "compensations_txn",
    "heartbeat_txn",
    "in_flight_workers_txn",
    "recover_orphans_txn",
]

# What a crash can leave behind: every status with a `lost` transition (R2, R3).
_ORPHAN_STATUSES = sorted(s.value for (s, e) in OPERATION_TABLE if e is OpEvent.LOST)
_ORPHAN_SQL = ", ".join(f"'{s}'" for s in _ORPHAN_STATUSES)


def _in_flight(column: str = "status") -> str:
    """The open index's own condition, verbatim, then the in-flight statuses."""
    return f"{column} IN ({OPEN_STATUSES_SQL}) AND {column} IN ({_ORPHAN_SQL})"


_IN_FLIGHT_WHERE = _in_flight()


def heartbeat_txn(
    conn: sqlite3.Connection, worker: str, host: str, pid: int, lease_until: float
) -> None:
    now = time.time()
    conn.execute(
        "INSERT INTO workers (id, host, pid, started_at, heartbeat_at, lease_until)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
        " heartbeat_at = excluded.heartbeat_at, lease_until = excluded.lease_until",
        (worker, host, pid, now, now, lease_until),
    )
    if lease_until <= 0:  # retired: forget it unless it left work in flight
        conn.execute(
            "DELETE FROM workers WHERE id = ? AND NOT EXISTS (SELECT 1 FROM operations"
            f" INDEXED BY ops_open WHERE {_IN_FLIGHT_WHERE} AND worker = ?)",
            (worker, worker),
        )


def in_flight_workers_txn(conn: sqlite3.Connection) -> list[WorkerLease]:
    sql = (
        "SELECT o.worker, max(o.updated_at), count(*), w.host, w.pid, w.lease_until"
        " FROM operations AS o INDEXED BY ops_open LEFT JOIN workers AS w ON w.id = o.worker"
        f" WHERE {_in_flight('o.status')} GROUP BY o.worker"
    )
    return [
        WorkerLease(
            worker=row[0],
            host=row[3],
            pid=row[4],
            lease_until=row[5],
            last_activity=row[1],
            in_flight=row[2],
        )
        for row in conn.execute(sql)
    ]


def recover_orphans_txn(
    conn: sqlite3.Connection, workers: Collection[str], evidence: Sequence[Evidence]
) -> list[OperationRecord]:
    from stopline.ledger.sqlite import _record_txn

    dead = sorted(set(workers))
    recovered: list[OperationRecord] = []
    if dead:
        marks = ", ".join("?" * len(dead))
        sql = (
            f"SELECT id FROM operations INDEXED BY ops_open WHERE {_IN_FLIGHT_WHERE}"
            f" AND worker IN ({marks}) ORDER BY created_at"
        )
        orphans = [row[0] for row in conn.execute(sql, dead)]
        update = OutcomeUpdate(OpEvent.LOST, evidence, cause=Cause.CRASH)
        recovered = [_record_txn(conn, op_id, update) for op_id in orphans]
        conn.execute(f"DELETE FROM workers WHERE id IN ({marks})", dead)
    # leases that expired and guard nothing are history
    conn.execute(
        "DELETE FROM workers WHERE lease_until < ? AND id NOT IN (SELECT worker FROM"
        f" operations INDEXED BY ops_open WHERE {_IN_FLIGHT_WHERE})",
        (time.time(),),
    )
    return recovered


def begin_compensation_txn(
    conn: sqlite3.Connection, spec: OperationSpec, evidence: Sequence[Evidence]
) -> GateResult:
    from stopline.ledger.sqlite import _gate_txn, _op, _record_txn

    assert spec.compensates is not None, "a compensation names the operation it corrects"
    original = _op(conn, spec.compensates)
    apply(OPERATION_TABLE, original.status, OpEvent.COMPENSATION_STARTED)  # or raise, unchanged
    result = _gate_txn(conn, spec)
    if result.verdict is GateVerdict.PASSED:
        _record_txn(conn, original.id, OutcomeUpdate(OpEvent.COMPENSATION_STARTED, evidence))
    return result


def compensations_txn(conn: sqlite3.Connection, op_id: str) -> list[OperationRecord]:
    sql = (
        f"SELECT {rows.OP_COLUMNS} FROM operations INDEXED BY ops_compensates"
        " WHERE compensates IS NOT NULL AND compensates = ? ORDER BY created_at, rowid"
    )
    return [rows.op_from_row(r) for r in conn.execute(sql, (op_id,))]
