"""PostgreSQL transaction bodies for the lifecycle: subtree fences, pause, approvals, checkpoints.

The same semantics as ``sqlite_lifecycle``, with PostgreSQL's row locks doing
what SQLite's single writer does: a cancel locks every run of its closure
``FOR UPDATE`` before it reads that run's children, so a child created (or a
gate passed) concurrently either lands before the fence and is fenced with
it, or waits and sees the fence. The cancel's ``NOTIFY`` (the fenced run ids)
is sent by the server at commit, never for a cancel that rolled back.
"""

from __future__ import annotations

import json
import time
from typing import Any

from stopline.domain.lifecycle import ApprovalRecord, ApprovalStatus, CancelResult, Checkpoint
from stopline.domain.model import Evidence, RunRecord
from stopline.domain.transitions import RUN_TABLE, apply
from stopline.domain.vocab import Grant, RunEvent, RunState
from stopline.errors import IllegalTransition, NotFound, NotPermitted
from stopline.ledger import rows
from stopline.ledger.postgres_txn import Tx, event, load_run
from stopline.ledger.schema import CANCELLABLE_STATES, NOTHING_TO_RESUME, RESOLVED_SQL

__all__ = [
    "NOTIFY_CHUNK",
    "add_owner_txn",
    "approvals_txn",
    "audit_txn",
    "cancel_txn",
    "checkpoint_txn",
    "decide_approval_txn",
    "last_checkpoint_txn",
    "load_approval",
    "pause_txn",
    "request_approval_txn",
    "resume_txn",
    "settle_pause_txn",
]

NOTIFY_CHUNK = 100  # run ids per notification: well under the 8000-byte payload limit


# -- ownership and the subtree ------------------------------------------------------
async def add_owner_txn(tx: Tx, run_id: str, owner_run: str, exclusive: bool) -> None:
    owner = await load_run(tx, owner_run, lock="FOR SHARE")
    child = await load_run(tx, run_id, lock="FOR SHARE")
    now = time.time()
    await tx.run(
        "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at) VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (run_id, owner_run) DO UPDATE SET released_at = NULL",
        (child.id, owner.id, int(exclusive), now),
    )
    data = {"owner": owner.id, "exclusive": exclusive}
    await event(tx, now, child.id, None, "owner_added", None, None, data)


async def _fence_closure(tx: Tx, root: str, now: float) -> tuple[list[str], list[str]]:
    """The runs a cancel of ``root`` fences, and the shared children it lets go.

    The root is locked by the caller; each further level is locked ``FOR UPDATE``
    in the same statement that reads its children, so a child being created
    under it waits for this cancel and is born fenced.
    """
    fenced, released = [root], []
    seen = {root}
    frontier = [root]
    first = True
    while frontier:
        children = await tx.all(
            "SELECT run_id, owner_run, exclusive FROM run_owners"
            " WHERE owner_run = ANY(%s) AND released_at IS NULL ORDER BY created_at, run_id"
            if first
            else "WITH locked AS (SELECT id FROM runs WHERE id = ANY(%s) ORDER BY id FOR UPDATE)"
            " SELECT run_id, owner_run, exclusive FROM run_owners"
            " WHERE owner_run IN (SELECT id FROM locked) AND released_at IS NULL"
            " ORDER BY created_at, run_id",
            (frontier,),
        )
        first = False
        frontier = []
        for child, owner, exclusive in children:
            if child in seen:
                continue
            if exclusive:
                seen.add(child)
                fenced.append(child)
                frontier.append(child)
                continue
            remaining = await tx.one(
                "WITH rel AS (UPDATE run_owners SET released_at = %s"
                " WHERE run_id = %s AND owner_run = %s)"
                " SELECT count(*) FROM run_owners WHERE run_id = %s AND released_at IS NULL"
                " AND owner_run <> %s",
                (now, child, owner, child, owner),
            )
            released.append(child)
            if remaining[0] == 0:  # its last owner is gone
                seen.add(child)
                fenced.append(child)
                frontier.append(child)
    return fenced, released


_RUN_COLUMNS_OF_R = ", ".join(f"r.{c.strip()}" for c in rows.RUN_COLUMNS.split(","))
# One statement fences every live run of the closure, logs one cancel event each
# (in closure order), withdraws their approvals and notifies listeners at commit.
_FENCE_SQL = f"""
WITH old AS (
    SELECT id, state FROM runs WHERE id = ANY(%(ids)s) AND state = ANY(%(cancellable)s)
    ORDER BY id FOR UPDATE
),
upd AS (
    UPDATE runs r SET state = 'cancelling', fence = r.fence + 1, grants = r.grants & %(grants)s,
        cancelled_by = %(by)s,
        cancel_reason = CASE WHEN r.id = %(root)s THEN %(reason)s ELSE %(owner_reason)s END,
        cancelled_at = %(now)s, updated_at = %(now)s
    FROM old WHERE r.id = old.id
    RETURNING old.state AS from_state, {_RUN_COLUMNS_OF_R}
),
ev AS (
    INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
    SELECT %(now)s, upd.id, NULL, 'cancel', upd.from_state, 'cancelling', %(data)s
    FROM upd ORDER BY array_position(%(ids)s, upd.id)
),
ap AS (
    UPDATE approvals SET status = 'withdrawn', decided_at = %(now)s, decided_by = %(by)s
    WHERE run_id IN (SELECT id FROM upd) AND status IN ('pending', 'granted')
),
nt AS (
    SELECT pg_notify(%(channel)s, (SELECT json_agg(id ORDER BY array_position(%(ids)s, id))::text
        FROM upd)) AS sent
    WHERE %(channel)s::text IS NOT NULL
)
SELECT upd.*, (SELECT count(*) FROM nt) FROM upd ORDER BY array_position(%(ids)s, upd.id)
"""


async def cancel_txn(
    tx: Tx, run_id: str, by: str, reason: str, channel: str | None
) -> CancelResult:
    root = await load_run(tx, run_id, lock="FOR UPDATE")
    if root.state.value not in CANCELLABLE_STATES:
        return CancelResult(root, False, (), ())  # R7: the first cancel wins
    now = time.time()
    fenced, released = await _fence_closure(tx, run_id, now)
    small = len(fenced) <= NOTIFY_CHUNK
    updated = await tx.all(
        _FENCE_SQL,
        {
            "ids": fenced,
            "cancellable": list(CANCELLABLE_STATES),
            "grants": int(~Grant.INITIATE & Grant.all()),
            "by": by,
            "root": run_id,
            "reason": reason,
            "owner_reason": f"owner {run_id} cancelled" + (f": {reason}" if reason else ""),
            "now": now,
            "data": rows.dump_data({"by": by, "reason": reason, "root": run_id}),
            "channel": channel if small else None,
        },
    )
    live = [row[1] for row in updated]  # in closure order, root first
    for child in released:
        await event(tx, now, child, None, "owner_released", None, None, {"owner_cancelled": run_id})
    if channel is not None and not small:  # delivered by the server at commit
        for i in range(0, len(live), NOTIFY_CHUNK):
            payload = json.dumps(live[i : i + NOTIFY_CHUNK], separators=(",", ":"))
            await tx.run("SELECT pg_notify(%s, %s)", (channel, payload))
    run = rows.run_from_row(updated[0][1:-1])
    return CancelResult(run, True, tuple(live), tuple(released))


async def pause_txn(tx: Tx, run_id: str, by: str, reason: str) -> list[str]:
    """running -> pausing for the run and what it owns exclusively; paused at once if idle."""
    root = await load_run(tx, run_id, lock="FOR UPDATE")
    apply(RUN_TABLE, root.state, RunEvent.PAUSE)
    now = time.time()
    subtree = [run_id]
    frontier = [run_id]
    while frontier:
        await tx.run("SELECT 1 FROM runs WHERE id = ANY(%s) FOR UPDATE", (frontier,))
        frontier = [
            r[0]
            for r in await tx.all(
                "SELECT run_id FROM run_owners WHERE owner_run = ANY(%s) AND exclusive = 1"
                " AND released_at IS NULL ORDER BY created_at, run_id",
                (frontier,),
            )
        ]
        subtree.extend(frontier)
    paused = []
    for rid in subtree:
        run = await load_run(tx, rid)
        if run.state is not RunState.RUNNING:
            continue
        await tx.run("UPDATE runs SET state = 'pausing', updated_at = %s WHERE id = %s", (now, rid))
        data = {"by": by, "reason": reason}
        await event(tx, now, rid, None, "pause", "running", "pausing", data)
        await settle_pause_txn(tx, rid)
        paused.append(rid)
    return paused


async def settle_pause_txn(tx: Tx, run_id: str) -> RunRecord:
    """pausing -> paused once nothing of the run is in flight."""
    run = await load_run(tx, run_id, lock="FOR UPDATE")
    if run.state is not RunState.PAUSING:
        return run
    busy = await tx.one(
        "SELECT count(*) FROM operations WHERE run_id = %s AND status IN ('requested','accepted')",
        (run_id,),
    )
    if busy[0]:
        return run
    now = time.time()
    await tx.run("UPDATE runs SET state = 'paused', updated_at = %s WHERE id = %s", (now, run_id))
    await event(tx, now, run_id, None, "paused", "pausing", "paused", {})
    return await load_run(tx, run_id)


async def resume_txn(tx: Tx, run_id: str, by: str) -> tuple[RunRecord, list[str]]:
    """paused/pausing/cancelled -> running; R10: only when every operation is resolved."""
    run = await load_run(tx, run_id, lock="FOR UPDATE")
    if run.state in NOTHING_TO_RESUME:
        return run, []  # running already, or ended on its own: like a second cancel, a no-op
    target = apply(RUN_TABLE, run.state, RunEvent.RESUME)
    now = time.time()
    if run.state is RunState.CANCELLED:
        open_op = await tx.one(
            f"SELECT id FROM operations WHERE run_id = %s AND status NOT IN ({RESOLVED_SQL})"
            " ORDER BY created_at LIMIT 1",
            (run_id,),
        )
        if open_op is not None:
            raise NotPermitted(
                f"run {run_id!r} cannot resume: operation {open_op[0]!r} is not resolved "
                "(verify or review it first)"
            )
    expired = [
        r[0]
        for r in await tx.all(
            "UPDATE approvals SET status = 'expired' WHERE run_id = %s AND status = 'granted'"
            " AND expires_at IS NOT NULL AND expires_at <= %s RETURNING id",
            (run_id, now),
        )
    ]
    await tx.run(
        "UPDATE runs SET state = %s, grants = grants | %s, updated_at = %s WHERE id = %s",
        (target.value, int(Grant.INITIATE), now, run_id),
    )
    data = {"by": by, "expired_approvals": expired}
    await event(tx, now, run_id, None, "resume", run.state.value, target.value, data)
    return await load_run(tx, run_id), expired


# -- approvals ------------------------------------------------------------------------
async def load_approval(tx: Tx, approval_id: str, *, lock: str = "") -> ApprovalRecord:
    row = await tx.one(
        f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE id = %s {lock}", (approval_id,)
    )
    if row is None:
        raise NotFound(f"unknown approval id {approval_id!r}")
    return rows.approval_from_row(row)


async def request_approval_txn(
    tx: Tx, approval_id: str, run_id: str, scope: str, approver: str, requested_by: str
) -> ApprovalRecord:
    run = await load_run(tx, run_id, lock="FOR SHARE")
    if run.state is not RunState.RUNNING:
        raise NotPermitted(f"run {run_id!r} is {run.state.value}: no approval can be asked for")
    now = time.time()
    await tx.run(
        f"INSERT INTO approvals ({rows.APPROVAL_COLUMNS}) VALUES"
        " (%s, %s, %s, %s, 'pending', NULL, %s, NULL, %s, NULL)",
        (approval_id, run_id, scope, approver, requested_by, now),
    )
    data = {"approval": approval_id, "scope": scope, "approver": approver}
    await event(tx, now, run_id, None, "approval_requested", None, None, data)
    return await load_approval(tx, approval_id)


async def decide_approval_txn(
    tx: Tx, approval_id: str, granted: bool, by: str, expires_at: float | None
) -> ApprovalRecord:
    approval = await load_approval(tx, approval_id, lock="FOR UPDATE")
    status = ApprovalStatus.GRANTED if granted else ApprovalStatus.DENIED
    if approval.status is not ApprovalStatus.PENDING:
        raise IllegalTransition(approval.status, status)
    now = time.time()
    await tx.run(
        "UPDATE approvals SET status = %s, decided_by = %s, decided_at = %s, expires_at = %s"
        " WHERE id = %s AND status = 'pending'",
        (status.value, by, now, expires_at, approval_id),
    )
    data = {"approval": approval_id, "by": by, "expires_at": expires_at}
    await event(tx, now, approval.run_id, None, f"approval_{status.value}", None, None, data)
    return await load_approval(tx, approval_id)


async def approvals_txn(tx: Tx, run_id: str) -> list[ApprovalRecord]:
    await load_run(tx, run_id)
    return [
        rows.approval_from_row(r)
        for r in await tx.all(
            f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE run_id = %s"
            " ORDER BY created_at, id",
            (run_id,),
        )
    ]


# -- checkpoints and audit ------------------------------------------------------------
async def checkpoint_txn(tx: Tx, run_id: str, name: str, state: Any) -> Checkpoint:
    """R10: a checkpoint is evidenced only when every operation before it is resolved."""
    await load_run(tx, run_id, lock="FOR UPDATE")  # one checkpoint sequence per run
    unresolved = await tx.one(
        f"SELECT id, status FROM operations WHERE run_id = %s AND status NOT IN ({RESOLVED_SQL})"
        " ORDER BY created_at LIMIT 1",
        (run_id,),
    )
    if unresolved is not None:
        raise NotPermitted(
            f"checkpoint {name!r}: operation {unresolved[0]!r} is {unresolved[1]}, not resolved"
        )
    ops = [
        r[0]
        for r in await tx.all(
            "SELECT id FROM operations WHERE run_id = %s ORDER BY created_at, id", (run_id,)
        )
    ]
    seq = (
        await tx.one(
            "SELECT coalesce(max(seq), 0) + 1 FROM checkpoints WHERE run_id = %s", (run_id,)
        )
    )[0]
    now = time.time()
    evidence = [Evidence.local(f"checkpoint:{seq}", f"{len(ops)} operations resolved")]
    await tx.run(
        "INSERT INTO checkpoints (run_id, seq, name, at, state, evidence)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        (run_id, seq, name, now, json.dumps(state), rows.dump_evidence(evidence)),
    )
    data = {"seq": seq, "name": name, "operations": len(ops)}
    await event(tx, now, run_id, None, "checkpoint", None, None, data)
    return Checkpoint(run_id, seq, name, now, state, tuple(ops))


async def last_checkpoint_txn(tx: Tx, run_id: str) -> Checkpoint | None:
    await load_run(tx, run_id)
    row = await tx.one(
        "SELECT seq, name, at, state FROM checkpoints WHERE run_id = %s ORDER BY seq DESC LIMIT 1",
        (run_id,),
    )
    if row is None:
        return None
    ops = [
        r[0]
        for r in await tx.all(
            "SELECT op_id FROM events WHERE run_id = %s AND kind = 'gate_passed' AND seq <"
            " (SELECT seq FROM events WHERE run_id = %s AND kind = 'checkpoint'"
            "  AND (data::jsonb ->> 'seq')::int = %s) ORDER BY seq",
            (run_id, run_id, row[0]),
        )
    ]
    return Checkpoint(run_id, row[0], row[1], row[2], json.loads(row[3]), tuple(ops))


async def audit_txn(
    tx: Tx, run_id: str, principal: str, action: str, allowed: bool, detail: str
) -> None:
    data = {"principal": principal, "action": action, "allowed": allowed, "detail": detail}
    kind = "audit" if allowed else "denied"
    await event(tx, time.time(), run_id, None, kind, None, None, data)
