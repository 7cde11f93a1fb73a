"""What a cancelled run's settle reads of the runs below it (R6, ADR 0058): a run is
not settled before its tree is; and of the runs above a run, the owners it wakes."""

from __future__ import annotations

from collections.abc import Sequence

from stopline.domain.transitions import HOLDING_OPS, REVIEW_OPS
from stopline.domain.vocab import OpStatus, RunState
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.guards import sql_values
from stopline.ledger.engine.reads import chunks

__all__ = ["owners_of", "unsettled_below"]

# ``transitions.awaits_review`` for ``o``, in SQL: an original being corrected whose
# latest correction (in ledger order) waits for a reviewer counts as in review
_AWAITS_REVIEW = (
    f"(o.status = '{OpStatus.COMPENSATING.value}' AND (SELECT c.status FROM operations AS c"
    " WHERE c.compensates IS NOT NULL AND c.compensates = o.id"
    f" ORDER BY c.created_at DESC, c.id DESC LIMIT 1) IN ({sql_values(REVIEW_OPS)}))"
)


async def unsettled_below(db: Db, run_ids: Sequence[str]) -> dict[str, set[RunState]]:
    """For each of ``run_ids`` with any, the states of the runs it owns exclusively,
    transitively, that have not settled (cancelling, settling, in review): a cancelled
    run is not settled before its tree is (its receipt reads the tree's operations). A
    run that ended on its own (completed, failed) with a call still open (in doubt,
    being corrected) counts as settling, with one in review as in review: its calls
    are in its owner's receipt as much as a cancelled run's. One statement per 4,096
    runs, from the ids (a run with no children costs a probe of the ownership index)."""
    dialect, reads = db.dialect, []
    step = dialect.owned_step(carry="tree.root, ")

    def having(condition: str) -> str:
        return f"EXISTS (SELECT 1 FROM operations AS o WHERE o.run_id = tree.id AND ({condition}))"

    holding, review = sql_values(HOLDING_OPS), sql_values(REVIEW_OPS)

    for chunk in chunks(sorted(run_ids)):
        roots, params = dialect.each_of(chunk)
        reads.append(
            (
                f"WITH RECURSIVE tree(root, id) AS (SELECT value, value FROM {roots}{step})"
                # each member's state by its id (a join had PostgreSQL scan every run)
                " SELECT root, state, pending, review FROM (SELECT tree.root AS root,"
                " (SELECT r.state FROM runs AS r WHERE r.id = tree.id) AS state,"
                f" {having(f'o.status IN ({holding}) AND NOT {_AWAITS_REVIEW}')} AS pending,"
                f" {having(f'o.status IN ({review}) OR {_AWAITS_REVIEW}')} AS review"
                " FROM tree WHERE tree.id <> tree.root) AS member"
                f" WHERE state IN ({sql_values(_UNSETTLED)}) OR pending OR review",
                params,
            )
        )
    below: dict[str, set[RunState]] = {}
    for found in await db.snapshot(reads):
        for root, state, pending, review in found:
            states = below.setdefault(root, set())
            if state in _UNSETTLED:
                states.add(RunState(state))
            if pending:
                states.add(RunState.SETTLING)
            if review:
                states.add(RunState.NEEDS_REVIEW)
    return below


_UNSETTLED = frozenset({RunState.CANCELLING, RunState.SETTLING, RunState.NEEDS_REVIEW})


async def owners_of(db: Db, run_ids: Sequence[str]) -> dict[str, dict[str, bool]]:
    """For each of ``run_ids`` with any, the runs that own it now (its links no cancel
    let go), each with whether it owns it exclusively: the runs whose trees it is in
    (ADR 0065: a shared run's last owner's cancel makes that owner's link exclusive,
    so its owner now is not always its parent). Through the links' primary key: every
    link of the runs read, the live ones kept here (``released_at IS NULL`` in the
    condition had PostgreSQL, on a ledger it has not analyzed, walk the partial index
    of every live link, ``run_owners_owner``)."""
    which, params = db.dialect.in_list("run_id", sorted(set(run_ids)))
    found = await db.all(
        f"SELECT run_id, owner_run, exclusive, released_at FROM run_owners WHERE {which}"
        " ORDER BY run_id, owner_run",
        params,
    )
    owners: dict[str, dict[str, bool]] = {}
    for run_id, owner, exclusive, released in found:
        if released is None:
            owners.setdefault(run_id, {})[owner] = bool(exclusive)
    return owners
