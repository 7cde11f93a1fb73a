"""SQLite transaction bodies for the lifecycle: subtree fences, pause, approvals, checkpoints.

Each function runs on the writer thread inside one transaction. The subtree
of a cancel is computed and fenced set-wise in that one transaction (R1: no
descendant can slip a dispatch in between two fences), following ownership:
exclusive children are fenced with their owner; a shared child loses the
cancelled owner and is fenced only when its last owner is gone (R6).
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from stopline.domain.lifecycle import ApprovalRecord, ApprovalStatus, CancelResult, Checkpoint
from stopline.domain.model import Evidence, RunRecord
from stopline.domain.transitions import RUN_TABLE, apply
from stopline.domain.vocab import Grant, RunEvent, RunState
from stopline.errors import IllegalTransition, NotFound, NotPermitted
from stopline.ledger import rows
from stopline.ledger.schema import CANCELLABLE_STATES, NOTHING_TO_RESUME, RESOLVED_SQL

__all__ = [
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

_CANCELLABLE_SQL = ", ".join(f"'{state}'" for state in CANCELLABLE_STATES)


def _run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    from stopline.ledger.sqlite import _run as load

    return load(conn, run_id)


def _event(
    conn: sqlite3.Connection,
    at: float,
    run_id: str,
    kind: str,
    frm: str | None,
    to: str | None,
    data: dict[str, Any],
) -> None:
    conn.execute(
        "INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)"
        " VALUES (?, ?, NULL, ?, ?, ?, ?)",
        (at, run_id, kind, frm, to, rows.dump_data(data)),
    )


# -- ownership and the subtree ------------------------------------------------------
def add_owner_txn(conn: sqlite3.Connection, run_id: str, owner_run: str, exclusive: bool) -> None:
    child, owner = _run(conn, run_id), _run(conn, owner_run)
    now = time.time()
    conn.execute(
        "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (run_id, owner_run) DO UPDATE SET released_at = NULL",
        (child.id, owner.id, int(exclusive), now),
    )
    _event(
        conn, now, child.id, "owner_added", None, None, {"owner": owner.id, "exclusive": exclusive}
    )


def _fence_closure(conn: sqlite3.Connection, root: str, now: float) -> tuple[list[str], list[str]]:
    """The runs a cancel of ``root`` fences, and the shared children it lets go."""
    fenced, released = [root], []
    seen = {root}  # membership in O(1): a tree of 10,000 children is a normal case
    frontier = [root]
    while frontier:
        marks = ",".join("?" * len(frontier))
        children = conn.execute(
            f"SELECT run_id, owner_run, exclusive FROM run_owners"
            f" WHERE owner_run IN ({marks}) AND released_at IS NULL",
            frontier,
        ).fetchall()
        frontier = []
        for child, owner, exclusive in children:
            if child in seen:
                continue
            if exclusive:
                seen.add(child)
                fenced.append(child)
                frontier.append(child)
                continue
            conn.execute(
                "UPDATE run_owners SET released_at = ? WHERE run_id = ? AND owner_run = ?",
                (now, child, owner),
            )
            released.append(child)
            remaining = conn.execute(
                "SELECT count(*) FROM run_owners WHERE run_id = ? AND released_at IS NULL",
                (child,),
            ).fetchone()[0]
            if remaining == 0:  # its last owner is gone
                seen.add(child)
                fenced.append(child)
                frontier.append(child)
    return fenced, released


def cancel_txn(conn: sqlite3.Connection, run_id: str, by: str, reason: str) -> CancelResult:
    root = _run(conn, run_id)
    if root.state.value not in CANCELLABLE_STATES:
        return CancelResult(root, False, (), ())  # R7: the first cancel wins
    now = time.time()
    fenced, released = _fence_closure(conn, run_id, now)
    marks = ",".join("?" * len(fenced))
    states = dict(
        conn.execute(
            f"SELECT id, state FROM runs WHERE id IN ({marks}) AND state IN ({_CANCELLABLE_SQL})",
            fenced,
        ).fetchall()
    )
    live = [r for r in fenced if r in states]  # in closure order, root first
    live_marks = ",".join("?" * len(live))
    conn.execute(
        f"UPDATE runs SET state = 'cancelling', fence = fence + 1, grants = grants & ?,"
        f" cancelled_by = ?, cancel_reason = CASE WHEN id = ? THEN ? ELSE ? END,"
        f" cancelled_at = ?, updated_at = ? WHERE id IN ({live_marks})",
        (
            int(~Grant.INITIATE & Grant.all()),
            by,
            run_id,
            reason,
            f"owner {run_id} cancelled" + (f": {reason}" if reason else ""),
            now,
            now,
            *live,
        ),
    )
    data = rows.dump_data({"by": by, "reason": reason, "root": run_id})
    conn.executemany(
        "INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)"
        " VALUES (?, ?, NULL, 'cancel', ?, 'cancelling', ?)",
        [(now, r, states[r], data) for r in live],
    )
    conn.execute(
        f"UPDATE approvals SET status = 'withdrawn', decided_at = ?, decided_by = ?"
        f" WHERE run_id IN ({live_marks}) AND status IN ('pending', 'granted')",
        (now, by, *live),
    )
    for child in released:
        _event(conn, now, child, "owner_released", None, None, {"owner_cancelled": run_id})
    return CancelResult(_run(conn, run_id), True, tuple(live), tuple(released))


def pause_txn(conn: sqlite3.Connection, run_id: str, by: str, reason: str) -> list[str]:
    """running -> pausing for the run and what it owns exclusively; paused at once if idle."""
    root = _run(conn, run_id)
    apply(RUN_TABLE, root.state, RunEvent.PAUSE)
    now = time.time()
    subtree = [run_id]
    frontier = [run_id]
    while frontier:
        marks = ",".join("?" * len(frontier))
        frontier = [
            r[0]
            for r in conn.execute(
                f"SELECT run_id FROM run_owners WHERE owner_run IN ({marks}) AND exclusive = 1"
                " AND released_at IS NULL",
                frontier,
            )
        ]
        subtree.extend(frontier)
    paused = []
    for rid in subtree:
        run = _run(conn, rid)
        if run.state is not RunState.RUNNING:
            continue
        conn.execute("UPDATE runs SET state = 'pausing', updated_at = ? WHERE id = ?", (now, rid))
        _event(conn, now, rid, "pause", "running", "pausing", {"by": by, "reason": reason})
        settle_pause_txn(conn, rid)
        paused.append(rid)
    return paused


def settle_pause_txn(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    """pausing -> paused once nothing of the run is in flight."""
    run = _run(conn, run_id)
    if run.state is not RunState.PAUSING:
        return run
    busy = conn.execute(
        "SELECT count(*) FROM operations WHERE run_id = ? AND status IN ('requested','accepted')",
        (run_id,),
    ).fetchone()[0]
    if busy:
        return run
    now = time.time()
    conn.execute("UPDATE runs SET state = 'paused', updated_at = ? WHERE id = ?", (now, run_id))
    _event(conn, now, run_id, "paused", "pausing", "paused", {})
    return _run(conn, run_id)


def resume_txn(conn: sqlite3.Connection, run_id: str, by: str) -> tuple[RunRecord, list[str]]:
    """paused/pausing/cancelled -> running; R10: only when every operation is resolved."""
    run = _run(conn, run_id)
    if run.state in NOTHING_TO_RESUME:
        return run, []  # running already, or ended on its own: like a second cancel, a no-op
    target = apply(RUN_TABLE, run.state, RunEvent.RESUME)
    now = time.time()
    if run.state is RunState.CANCELLED:
        open_ops = [
            r[0]
            for r in conn.execute(
                f"SELECT id FROM operations WHERE run_id = ? AND status NOT IN ({RESOLVED_SQL})",
                (run_id,),
            )
        ]
        if open_ops:
            raise NotPermitted(
                f"run {run_id!r} cannot resume: operation {open_ops[0]!r} is not resolved "
                "(verify or review it first)"
            )
    expired = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM approvals WHERE run_id = ? AND status = 'granted'"
            " AND expires_at IS NOT NULL AND expires_at <= ?",
            (run_id, now),
        )
    ]
    conn.executemany(
        "UPDATE approvals SET status = 'expired' WHERE id = ?", [(a,) for a in expired]
    )
    conn.execute(
        "UPDATE runs SET state = ?, grants = grants | ?, updated_at = ? WHERE id = ?",
        (target.value, int(Grant.INITIATE), now, run_id),
    )
    _event(
        conn,
        now,
        run_id,
        "resume",
        run.state.value,
        target.value,
        {"by": by, "expired_approvals": expired},
    )
    return _run(conn, run_id), expired


# -- approvals ------------------------------------------------------------------------
def load_approval(conn: sqlite3.Connection, approval_id: str) -> ApprovalRecord:
    row = conn.execute(
        f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE id = ?", (approval_id,)
    ).fetchone()
    if row is None:
        raise NotFound(f"unknown approval id {approval_id!r}")
    return rows.approval_from_row(row)


def request_approval_txn(
    conn: sqlite3.Connection,
    approval_id: str,
    run_id: str,
    scope: str,
    approver: str,
    requested_by: str,
) -> ApprovalRecord:
    run = _run(conn, run_id)
    if run.state is not RunState.RUNNING:
        raise NotPermitted(f"run {run_id!r} is {run.state.value}: no approval can be asked for")
    now = time.time()
    conn.execute(
        f"INSERT INTO approvals ({rows.APPROVAL_COLUMNS}) VALUES"
        " (?, ?, ?, ?, 'pending', NULL, ?, NULL, ?, NULL)",
        (approval_id, run_id, scope, approver, requested_by, now),
    )
    _event(
        conn,
        now,
        run_id,
        "approval_requested",
        None,
        None,
        {"approval": approval_id, "scope": scope, "approver": approver},
    )
    return load_approval(conn, approval_id)


def decide_approval_txn(
    conn: sqlite3.Connection, approval_id: str, granted: bool, by: str, expires_at: float | None
) -> ApprovalRecord:
    approval = load_approval(conn, approval_id)
    if approval.status is not ApprovalStatus.PENDING:
        raise IllegalTransition(
            approval.status, ApprovalStatus.GRANTED if granted else ApprovalStatus.DENIED
        )
    now = time.time()
    status = ApprovalStatus.GRANTED if granted else ApprovalStatus.DENIED
    conn.execute(
        "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, expires_at = ?"
        " WHERE id = ? AND status = 'pending'",
        (status.value, by, now, expires_at, approval_id),
    )
    _event(
        conn,
        now,
        approval.run_id,
        f"approval_{status.value}",
        None,
        None,
        {"approval": approval_id, "by": by, "expires_at": expires_at},
    )
    return load_approval(conn, approval_id)


def approvals_txn(conn: sqlite3.Connection, run_id: str) -> list[ApprovalRecord]:
    _run(conn, run_id)
    return [
        rows.approval_from_row(r)
        for r in conn.execute(
            f"SELECT {rows.APPROVAL_COLUMNS} FROM approvals WHERE run_id = ? ORDER BY created_at",
            (run_id,),
        )
    ]


# -- checkpoints and audit ------------------------------------------------------------
def checkpoint_txn(conn: sqlite3.Connection, run_id: str, name: str, state: Any) -> Checkpoint:
    """R10: a checkpoint is evidenced only when every operation before it is resolved."""
    _run(conn, run_id)
    unresolved = conn.execute(
        f"SELECT id, status FROM operations WHERE run_id = ? AND status NOT IN ({RESOLVED_SQL})"
        " LIMIT 1",
        (run_id,),
    ).fetchone()
    if unresolved is not None:
        raise NotPermitted(
            f"checkpoint {name!r}: operation {unresolved[0]!r} is {unresolved[1]}, not resolved"
        )
    ops = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM operations WHERE run_id = ? ORDER BY rowid", (run_id,)
        )
    ]
    seq = conn.execute(
        "SELECT coalesce(max(seq), 0) + 1 FROM checkpoints WHERE run_id = ?", (run_id,)
    ).fetchone()[0]
    now = time.time()
    evidence = [Evidence.local(f"checkpoint:{seq}", f"{len(ops)} operations resolved")]
    conn.execute(
        "INSERT INTO checkpoints (run_id, seq, name, at, state, evidence) VALUES (?,?,?,?,?,?)",
        (run_id, seq, name, now, json.dumps(state), rows.dump_evidence(evidence)),
    )
    _event(
        conn,
        now,
        run_id,
        "checkpoint",
        None,
        None,
        {"seq": seq, "name": name, "operations": len(ops)},
    )
    return Checkpoint(run_id, seq, name, now, state, tuple(ops))


def last_checkpoint_txn(conn: sqlite3.Connection, run_id: str) -> Checkpoint | None:
    _run(conn, run_id)
    row = conn.execute(
        "SELECT seq, name, at, state FROM checkpoints WHERE run_id = ? ORDER BY seq DESC LIMIT 1",
        (run_id,),
    ).fetchone()
    if row is None:
        return None
    ops = [
        r[0]
        for r in conn.execute(
            "SELECT op_id FROM events WHERE run_id = ? AND kind = 'gate_passed' AND seq <"
            " (SELECT seq FROM events WHERE run_id = ? AND kind = 'checkpoint'"
            "  AND json_extract(data, '$.seq') = ?) ORDER BY seq",
            (run_id, run_id, row[0]),
        )
    ]
    return Checkpoint(run_id, row[0], row[1], row[2], json.loads(row[3]), tuple(ops))


def audit_txn(
    conn: sqlite3.Connection, run_id: str, principal: str, action: str, allowed: bool, detail: str
) -> None:
    _event(
        conn,
        time.time(),
        run_id,
        "audit" if allowed else "denied",
        None,
        None,
        {"principal": principal, "action": action, "allowed": allowed, "detail": detail},
    )
