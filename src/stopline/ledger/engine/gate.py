"""The gate (R1): the fence, the run's state, ``initiate``, the worker's lease and an
approval checked, and the intent recorded, in one transaction.

The fast path is one conditional insert (the dialect may fuse it with its
event into one round trip); anything else (the id seen before, the run
missing, paused or fenced, an approval or a lease missing) takes the slow
path in one transaction that locks the run, so its outcome is fixed.

Decided once for both engines: a worker whose lease expired by the ledger's
clock is refused (``LeaseExpired``, nothing recorded), on the fast path and
the slow; a compensation passes under the ``compensate`` grant, which a
cancel keeps (R7, S8), and needs no approval.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from stopline.domain.lifecycle import ApprovalStatus
from stopline.domain.model import CancelState, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Grant, OpEvent, OpStatus, RunState
from stopline.errors import IdempotencyConflict, LeaseExpired
from stopline.ledger import rows
from stopline.ledger.backend import GateResult, GateVerdict
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.dialect import Dialect
from stopline.ledger.engine.fence import settle_pause
from stopline.ledger.engine.guards import FENCED, PAUSE_STATES, RETRYABLE
from stopline.ledger.engine.guards import sql_values as _v
from stopline.ledger.engine.reads import attempt_event, event_statement, load_op, load_run

__all__ = ["GATE_PASSED_WHERE", "gate", "gate_committed", "gate_params", "intent_sql"]

GATE_EVIDENCE = rows.dump_evidence([Evidence.local("gate", "intent recorded before dispatch")])
_RUNNING = _v([RunState.RUNNING])


def _lease_live(dialect: Dialect) -> str:
    """A worker may record an intent only while its lease (if it has one) is live."""
    return (
        "NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = :worker"
        f" AND w.lease_until <= {dialect.now})"
    )


_APPROVED = (
    "EXISTS (SELECT 1 FROM approvals a WHERE a.run_id = runs.id AND a.scope = :id"
    f" AND a.status = {_v([ApprovalStatus.GRANTED])}"
    " AND (a.expires_at IS NULL OR a.expires_at > :now))"
)


def _eligible(dialect: Dialect, compensation: bool) -> str:
    """The run's state and grants; found by its id, never through the state index."""
    state = dialect.unindexed("state")
    if compensation:  # any state but a pause, under the `compensate` grant
        states = _v(frozenset(RunState) - PAUSE_STATES)
        return f"{state} IN ({states}) AND (grants & {int(Grant.COMPENSATE)}) <> 0"
    return f"{state} = {_RUNNING} AND (grants & {int(Grant.INITIATE)}) <> 0"


@functools.cache
def intent_sql(dialect: Dialect, compensation: bool, approved: bool) -> tuple[str, str]:
    """``(where, values)``: which run may take the intent, and the intent's row."""
    where = f"id = :run AND {_eligible(dialect, compensation)} AND {_lease_live(dialect)}"
    if approved:
        where += f" AND {_APPROVED}"
    values = (
        f":id, runs.id, :tool, :description, :digest, {_v([OpStatus.REQUESTED])}, :cancellable,"
        f" :can_verify, :can_compensate, :cancel_none, 1, NULL, 0, NULL, NULL, :evidence,"
        " :now, :now, :compensates, :worker"
    )
    return where, values


def gate_params(spec: OperationSpec, now: float, token: str | None) -> dict[str, Any]:
    return {
        "id": spec.id,
        "run": spec.run_id,
        "tool": spec.tool,
        "description": spec.description,
        "digest": spec.args_digest,
        "cancellable": spec.cancellable.value,
        "can_verify": int(spec.can_verify),
        "can_compensate": int(spec.can_compensate),
        "cancel_none": CancelState.NONE.value,
        "evidence": GATE_EVIDENCE,
        "now": now,
        "compensates": spec.compensates,
        "worker": spec.worker,
        "token": token,
        "passed": OpEvent.GATE_PASSED.value,
        "from": OpStatus.NOT_STARTED.value,
        "to": OpStatus.REQUESTED.value,
    }


async def gate(db: Db, spec: OperationSpec, token: str | None = None) -> GateResult:
    """Check and record the intent; ``token`` marks the attempt (read back after a doubt)."""
    now = time.time()
    params = gate_params(spec, now, token)
    where, values = intent_sql(db.dialect, bool(spec.compensates), _approval_in_sql(spec))
    fence = await db.dialect.record_intent(db, where, values, params)
    if fence is not None:
        return GateResult(GateVerdict.PASSED, fence=fence)
    async with db.transaction():
        return await _slow_path(db, spec, now, params)


def _approval_in_sql(spec: OperationSpec) -> bool:
    return spec.needs_approval and not spec.compensates


# an operation's gate events, found through its run's log (``events_run``): the log has
# no index by operation, and read by ``op_id`` alone it was read whole
GATE_PASSED_WHERE = (
    "run_id = (SELECT run_id FROM operations WHERE id = ?) AND op_id = ? AND kind = ?"
)


async def gate_committed(db: Db, op_id: str, token: str) -> int | None:
    """After a lost reply: did the gate attempt ``token`` commit? Its fence if so."""
    params = (op_id, op_id, OpEvent.GATE_PASSED)
    recorded = await attempt_event(db, GATE_PASSED_WHERE, params, token)
    return None if recorded is None else int(recorded["fence"])


async def _approved(db: Db, params: dict[str, Any]) -> bool:
    """The operation's approval is granted and unexpired (the intent's own condition)."""
    sql = f"SELECT 1 FROM runs WHERE id = :run AND {_APPROVED}"
    return await db.one(sql, {k: params[k] for k in ("run", "id", "now")}) is not None


async def _lease_ok(db: Db, worker: str) -> bool:
    row = await db.one(
        f"SELECT lease_until > {db.dialect.now} FROM workers WHERE id = ?{db.dialect.for_share}",
        (worker,),
    )
    return row is None or bool(row[0])


def _may(run: RunRecord, spec: OperationSpec) -> tuple[bool, bool]:
    """(may initiate, eligible for this spec): a compensation needs ``compensate`` only."""
    may_initiate = run.state is RunState.RUNNING and bool(run.grants & Grant.INITIATE)
    if not spec.compensates:
        return may_initiate, may_initiate
    return may_initiate, run.state not in PAUSE_STATES and bool(run.grants & Grant.COMPENSATE)


async def _slow_path(db: Db, spec: OperationSpec, now: float, params: dict[str, Any]) -> GateResult:
    """The id exists, the run is missing or may not initiate, or the lease expired."""
    run = await load_run(db, spec.run_id, lock=db.dialect.for_update)  # the outcome is fixed
    row = await db.one(f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = ?", (spec.id,))
    may_initiate, eligible = _may(run, spec)
    if row is not None:
        return await _seen_before(db, spec, run, rows.op_from_row(row), may_initiate, params)
    if run.state in PAUSE_STATES:
        await settle_pause(db, run.id)  # a worker waiting at the gate is idle
        return GateResult(GateVerdict.PAUSED, fence=run.fence)
    if eligible:
        if not await _lease_ok(db, spec.worker):
            raise LeaseExpired(spec.worker, db.location)  # fencing: nothing recorded or sent
        # the run (or an approval) changed between the fast path and this lock: pass now
        approval = _approval_in_sql(spec)
        where, values = intent_sql(db.dialect, bool(spec.compensates), approval)
        fence = await db.dialect.record_intent(db, where, values, params)
        if fence is not None:
            return GateResult(GateVerdict.PASSED, fence=fence)
        if approval:
            return GateResult(GateVerdict.NEEDS_APPROVAL, fence=run.fence)
    return GateResult(GateVerdict.PREVENTED, await _prevent(db, spec, run, now), run.fence)


async def _seen_before(
    db: Db,
    spec: OperationSpec,
    run: RunRecord,
    existing: OperationRecord,
    may_initiate: bool,
    params: dict[str, Any],
) -> GateResult:
    if existing.args_digest != spec.args_digest or existing.run_id != spec.run_id:
        raise IdempotencyConflict(spec.id)
    now = params["now"]
    if existing.status in RETRYABLE and may_initiate:
        if not await _lease_ok(db, spec.worker):
            raise LeaseExpired(spec.worker, db.location)
        if _approval_in_sql(spec) and not await _approved(db, params):
            # a retry passes the same check as the first attempt: its approval granted
            return GateResult(GateVerdict.NEEDS_APPROVAL, fence=run.fence)
        # a retry with the same key: the earlier attempt provably did not commit
        target = apply(OPERATION_TABLE, existing.status, OpEvent.GATE_PASSED)
        await db.run(
            "UPDATE operations SET status = ?, attempts = attempts + 1, cancel_state = ?,"
            " updated_at = ?, worker = ? WHERE id = ? AND status = ?",  # this attempt's worker
            (target, CancelState.NONE, now, spec.worker, spec.id, existing.status),
        )
        data: dict[str, Any] = {"fence": run.fence, "retry": True}
        if params["token"] is not None:
            data["attempt"] = params["token"]
        await db.run(
            *event_statement(
                now, spec.run_id, spec.id, OpEvent.GATE_PASSED, existing.status, target, data
            )
        )
        return GateResult(GateVerdict.PASSED, fence=run.fence)
    if existing.status is OpStatus.NOT_COMMITTED and run.state in FENCED:
        # R1: a retry timer or redelivery after the fence; the attempt is refused
        data = {"fence": run.fence, "retry": True, "run_state": run.state.value}
        status = existing.status
        await db.run(
            *event_statement(now, spec.run_id, spec.id, OpEvent.GATE_REFUSED, status, status, data)
        )
        return GateResult(GateVerdict.PREVENTED, existing, run.fence)
    if existing.status in RETRYABLE and run.state in PAUSE_STATES and not spec.compensates:
        # R9: another attempt under a key that provably took no effect waits at a paused
        # run's gate as a first attempt does (above, without its key: ``_slow_path``)
        await settle_pause(db, run.id)
        return GateResult(GateVerdict.PAUSED, fence=run.fence)
    return GateResult(GateVerdict.EXISTING, existing, run.fence)


async def _prevent(db: Db, spec: OperationSpec, run: RunRecord, now: float) -> OperationRecord:
    """Record the refused intent as ``prevented``, with the fence it met."""
    evidence = [Evidence.local(f"fence:{run.fence}", f"run {run.state.value}; initiate revoked")]
    target = apply(OPERATION_TABLE, OpStatus.NOT_STARTED, OpEvent.GATE_REFUSED)
    await db.run(
        f"INSERT INTO operations ({rows.OP_COLUMNS}) VALUES"
        " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL, 0, NULL, NULL, ?, ?, ?, ?, ?)",
        (
            spec.id, spec.run_id, spec.tool, spec.description, spec.args_digest, target,
            spec.cancellable.value, int(spec.can_verify), int(spec.can_compensate),
            CancelState.NONE, rows.dump_evidence(evidence), now, now, spec.compensates,
            spec.worker,
        ),
    )  # fmt: skip
    data = {"fence": run.fence, "run_state": run.state.value}
    await db.run(
        *event_statement(
            now, spec.run_id, spec.id, OpEvent.GATE_REFUSED, OpStatus.NOT_STARTED, target, data
        )
    )
    return await load_op(db, spec.id)
