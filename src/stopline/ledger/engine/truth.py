"""Truth after the fact: workers' leases, orphan recovery (R2), compensation links (S8).

Leases are fencing tokens on both engines: the gate refuses a new intent from
a worker whose lease expired by the ledger's clock. So that a worker paused
past its lease cannot slip an intent in after another worker recovered it,
recovery keeps a dead worker's row as a tombstone (its lease set to 0); the
zombie passes the gate again only after it renews its lease, by which time
what it had in flight is ``unknown`` and being reconciled. Tombstones older
than ``TOMBSTONE_DAYS`` are pruned. Every query on operations goes through
the partial index ``ops_open`` (its condition repeated verbatim).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence

from stopline.domain.model import (
    Evidence,
    OperationRecord,
    OperationSpec,
    horizon_evidence,
    horizon_in,
)
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Cause, NoteKind, OpEvent
from stopline.ledger.backend import GateResult, GateVerdict, OutcomeUpdate
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.gate import gate
from stopline.ledger.engine.reads import in_flight_where, load_op
from stopline.ledger.engine.record import record

__all__ = ["TOMBSTONE_DAYS", "begin_compensation", "heartbeat", "recover_orphans"]

TOMBSTONE_DAYS = 7


async def heartbeat(db: Db, worker: str, host: str, pid: int, lease_until: float) -> None:
    now = time.time()
    async with db.transaction():
        await db.run(
            "INSERT INTO workers (id, host, pid, started_at, heartbeat_at, lease_until)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
            " heartbeat_at = excluded.heartbeat_at, lease_until = excluded.lease_until",
            (worker, host, pid, now, now, lease_until),
        )
        if lease_until <= 0:  # retired: forget it unless it left work in flight
            await db.run(
                "DELETE FROM workers WHERE id = ? AND NOT EXISTS (SELECT 1 FROM operations"
                f"{db.dialect.indexed_by('ops_open')} WHERE {in_flight_where()} AND worker = ?)",
                (worker, worker),
            )


async def recover_orphans(
    db: Db, workers: Collection[str], evidence: Sequence[Evidence]
) -> list[OperationRecord]:
    """Mark every in-flight operation of these dead workers ``unknown`` (cause ``crash``)."""
    dead = sorted(set(workers))
    recovered: list[OperationRecord] = []
    now = time.time()
    open_index = db.dialect.indexed_by("ops_open")
    async with db.transaction():
        if dead:
            # tombstone first: from here on, a zombie's gate is refused (fencing)
            ids, params = db.dialect.in_list("id", dead)
            await db.run(
                f"UPDATE workers SET lease_until = 0 WHERE {ids} AND lease_until > 0", params
            )
            held, params = db.dialect.in_list("worker", dead)
            orphans = await db.all(
                f"SELECT id, run_id FROM operations{open_index} WHERE {in_flight_where()}"
                f" AND {held} ORDER BY created_at, id{db.dialect.for_update}",
                params,
            )
            stated = await _stated_horizons(db, {run_id for _, run_id in orphans})
            for op_id, _ in orphans:
                horizon = stated.get(op_id)  # R13: the provider's bound outlives the worker
                kept = evidence if horizon is None else [*evidence, horizon_evidence(horizon)]
                update = OutcomeUpdate(OpEvent.LOST, kept, cause=Cause.CRASH)
                recovered.append(await record(db, op_id, update))
        # leases that expired and guard nothing are history; tombstones after a while
        await db.run(
            "DELETE FROM workers WHERE ((lease_until > 0 AND lease_until < ?)"
            " OR heartbeat_at < ?) AND id NOT IN"
            f" (SELECT worker FROM operations{open_index} WHERE {in_flight_where()})",
            (now, now - TOMBSTONE_DAYS * 86400),
        )
    return recovered


async def _stated_horizons(db: Db, run_ids: Collection[str]) -> dict[str, float]:
    """The earliest horizon stated for each operation of these runs (``settles_by``,
    noted as it was stated); a note that cannot be read states nothing."""
    if not run_ids:
        return {}
    which, params = db.dialect.in_list("run_id", sorted(run_ids))
    notes = await db.all(
        f"SELECT op_id, data FROM events WHERE {which} AND kind = ?",
        (*params, NoteKind.HORIZON_STATED.value),
    )
    stated: dict[str, float] = {}
    for op_id, data in notes:
        try:
            items = [Evidence.from_json(e) for e in json.loads(data)["evidence"]]
        except (ValueError, TypeError, KeyError):
            continue
        at = horizon_in(items)
        if at is not None and (op_id not in stated or at < stated[op_id]):
            stated[op_id] = at
    return stated


async def begin_compensation(
    db: Db, spec: OperationSpec, evidence: Sequence[Evidence], token: str | None = None
) -> GateResult:
    """The compensation's gate and the original's committed -> compensating, atomically.

    Raises ``IllegalTransition`` (recording nothing) if that operation is not committed.
    """
    assert spec.compensates is not None, "a compensation names the operation it corrects"
    async with db.transaction():
        original = await load_op(db, spec.compensates, lock=db.dialect.for_update)
        apply(OPERATION_TABLE, original.status, OpEvent.COMPENSATION_STARTED)  # or raise
        result = await gate(db, spec, token)
        if result.verdict is GateVerdict.PASSED:
            await record(db, original.id, OutcomeUpdate(OpEvent.COMPENSATION_STARTED, evidence))
    return result
