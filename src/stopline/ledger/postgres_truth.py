"""PostgreSQL transaction bodies for truth after the fact: leases, orphans, compensation links.

The same semantics as ``sqlite_truth``, across hosts. Queries on operations
repeat the partial index ``ops_open``'s condition so the planner uses it:
crash recovery never scans resolved history.

Leases are fencing tokens here: the gate refuses a new intent from a worker
whose lease row has expired by the *server's* clock (``LeaseExpired``). So
that a worker paused past its lease cannot slip an intent in after another
worker recovered it, recovery keeps a dead worker's row as a tombstone (its
lease set to 0) instead of deleting it; the zombie passes the gate again only
after it renews its lease, by which time what it had in flight is ``unknown``
and being reconciled. Tombstones older than ``TOMBSTONE_DAYS`` are pruned.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from stopline.domain.model import Evidence, OperationRecord, OperationSpec
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Cause, OpEvent
from stopline.ledger import rows
from stopline.ledger.backend import GateResult, GateVerdict, OutcomeUpdate
from stopline.ledger.leases import WorkerLease
from stopline.ledger.postgres_runs import record_txn
from stopline.ledger.postgres_txn import Tx, gate_txn, load_op
from stopline.ledger.schema import OPEN_STATUSES_SQL

__all__ = [
    "TOMBSTONE_DAYS",
    "begin_compensation_txn",
    "compensations_txn",
    "heartbeat_txn",
    "in_flight_workers_txn",
    "recover_orphans_txn",
]

TOMBSTONE_DAYS = 7
# What a crash can leave behind: every status with a `lost` transition (R2, R3).
_ORPHAN_SQL = ", ".join(
    f"'{s}'" for s in sorted(s.value for (s, e) in OPERATION_TABLE if e is OpEvent.LOST)
)


def _in_flight(column: str = "status") -> str:
    """The open index's own condition, verbatim, then the in-flight statuses."""
    return f"{column} IN ({OPEN_STATUSES_SQL}) AND {column} IN ({_ORPHAN_SQL})"


_IN_FLIGHT_WHERE = _in_flight()


async def heartbeat_txn(tx: Tx, worker: str, host: str, pid: int, lease_until: float) -> None:
    now = time.time()
    async with tx.transaction():
        await tx.run(
            "INSERT INTO workers (id, host, pid, started_at, heartbeat_at, lease_until)"
            " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET"
            " heartbeat_at = excluded.heartbeat_at, lease_until = excluded.lease_until",
            (worker, host, pid, now, now, lease_until),
        )
        if lease_until <= 0:  # retired: forget it unless it left work in flight
            await tx.run(
                "DELETE FROM workers WHERE id = %s AND NOT EXISTS (SELECT 1 FROM operations"
                f" WHERE {_IN_FLIGHT_WHERE} AND worker = %s)",
                (worker, worker),
            )


async def in_flight_workers_txn(tx: Tx) -> list[WorkerLease]:
    sql = (
        "SELECT o.worker, max(o.updated_at), count(*), w.host, w.pid, w.lease_until"
        " FROM operations AS o LEFT JOIN workers AS w ON w.id = o.worker"
        f" WHERE {_in_flight('o.status')} GROUP BY o.worker, w.host, w.pid, w.lease_until"
        " ORDER BY o.worker"
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
        for row in await tx.all(sql)
    ]


async def recover_orphans_txn(
    tx: Tx, workers: Collection[str], evidence: Sequence[Evidence]
) -> list[OperationRecord]:
    dead = sorted(set(workers))
    recovered: list[OperationRecord] = []
    now = time.time()
    async with tx.transaction():
        if dead:
            # tombstone first: from here on, a zombie's gate is refused (fencing)
            await tx.run(
                "UPDATE workers SET lease_until = 0 WHERE id = ANY(%s) AND lease_until > 0",
                (dead,),
            )
            orphans = await tx.all(
                f"SELECT id FROM operations WHERE {_IN_FLIGHT_WHERE} AND worker = ANY(%s)"
                " ORDER BY created_at, id FOR UPDATE",
                (dead,),
            )
            update = OutcomeUpdate(OpEvent.LOST, evidence, cause=Cause.CRASH)
            recovered = [await record_txn(tx, op_id, update, single=False) for (op_id,) in orphans]
        # leases that expired and guard nothing are history; tombstones after a while
        await tx.run(
            "DELETE FROM workers WHERE ((lease_until > 0 AND lease_until < %s)"
            " OR heartbeat_at < %s) AND id NOT IN"
            f" (SELECT worker FROM operations WHERE {_IN_FLIGHT_WHERE})",
            (now, now - TOMBSTONE_DAYS * 86400),
        )
    return recovered


async def begin_compensation_txn(
    tx: Tx, spec: OperationSpec, evidence: Sequence[Evidence], token: str
) -> GateResult:
    """The compensation's gate and the original's committed -> compensating, atomically."""
    assert spec.compensates is not None, "a compensation names the operation it corrects"
    async with tx.transaction():
        await tx.run("SELECT 1 FROM operations WHERE id = %s FOR UPDATE", (spec.compensates,))
        original = await load_op(tx, spec.compensates)
        apply(OPERATION_TABLE, original.status, OpEvent.COMPENSATION_STARTED)  # or raise
        result = await gate_txn(tx, spec, token, nested=True)
        if result.verdict is GateVerdict.PASSED:
            update = OutcomeUpdate(OpEvent.COMPENSATION_STARTED, evidence)
            await record_txn(tx, original.id, update, single=False)
    return result


async def compensations_txn(tx: Tx, op_id: str) -> list[OperationRecord]:
    sql = (
        f"SELECT {rows.OP_COLUMNS} FROM operations"
        " WHERE compensates IS NOT NULL AND compensates = %s ORDER BY created_at, id"
    )
    return [rows.op_from_row(r) for r in await tx.all(sql, (op_id,))]
