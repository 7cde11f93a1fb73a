"""A shared run's owners (R6, ADR 0065): a link made by a share, and a run whose block
another run's cancel cut, left to the owners still holding it.

A cancel's side of ownership (a shared run released by its owner's cancel, fenced
with its last) is the fence's (``fence._closure``); these are the two writes that
change who holds a run without a cancel.
"""

from __future__ import annotations

import time

from stopline.domain.vocab import LogKind
from stopline.errors import InvalidInput
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.reads import (
    attempt,
    attempt_event,
    event_statement,
    found_run,
    load_run,
    load_runs,
    run_query,
)
from stopline.ledger.engine.settling import owners_of

__all__ = ["add_owner", "leave_to_owners", "left_to"]


# A link that may close a loop is made one at a time per ledger (ADR 0065): two links
# whose rows are locked ``FOR SHARE`` both passed the loop check, each blind to the other
# (a->b and b->a, or a->b and c->d with b owned by c and d by a). PostgreSQL: an advisory
# lock of the transaction (two-key space, the schema's), before any row; SQLite's one
# writer is that lock. Cancels and new children (a new run owns nothing) never take it.
_ONE_LINK_AT_A_TIME = {
    "postgresql": "SELECT pg_advisory_xact_lock("
    "hashtext('stopline:run_owners'), hashtext(current_schema()))",
}


async def add_owner(
    db: Db, run_id: str, owner_run: str, exclusive: bool, by: str, token: str | None = None
) -> None:
    """``owner_run`` owns ``run_id`` from now (again, if it had let it go), a link made
    by the principal ``by``: its ``owner_added`` event names who, in the link's own
    transaction (a crash cannot leave a link nobody answers for). ``token`` marks the
    attempt in the event (read back after a lost reply). A link that would close a loop
    is ``InvalidInput``, even against one made at the same moment."""
    serial, lock = _ONE_LINK_AT_A_TIME.get(db.dialect.name), db.dialect.for_share
    async with db.transaction():
        *_, owner_found, child_found = await db.batch(
            [
                *([(serial, ())] if serial else []),
                run_query(owner_run, lock),
                run_query(run_id, lock),
            ]
        )
        owner, child = found_run(owner_found, owner_run), found_run(child_found, run_id)
        if await _owns(db, child.id, owner.id):  # a loop: a child's cancel fenced its owner
            raise InvalidInput("with_owner", _loop(child.id, owner.id))
        now = time.time()
        await db.run(
            "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (run_id, owner_run) DO UPDATE SET released_at = NULL",
            (child.id, owner.id, int(exclusive), now),
        )
        data = attempt({"owner": owner.id, "exclusive": exclusive, "by": by}, token)
        await db.run(*event_statement(now, child.id, None, LogKind.OWNER_ADDED, None, None, data))


def _loop(run_id: str, owner: str) -> str:
    if run_id == owner:  # it could never lose its last owner: no cancel fenced it
        return f"run {run_id!r} cannot own itself"
    return f"run {owner!r} is owned by run {run_id!r} (at some depth): it cannot own it"


async def _owns(db: Db, run_id: str, other: str) -> bool:
    """Whether ``other`` is ``run_id`` or a run it owns, at any depth (its owners read up
    from ``other``: a few levels, where the tree below ``run_id`` may be thousands)."""
    seen, frontier = {other}, [other]
    while frontier and run_id not in seen:
        which, params = db.dialect.in_list("run_id", frontier)
        up = await db.all(
            f"SELECT owner_run FROM run_owners WHERE {which} AND released_at IS NULL", params
        )
        frontier = [r for (r,) in up if r not in seen]
        seen.update(frontier)
    return run_id in seen


async def leave_to_owners(db: Db, run_id: str, cut_by: str, token: str | None = None) -> list[str]:
    """The run's block was cut by the cancel of the run ``cut_by`` (one whose block is
    open around it) and did not end it: the runs owning it by a share that can go on
    with it (running, pausing or paused: neither fenced nor ended), if it is itself
    neither fenced nor ended, and then its ``left_to_owners`` event naming them and
    the cancel that cut it (``token``: the attempt's mark). None: nothing written.

    Its row is locked before its owners are read, so the event and a fence of it
    never cross: a cancel of its last owner that fences it locks it after that owner
    (``fence._closure``), and either waits for this event, which then precedes its
    ``cancel``, or commits first, and this finds it fenced and writes nothing."""
    async with db.transaction():
        run = await load_run(db, run_id, lock=db.dialect.for_update)
        if run.state.fenced or run.state.ended:
            return []
        links = (await owners_of(db, [run_id])).get(run_id, {})
        sharing = [owner for owner, alone in links.items() if not alone]
        found = await load_runs(db, sharing)
        holders = [
            o for o in sharing if o in found and not (found[o].state.fenced or found[o].state.ended)
        ]
        if holders:
            data = attempt({"cut_by": cut_by, "owners": holders}, token)
            now = time.time()
            await db.run(
                *event_statement(now, run_id, None, LogKind.LEFT_TO_OWNERS, None, None, data)
            )
        return holders


async def left_to(db: Db, run_id: str, token: str) -> list[str]:
    """The owners the attempt ``token`` of ``leave_to_owners`` left the run to, read
    from its event (after a lost reply, once that event is found in the log)."""
    where = "run_id = ? AND kind = ?"
    data = await attempt_event(db, where, (run_id, LogKind.LEFT_TO_OWNERS.value), token)
    return [] if data is None else [str(owner) for owner in data["owners"]]
