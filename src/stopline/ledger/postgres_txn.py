"""PostgreSQL transaction bodies for runs and operations: the gate and the outcomes.

Each body takes a ``Tx`` (one pooled connection in autocommit mode) and is
either one statement (it commits by itself: the gate's fast path, ``record``)
or an explicit ``BEGIN ... COMMIT`` through ``Tx.transaction``. ``Tx`` knows
when a commit is on the wire, so the backend can tell a failure that rolled
back (safe to retry) from one whose commit is in doubt.

Isolation is READ COMMITTED with explicit row locks on ``runs``: the gate
takes its run ``FOR SHARE`` inside its one statement and a cancel takes the
run ``FOR UPDATE`` before it writes its events, so in ``events.seq`` order
every ``gate_passed`` of a run precedes its cancel (R1) exactly as SQLite's
single writer gives it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg

from stopline.domain.model import EventRecord, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Grant, OpEvent, OpStatus, RunState
from stopline.errors import IdempotencyConflict, UnknownOperation, UnknownRun
from stopline.ledger import rows
from stopline.ledger.backend import GateResult, GateVerdict
from stopline.ledger.postgres_errors import LeaseExpired

__all__ = [
    "GATE_EVIDENCE",
    "Tx",
    "event",
    "gate_committed",
    "gate_txn",
    "load_op",
    "load_run",
]

# the server's clock: a paused worker cannot pass a stale "now" (fencing)
SERVER_NOW = "extract(epoch from clock_timestamp())"
GATE_EVIDENCE = rows.dump_evidence([Evidence.local("gate", "intent recorded before dispatch")])
_RETRYABLE = frozenset({OpStatus.NOT_COMMITTED, OpStatus.PREVENTED})
_FENCED_STATES = frozenset(
    {RunState.CANCELLING, RunState.SETTLING, RunState.CANCELLED, RunState.NEEDS_REVIEW}
)
_INITIATE = int(Grant.INITIATE)
_COMPENSATE = int(Grant.COMPENSATE)
# a worker may record an intent only while its lease (if it has one) is live
_LEASE_LIVE = (
    "NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = %(worker)s"
    f" AND w.lease_until <= {SERVER_NOW})"
)
_ELIGIBLE = f"state = 'running' AND (grants & {_INITIATE}) <> 0"
_ELIGIBLE_COMPENSATION = f"state NOT IN ('pausing', 'paused') AND (grants & {_COMPENSATE}) <> 0"
_APPROVED = (
    "EXISTS (SELECT 1 FROM approvals a WHERE a.run_id = runs.id AND a.scope = %(id)s"
    " AND a.status = 'granted' AND (a.expires_at IS NULL OR a.expires_at > %(now)s))"
)


@functools.cache
def _gate_sql(eligible: str, approved: bool) -> str:
    """The gate as one statement: fence check, intent and event, one round trip, one commit."""
    where = f"id = %(run)s AND {eligible} AND {_LEASE_LIVE}" + (
        f" AND {_APPROVED}" if approved else ""
    )
    return f"""
WITH run AS (SELECT id, fence FROM runs WHERE {where} FOR SHARE OF runs),
ins AS (
    INSERT INTO operations ({rows.OP_COLUMNS})
    SELECT %(id)s, run.id, %(tool)s, %(description)s, %(digest)s, 'requested', %(cancellable)s,
        %(can_verify)s, %(can_compensate)s, 'none', 1, NULL, 0, NULL, NULL, %(evidence)s,
        %(now)s, %(now)s, %(compensates)s, %(worker)s
    FROM run ON CONFLICT (id) DO NOTHING RETURNING run_id
)
INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
SELECT %(now)s, ins.run_id, %(id)s, 'gate_passed', 'not_started', 'requested',
    json_build_object('fence', run.fence, 'attempt', %(token)s::text)::text
FROM ins CROSS JOIN run RETURNING (SELECT fence FROM run)
"""


class Tx:
    """One connection for one transaction body; tracks whether a commit is in doubt."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], location: str) -> None:
        self.conn = conn
        self.location = location
        self.in_doubt = False  # a statement that commits (or COMMIT itself) is on the wire

    async def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        cur = await self.conn.execute(sql, params)
        return await cur.fetchone()

    async def all(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        cur = await self.conn.execute(sql, params)
        return await cur.fetchall()

    async def run(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        cur = await self.conn.execute(sql, params)
        return cur.rowcount

    async def many(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        if seq:
            async with self.conn.cursor() as cur:
                await cur.executemany(sql, seq)

    async def write1(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """One statement that commits by itself; its commit is in doubt while it runs."""
        self.in_doubt = True
        row = await self.one(sql, params)
        self.in_doubt = False
        return row

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        await self.conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            with contextlib.suppress(psycopg.Error):  # a broken connection rolled back already
                await self.conn.execute("ROLLBACK")
            raise
        self.in_doubt = True
        await self.conn.execute("COMMIT")
        self.in_doubt = False


# -- loads and the log ---------------------------------------------------------------
async def load_run(tx: Tx, run_id: str, *, lock: str = "") -> RunRecord:
    row = await tx.one(f"SELECT {rows.RUN_COLUMNS} FROM runs WHERE id = %s {lock}", (run_id,))
    if row is None:
        raise UnknownRun(run_id)
    return rows.run_from_row(row)


async def load_op(tx: Tx, op_id: str) -> OperationRecord:
    row = await tx.one(f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = %s", (op_id,))
    if row is None:
        raise UnknownOperation(op_id)
    return rows.op_from_row(row)


async def event(
    tx: Tx,
    at: float,
    run_id: str,
    op_id: str | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    data: dict[str, Any],
) -> None:
    await tx.run(
        "INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (at, run_id, op_id, kind, from_state, to_state, rows.dump_data(data)),
    )


async def events_of(tx: Tx, run_id: str) -> list[EventRecord]:
    await load_run(tx, run_id)
    return [
        rows.event_from_row(r)
        for r in await tx.all(
            "SELECT seq, at, run_id, op_id, kind, from_state, to_state, data FROM events"
            " WHERE run_id = %s ORDER BY seq",
            (run_id,),
        )
    ]


# -- the gate -------------------------------------------------------------------------
def _gate_params(spec: OperationSpec, now: float, token: str) -> dict[str, Any]:
    return {
        "id": spec.id,
        "run": spec.run_id,
        "tool": spec.tool,
        "description": spec.description,
        "digest": spec.args_digest,
        "cancellable": spec.cancellable.value,
        "can_verify": int(spec.can_verify),
        "can_compensate": int(spec.can_compensate),
        "evidence": GATE_EVIDENCE,
        "now": now,
        "compensates": spec.compensates,
        "worker": spec.worker,
        "token": token,
    }


def _fast_sql(spec: OperationSpec) -> str:
    if spec.compensates:
        return _gate_sql(_ELIGIBLE_COMPENSATION, False)
    return _gate_sql(_ELIGIBLE, spec.needs_approval)


async def gate_txn(tx: Tx, spec: OperationSpec, token: str, *, nested: bool = False) -> GateResult:
    """The fast path in one statement; anything else in one locked transaction.

    ``nested``: inside a transaction the caller opened (a compensation's gate).
    """
    now = time.time()
    params = _gate_params(spec, now, token)
    sql = _fast_sql(spec)
    row = await (tx.one(sql, params) if nested else tx.write1(sql, params))
    if row is not None:
        return GateResult(GateVerdict.PASSED, fence=row[0])
    if nested:
        return await _gate_slow_path(tx, spec, now, params)
    async with tx.transaction():
        return await _gate_slow_path(tx, spec, now, params)


async def gate_committed(tx: Tx, op_id: str, token: str) -> int | None:
    """After a connection loss: did the gate attempt ``token`` commit? Its fence if so."""
    row = await tx.one(
        "SELECT data FROM events WHERE op_id = %s AND kind = 'gate_passed'"
        " AND data::jsonb ->> 'attempt' = %s",
        (op_id, token),
    )
    return None if row is None else int(json.loads(row[0])["fence"])


async def _lease_live(tx: Tx, worker: str) -> bool:
    row = await tx.one(
        f"SELECT lease_until > {SERVER_NOW} FROM workers WHERE id = %s FOR SHARE", (worker,)
    )
    return row is None or bool(row[0])


async def _gate_slow_path(
    tx: Tx, spec: OperationSpec, now: float, params: dict[str, Any]
) -> GateResult:
    """The id exists, the run is missing or may not initiate, or the lease expired."""
    from stopline.ledger.postgres_lifecycle import settle_pause_txn

    run = await load_run(tx, spec.run_id, lock="FOR UPDATE")  # the gate's outcome is now fixed
    row = await tx.one(f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = %s", (spec.id,))
    may_initiate = run.state is RunState.RUNNING and bool(run.grants & Grant.INITIATE)
    if spec.compensates:
        eligible = run.state not in (RunState.PAUSING, RunState.PAUSED) and bool(
            run.grants & Grant.COMPENSATE
        )
    else:
        eligible = may_initiate
    if row is not None:
        existing = rows.op_from_row(row)
        if existing.args_digest != spec.args_digest or existing.run_id != spec.run_id:
            raise IdempotencyConflict(spec.id)
        if existing.status in _RETRYABLE and may_initiate:
            if not await _lease_live(tx, spec.worker):
                raise LeaseExpired(spec.worker, tx.location)
            # a retry with the same key: the earlier attempt provably did not commit
            target = apply(OPERATION_TABLE, existing.status, OpEvent.GATE_PASSED)
            await tx.run(
                "UPDATE operations SET status = %s, attempts = attempts + 1, cancel_state = 'none',"
                " updated_at = %s, worker = %s WHERE id = %s AND status = %s",
                (target.value, now, spec.worker, spec.id, existing.status.value),
            )
            data = {"fence": run.fence, "retry": True, "attempt": params["token"]}
            await event(
                tx, now, spec.run_id, spec.id, OpEvent.GATE_PASSED.value,
                existing.status.value, target.value, data,
            )  # fmt: skip
            return GateResult(GateVerdict.PASSED, fence=run.fence)
        if existing.status is OpStatus.NOT_COMMITTED and run.state in _FENCED_STATES:
            # R1: a retry timer or redelivery after the fence; the attempt is refused
            data = {"fence": run.fence, "retry": True, "run_state": run.state.value}
            await event(
                tx, now, spec.run_id, spec.id, OpEvent.GATE_REFUSED.value,
                existing.status.value, existing.status.value, data,
            )  # fmt: skip
            return GateResult(GateVerdict.PREVENTED, existing, run.fence)
        return GateResult(GateVerdict.EXISTING, existing, run.fence)
    if run.state in (RunState.PAUSING, RunState.PAUSED):
        await settle_pause_txn(tx, run.id)  # a worker waiting at the gate is idle
        return GateResult(GateVerdict.PAUSED, fence=run.fence)
    if eligible:
        if not await _lease_live(tx, spec.worker):
            raise LeaseExpired(spec.worker, tx.location)  # fencing: nothing recorded, nothing sent
        approved = not spec.needs_approval or bool(spec.compensates)
        if not approved and may_initiate:
            approved = await tx.one(_APPROVAL_VALID, (run.id, spec.id, now)) is not None
        if not approved:
            return GateResult(GateVerdict.NEEDS_APPROVAL, fence=run.fence)
        # the run changed between the fast path's snapshot and this lock: pass now
        if await tx.one(_fast_sql(spec), params) is not None:
            return GateResult(GateVerdict.PASSED, fence=run.fence)
    evidence = [Evidence.local(f"fence:{run.fence}", f"run {run.state.value}; initiate revoked")]
    await tx.run(
        f"INSERT INTO operations ({rows.OP_COLUMNS}) VALUES (%s, %s, %s, %s, %s, 'prevented',"
        " %s, %s, %s, 'none', 0, NULL, 0, NULL, NULL, %s, %s, %s, %s, %s)",
        (
            spec.id, spec.run_id, spec.tool, spec.description, spec.args_digest,
            spec.cancellable.value, int(spec.can_verify), int(spec.can_compensate),
            rows.dump_evidence(evidence), now, now, spec.compensates, spec.worker,
        ),
    )  # fmt: skip
    data = {"fence": run.fence, "run_state": run.state.value}
    await event(
        tx, now, spec.run_id, spec.id, OpEvent.GATE_REFUSED.value, "not_started", "prevented", data
    )
    return GateResult(GateVerdict.PREVENTED, await load_op(tx, spec.id), run.fence)


_APPROVAL_VALID = (
    "SELECT 1 FROM approvals WHERE run_id = %s AND scope = %s AND status = 'granted'"
    " AND (expires_at IS NULL OR expires_at > %s)"
)
