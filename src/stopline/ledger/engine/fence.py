"""The subtree fence (cancel, R1, R6, R7), pause and resume (a share's link: ``owners``).

A cancel computes its closure and fences it set-wise in one transaction, so
no descendant can slip a dispatch in between two fences: exclusive children
are fenced with their owner; a shared child loses the cancelled owner and is
fenced only when its last owner is gone. Each level of the closure is locked
(``FOR UPDATE`` where the engine has row locks; SQLite's one writer is the
lock) before its children are read, so a child being created concurrently
either lands before the fence and is fenced with it, or waits and sees it.
"""

from __future__ import annotations

import functools
import time

from stopline.domain.lifecycle import ApprovalStatus, CancelResult
from stopline.domain.limits import sanitise
from stopline.domain.model import RunRecord
from stopline.domain.transitions import RUN_TABLE, apply
from stopline.domain.vocab import Grant, LogKind, RunEvent, RunState
from stopline.errors import NotPermitted, RunEnded
from stopline.ledger import rows
from stopline.ledger.engine.db import Db, Params
from stopline.ledger.engine.dialect import Dialect
from stopline.ledger.engine.guards import (
    CANCELLABLE,
    IN_FLIGHT,
    NOTHING_TO_RESUME,
    PAUSE_STATES,
    sql_values,
)
from stopline.ledger.engine.reads import (
    event_statement,
    first_unsettled,
    found_run,
    load_run,
    run_query,
)

__all__ = ["cancel", "pause", "resume", "settle_pause"]

_CANCELLING = apply(RUN_TABLE, RunState.RUNNING, RunEvent.CANCEL)
_LIVE_APPROVALS = sql_values({ApprovalStatus.PENDING, ApprovalStatus.GRANTED})
_CANCELLABLE = sql_values(CANCELLABLE)
_GRANTS_LEFT = int(~Grant.INITIATE & Grant.all())  # a fenced run initiates nothing more


def _links(dialect: Dialect, parents: list[str], *, exclusive_only: bool) -> tuple[str, Params]:
    """The statement reading the live ownership links under ``parents``."""
    owners, params = dialect.in_list("owner_run", parents)
    only = " AND exclusive = 1" if exclusive_only else ""
    return (
        f"SELECT run_id, owner_run, exclusive FROM run_owners WHERE {owners}{only}"
        " AND released_at IS NULL ORDER BY created_at, run_id",
        params,
    )


async def _children(
    db: Db, parents: list[str], *, exclusive_only: bool
) -> list[tuple[str, str, int]]:
    """The live ownership links under ``parents``, each parent row locked first (the lock
    and the read in one round trip)."""
    dialect = db.dialect
    links = _links(dialect, parents, exclusive_only=exclusive_only)
    if not dialect.for_update:
        return await db.all(*links)
    locked, params = dialect.in_list("id", parents)
    lock = (f"SELECT id FROM runs WHERE {locked} ORDER BY id{dialect.for_update}", params)
    return (await db.batch([lock, links]))[1]


async def _closure(
    db: Db, root: str, now: float, links: list[tuple[str, str, int]]
) -> tuple[list[str], list[str]]:
    """What a cancel of ``root`` fences, and the shared runs it lets go (``links``: its own)."""
    fenced, released, seen = [root], [], {root}  # seen: O(1) (10,000 children is normal)
    children, lock = links, db.dialect.for_update
    while children:
        frontier = []
        for child, owner, exclusive in children:
            if child in seen:
                continue
            if not exclusive:
                state, live = await db.one(  # its live links: this one and its others'
                    "SELECT state, (SELECT count(*) - count(released_at) FROM run_owners"
                    f" WHERE run_id = runs.id) FROM runs WHERE id = ?{lock}",
                    (child,),
                )  # its last owner's cancel that stops it keeps it, exclusive (ADR 0065)
                kept, others = live == 1 and RunState(state) in CANCELLABLE, live > 1
                await db.run(
                    "UPDATE run_owners SET exclusive = ?, released_at = ?"
                    " WHERE run_id = ? AND owner_run = ?",
                    (int(kept), None if kept else now, child, owner),
                )
                released += [] if kept else [child]
                if others:
                    continue  # another owner still holds it
            seen.add(child)
            fenced.append(child)
            frontier.append(child)
        children = await _children(db, frontier, exclusive_only=False) if frontier else []
    return fenced, released


def _fence(
    dialect: Dialect,
    runs: list[str],
    root: str,
    by: str,
    reason: str,
    now: float,
    *,
    lone: bool = False,
) -> list[tuple[str, Params]]:
    """The writes fencing those of ``runs`` still cancellable: their live approvals
    withdrawn, their cancel events, the runs fenced (returning their ids; ``lone``:
    the run's row).

    Set-based, whatever the tree's size (a tree of 10,000 is normal): no per-run
    statement or parameter row. Each picks its rows before the runs change (the
    approvals and the events first), so the three agree and none needs another's
    result: one ``Db.batch``, and one statement where the engine can fuse them
    (``Dialect.fused``: PostgreSQL's, which then land whole or not at all). Every
    run written is locked already, by a statement before these: their snapshot is
    taken after the lock, so they see every link made before it.

    ``lone``: only a run that owns no live run (its links cannot change while it is
    locked: a link is made or released only under its owner's lock), with its
    notification first (the dialect's, sent at commit) and the run returned as
    fenced: the whole cancel of a run with no children, which needs nothing read
    before it can commit."""
    params = dialect.in_list("id", runs)[1]
    cancellable, withdraw, log, fence = _fence_sql(dialect, len(runs), lone)
    data = rows.dump_data({"by": by, "reason": reason, "root": root})
    owned = f"owner {root} cancelled" + (f": {reason}" if reason else "")
    writes = [
        (withdraw, (ApprovalStatus.WITHDRAWN, now, by, *params)),
        (log, (now, RunEvent.CANCEL, _CANCELLING, data, *params)),
        (fence, (_CANCELLING, _GRANTS_LEFT, by, root, reason, owned, now, now, *params)),
    ]
    notify = dialect.notify_fenced(root, cancellable, params) if lone else []
    return [*notify, *dialect.fused(writes)]


@functools.lru_cache(maxsize=16)  # by the count of runs: SQLite's text has a ? each up to 64
def _fence_sql(dialect: Dialect, runs: int, lone: bool) -> tuple[str, str, str, str]:
    """``_fence``'s SQL for ``runs`` runs, each statement taking their ids as the
    dialect's ``in_list`` passes them: which of them are cancellable, and the three
    writes, in ``_fence``'s order. The same text for every cancel of as many runs (a
    lone run's above all): made once.

    The approvals are found by their runs' ids, and only a live one found has its
    run's state read: most runs have none, and reading every run of a tree for them
    first (a subquery of the cancellable runs) took 14-23 ms of a 10,000-run fence's
    90-140, against 6-9 ms this way (SQLite, replayed)."""
    placeholders = [None] * runs
    ids = dialect.in_list("id", placeholders)[0]
    of_runs = dialect.in_list("run_id", placeholders)[0]
    still = f"{dialect.unindexed('state')} IN ({_CANCELLABLE})"
    if lone:
        still += (
            " AND NOT EXISTS (SELECT 1 FROM run_owners"
            " WHERE owner_run = runs.id AND released_at IS NULL)"
        )
    cancellable = f"{ids} AND {still}"
    text = dialect.text
    withdraw = (
        "UPDATE approvals SET status = ?, decided_at = ?, decided_by = ?"
        f" WHERE {of_runs} AND status IN ({_LIVE_APPROVALS})"
        f" AND EXISTS (SELECT 1 FROM runs WHERE runs.id = approvals.run_id AND {still})"
    )
    log = (
        f"{rows.EVENT_INTO} SELECT ?, id, NULL, {text('?')}, state, {text('?')}, {text('?')}"
        f" FROM runs WHERE {cancellable}"
    )
    fence = (
        "UPDATE runs SET state = ?, fence = fence + 1, grants = grants & ?,"
        " cancelled_by = ?, cancel_reason = CASE WHEN id = ? THEN ? ELSE ? END,"
        f" cancelled_at = ?, updated_at = ? WHERE {cancellable}"
        f" RETURNING {rows.RUN_COLUMNS if lone else 'id'}"
    )
    return cancellable, withdraw, log, fence


async def cancel(db: Db, run_id: str, by: str, reason: str) -> CancelResult:
    """Fence the run and every run it owns exclusively, in one transaction (R1, R6).

    A run that owns no live run is fenced in the round trip that locks it and
    commits: its lock, its notification and its fence (matching nothing unless it
    is cancellable and owns no live run, and returning it as fenced) go as one
    batch with the ``COMMIT``. So a run with no children costs one round trip on
    PostgreSQL. A run found cancellable with children is a tree: its cancel runs
    again as ``_tree``, which reads the closure level by level, one transaction."""
    reason = sanitise(reason)  # a reason that cannot be stored never stands before the fence
    dialect = db.dialect
    now = time.time()
    results = await db.whole(
        [
            run_query(run_id, dialect.for_update),
            *_fence(dialect, [run_id], run_id, by, reason, now, lone=True),
        ]
    )
    if results[-1]:  # fenced: it owned no live run
        return CancelResult(found_run(results[-1], run_id), True, (run_id,), ())
    root = found_run(results[0], run_id)
    if root.state not in CANCELLABLE:
        return CancelResult(root, False, (), ())  # R7: the first cancel wins
    return await _tree(db, run_id, by, reason)


async def _tree(db: Db, run_id: str, by: str, reason: str) -> CancelResult:
    """A cancel of a run that owns others: the root's lock, links, fence and read-back
    in one round trip, each further level of the closure locked and read in one, the
    rest of the fence in one more, then the commit with the notifications."""
    dialect = db.dialect
    async with db.transaction():
        now = time.time()
        found, links, *_, root_fenced, after = await db.batch(
            [
                run_query(run_id, dialect.for_update),
                _links(dialect, [run_id], exclusive_only=False),
                *_fence(dialect, [run_id], run_id, by, reason, now),
                run_query(run_id),
            ]
        )
        root = found_run(found, run_id)
        if root.state not in CANCELLABLE:
            return CancelResult(root, False, (), ())  # R7: the first cancel wins
        live = [r for (r,) in root_fenced]  # the root: cancellable, so fenced above
        fenced, released = await _closure(db, run_id, now, links)
        if len(fenced) > 1:
            rest = (await db.batch(_fence(dialect, fenced[1:], run_id, by, reason, now)))[-1]
            fenced_now = {r for (r,) in rest}
            live += [r for r in fenced[1:] if r in fenced_now]  # in closure order
        for child in released:
            data_released = {"owner_cancelled": run_id}
            await db.run(
                *event_statement(
                    now, child, None, LogKind.OWNER_RELEASED, None, None, data_released
                )
            )
        await dialect.notify_cancel(db, live)  # sent at commit, never for a rollback
        return CancelResult(found_run(after, run_id), True, tuple(live), tuple(released))


async def pause(db: Db, run_id: str, by: str, reason: str) -> list[str]:
    """running -> pausing for the run and what it owns exclusively; paused at once if idle.

    Set-based, as a cancel's fence: the closure read level by level (each level locked
    before its children are read), then the tree's rows locked, its events and its
    state change in one batch, whatever its size (per run, a 10,000-run tree took
    0.6 s on SQLite, and on PostgreSQL a round trip per statement: 1.3 s at 1,000)."""
    reason = sanitise(reason)
    async with db.transaction():
        root = await load_run(db, run_id, lock=db.dialect.for_update)
        if root.state in PAUSE_STATES:  # idempotent, as a cancel is: a retry finds it done
            return []
        if (root.state, RunEvent.PAUSE) not in RUN_TABLE:  # ended, or stopped by a cancel
            raise RunEnded(run_id, root.state, "nothing runs in it to pause")
        subtree, frontier = [run_id], [run_id]
        while frontier:
            frontier = [r[0] for r in await _children(db, frontier, exclusive_only=True)]
            subtree.extend(frontier)
        changed = {r for (r,) in (await db.batch(_pause(db.dialect, subtree, by, reason)))[-1]}
        return [rid for rid in subtree if rid in changed]  # in the closure's order


_PAUSING = apply(RUN_TABLE, RunState.RUNNING, RunEvent.PAUSE)
_PAUSED = apply(RUN_TABLE, _PAUSING, RunEvent.PAUSED)


def _pause(dialect: Dialect, runs: list[str], by: str, reason: str) -> list[tuple[str, Params]]:
    """The statements pausing those of ``runs`` running: their rows locked (a gate of
    theirs takes its run's row: it lands before, or waits and sees the pause), each
    one's ``pause`` event, then ``paused`` for each with nothing in flight, and the
    runs moved (pausing, or paused if idle), returning their ids. Events first, each
    statement of its own: a run's two events keep their order."""
    ids, params = dialect.in_list("id", runs)
    running = f"{ids} AND {dialect.unindexed('state')} = ?"
    idle = (
        "NOT EXISTS (SELECT 1 FROM operations AS o WHERE o.run_id = runs.id"
        f" AND o.status IN ({sql_values(IN_FLIGHT)}))"
    )
    now, text, data = time.time(), dialect.text, rows.dump_data({"by": by, "reason": reason})
    texts = ", ".join([text("?")] * 4)  # the kind, the states from and to, the data
    log = f"{rows.EVENT_INTO} SELECT ?, id, NULL, {texts}"
    return [
        (f"SELECT id FROM runs WHERE {ids} ORDER BY id{dialect.for_update}", params),
        (
            f"{log} FROM runs WHERE {running}",
            (now, RunEvent.PAUSE, RunState.RUNNING, _PAUSING, data, *params, RunState.RUNNING),
        ),
        (
            f"{log} FROM runs WHERE {running} AND {idle}",
            (now, RunEvent.PAUSED, _PAUSING, _PAUSED, "{}", *params, RunState.RUNNING),
        ),
        (
            f"UPDATE runs SET state = CASE WHEN {idle} THEN ? ELSE ? END, updated_at = ?"
            f" WHERE {running} RETURNING id",
            (_PAUSED, _PAUSING, now, *params, RunState.RUNNING),
        ),
    ]


async def settle_pause(db: Db, run_id: str) -> RunRecord:
    """pausing -> paused once nothing of the run is in flight."""
    async with db.transaction():
        run = await load_run(db, run_id, lock=db.dialect.for_update)
        if run.state is not RunState.PAUSING:
            return run
        busy = await db.one(
            "SELECT count(*) FROM operations WHERE run_id = ?"
            f" AND status IN ({sql_values(IN_FLIGHT)})",
            (run_id,),
        )
        if busy[0]:
            return run
        now = time.time()
        target = apply(RUN_TABLE, run.state, RunEvent.PAUSED)
        await db.run(
            "UPDATE runs SET state = ?, updated_at = ? WHERE id = ?", (target, now, run_id)
        )
        await db.run(*event_statement(now, run_id, None, RunEvent.PAUSED, run.state, target, {}))
        return await load_run(db, run_id)


# the states a resume moves (the run table's): the rest of a tree must be there or done
RESUMABLE = frozenset(state for state, event in RUN_TABLE if event is RunEvent.RESUME)
# where each goes (one state: the runs of a tree move in one statement)
(_RESUMED,) = {apply(RUN_TABLE, state, RunEvent.RESUME) for state in RESUMABLE}


async def resume(db: Db, run_id: str, by: str) -> tuple[RunRecord, list[str]]:
    """paused/pausing/cancelled -> running, for the run and what it owns exclusively (the
    tree its pause or cancel stopped: a child left paused waited for ever); R10: a
    cancelled run of it only when every one of its operations is settled.

    Set-based past the closure (read level by level, as a pause's): the tree's rows
    read and locked in one statement, R10's check in one, the moves in one batch."""
    async with db.transaction():
        run = await load_run(db, run_id, lock=db.dialect.for_update)
        if run.state in NOTHING_TO_RESUME:
            return run, []  # running already, or ended on its own: like a second cancel, a no-op
        apply(RUN_TABLE, run.state, RunEvent.RESUME)
        ids, frontier = [run_id], [run_id]
        while frontier:
            frontier = [r[0] for r in await _children(db, frontier, exclusive_only=True)]
            ids.extend(frontier)
        subtree = [(run_id, run.state), *await _locked(db, ids[1:])]
        if run.state in PAUSE_STATES:  # its pause stopped the runs it moved, then: not
            # one another principal paused before (resuming it got round the policy)
            at = await _paused_at(db, ids)
            stopped = [
                subtree[0],
                *(
                    r
                    for r in subtree[1:]
                    if r[1] in PAUSE_STATES and at.get(r[0]) == at.get(run_id)
                ),
            ]
        else:  # its cancel: the tree (a child cancelled before it too, ADR 0053)
            stopped = [r for r in subtree if r[1] not in NOTHING_TO_RESUME]
        for rid, state in stopped:
            if state not in RESUMABLE:  # a run of it still settling, or in review
                raise NotPermitted(
                    f"run {run_id!r} cannot resume: the run {rid!r} it owns is "
                    f"{state.value} (let it settle, or resolve its review, first)"
                )
        open_op = await first_unsettled(db, ids) if run.state is RunState.CANCELLED else None
        if open_op is not None:  # R10, over the tree
            raise NotPermitted(
                f"run {run_id!r} cannot resume: operation {open_op[0]!r} is not resolved "
                "(verify or review it first)"
            )
        expired = await _resume(db, stopped, by)
        return await load_run(db, run_id), expired


async def _paused_at(db: Db, run_ids: list[str]) -> dict[str, float]:
    """When each of ``run_ids`` was last paused: a pause writes one time for every run
    it moves (``_pause``), so the runs a pause stopped share its time."""
    which, params = db.dialect.in_list("run_id", run_ids)
    found = await db.all(
        f"SELECT run_id, MAX(at) FROM events WHERE kind = ? AND {which} GROUP BY run_id",
        (RunEvent.PAUSE.value, *params),
    )
    return {rid: float(at) for rid, at in found}


async def _locked(db: Db, run_ids: list[str]) -> list[tuple[str, RunState]]:
    """The states of the runs of ``run_ids``, locked, in that order, in one statement."""
    if not run_ids:
        return []
    which, params = db.dialect.in_list("id", run_ids)
    sql = f"SELECT id, state FROM runs WHERE {which} ORDER BY id{db.dialect.for_update}"
    found = {rid: RunState(state) for rid, state in await db.all(sql, params)}
    return [(r, found[r]) for r in run_ids if r in found]


async def _resume(db: Db, runs: list[tuple[str, RunState]], by: str) -> list[str]:
    """The runs of a resumed tree back to running, their granted approvals that expired
    meanwhile expired (returned): the approvals first, then each run's event (naming
    them: one statement for the runs with none) and the runs moved, in one batch."""
    now, dialect = time.time(), db.dialect
    which, params = dialect.in_list("run_id", [rid for rid, _ in runs])
    found = await db.all(
        "UPDATE approvals SET status = ? WHERE "
        f"{which} AND status = ? AND expires_at IS NOT NULL AND expires_at <= ?"
        " RETURNING run_id, id",
        (ApprovalStatus.EXPIRED, *params, ApprovalStatus.GRANTED, now),
    )
    expired: dict[str, list[str]] = {}
    for rid, approval in sorted(found):
        expired.setdefault(rid, []).append(approval)
    events = [
        event_statement(
            now, rid, None, RunEvent.RESUME, state, _RESUMED, {"by": by, "expired_approvals": ex}
        )
        for rid, state in runs
        if (ex := expired.get(rid))
    ]
    plain = [rid for rid, _ in runs if rid not in expired]
    if plain:
        ids, params = dialect.in_list("id", plain)
        t = dialect.text("?")  # the kind, the state to, the data; the state from is read
        data = rows.dump_data({"by": by, "expired_approvals": []})
        events.append(
            (
                f"{rows.EVENT_INTO} SELECT ?, id, NULL, {t}, state, {t}, {t} FROM runs WHERE {ids}",
                (now, RunEvent.RESUME, _RESUMED, data, *params),
            )
        )
    ids, params = dialect.in_list("id", [rid for rid, _ in runs])
    move = (
        f"UPDATE runs SET state = ?, grants = grants | ?, updated_at = ? WHERE {ids}",
        (_RESUMED, int(Grant.INITIATE), now, *params),
    )
    await db.batch([*events, move])
    return [a for rid, _ in runs for a in expired.get(rid, [])]
