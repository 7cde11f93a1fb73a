"""Approvals (S5), evidenced checkpoints (R10) and the audit trail."""

from __future__ import annotations

import time
from typing import Any

from stopline.domain.lifecycle import ApprovalRecord, ApprovalStatus, Checkpoint
from stopline.domain.model import Evidence
from stopline.domain.vocab import LogKind, RunState
from stopline.errors import IllegalTransition, NotPermitted
from stopline.ledger import rows
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.reads import (
    attempt,
    event_statement,
    first_unsettled,
    load_approval,
    load_run,
)

__all__ = ["audit", "audit_kind", "checkpoint", "decide_approval", "request_approval"]

_DECIDED = {True: ApprovalStatus.GRANTED, False: ApprovalStatus.DENIED}
_LOGGED = {
    ApprovalStatus.GRANTED: LogKind.APPROVAL_GRANTED,
    ApprovalStatus.DENIED: LogKind.APPROVAL_DENIED,
}


async def request_approval(
    db: Db, approval_id: str, run_id: str, scope: str, approver: str, requested_by: str
) -> ApprovalRecord:
    async with db.transaction():
        run = await load_run(db, run_id, lock=db.dialect.for_share)
        if run.state is not RunState.RUNNING:
            raise NotPermitted(f"run {run_id!r} is {run.state.value}: no approval can be asked for")
        now = time.time()
        await db.run(
            f"INSERT INTO approvals ({rows.APPROVAL_COLUMNS}) VALUES"
            " (?, ?, ?, ?, ?, NULL, ?, NULL, ?, NULL)",
            (approval_id, run_id, scope, approver, ApprovalStatus.PENDING, requested_by, now),
        )
        data = {"approval": approval_id, "scope": scope, "approver": approver}
        await db.run(
            *event_statement(now, run_id, None, LogKind.APPROVAL_REQUESTED, None, None, data)
        )
        return await load_approval(db, approval_id)


async def decide_approval(
    db: Db, approval_id: str, granted: bool, by: str, expires_at: float | None
) -> ApprovalRecord:
    async with db.transaction():
        approval = await load_approval(db, approval_id, lock=db.dialect.for_update)
        status = _DECIDED[granted]
        if approval.status is not ApprovalStatus.PENDING:
            raise IllegalTransition(approval.status, status)
        now = time.time()
        await db.run(
            "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, expires_at = ?"
            " WHERE id = ? AND status = ?",
            (status, by, now, expires_at, approval_id, ApprovalStatus.PENDING),
        )
        data = {"approval": approval_id, "by": by, "expires_at": expires_at}
        await db.run(
            *event_statement(now, approval.run_id, None, _LOGGED[status], None, None, data)
        )
        return await load_approval(db, approval_id)


async def checkpoint(db: Db, run_id: str, name: str, state: Any, text: str) -> Checkpoint:
    """R10: a checkpoint is evidenced only when every operation before it is settled;
    ``text``: ``state`` as ``rows.dump_state`` writes it."""
    async with db.transaction():
        await load_run(db, run_id, lock=db.dialect.for_update)  # one checkpoint sequence per run
        unsettled = await first_unsettled(db, [run_id])
        if unsettled is not None:
            raise NotPermitted(
                f"checkpoint {name!r}: operation {unsettled[0]!r} is {unsettled[1]}, not resolved"
            )
        sql = "SELECT id FROM operations WHERE run_id = ? ORDER BY created_at, id"
        ops = [r[0] for r in await db.all(sql, (run_id,))]
        sql = "SELECT coalesce(max(seq), 0) + 1 FROM checkpoints WHERE run_id = ?"
        seq = (await db.one(sql, (run_id,)))[0]
        now = time.time()
        evidence = [Evidence.local(f"checkpoint:{seq}", f"{len(ops)} operations resolved")]
        await db.run(
            "INSERT INTO checkpoints (run_id, seq, name, at, state, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (run_id, seq, name, now, text, rows.dump_evidence(evidence)),
        )
        data = {"seq": seq, "name": name, "operations": len(ops)}
        await db.run(*event_statement(now, run_id, None, LogKind.CHECKPOINT, None, None, data))
        return Checkpoint(run_id, seq, name, now, state, tuple(ops))


async def audit(
    db: Db,
    run_id: str,
    principal: str,
    action: str,
    allowed: bool,
    detail: str,
    token: str | None = None,
) -> None:
    """One audit event; ``token`` marks the attempt (read back after a lost reply)."""
    data = {"principal": principal, "action": action, "allowed": allowed, "detail": detail}
    data = attempt(data, token)
    sql, params = event_statement(time.time(), run_id, None, audit_kind(allowed), None, None, data)
    await db.commit_one(f"{sql} RETURNING seq", params)  # its commit in doubt while it runs


def audit_kind(allowed: bool) -> LogKind:
    """The kind of an audit event: an action allowed, or one denied."""
    return LogKind.AUDIT if allowed else LogKind.DENIED
