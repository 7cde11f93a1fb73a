"""``record``: one operation's transition, the compare-and-set derived from the table.

The guard is the operation table's row for the event (``status IN (sources)``)
and the target a ``CASE`` over the same rows (``guards.transition_case``), on
both engines: storage and domain cannot disagree. The dialect may run it as
one statement (PostgreSQL); the portable form reads, updates and logs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from stopline.domain.model import OperationRecord
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import OpEvent, OpStatus
from stopline.errors import IllegalTransition, UnknownOperation
from stopline.ledger import rows
from stopline.ledger.backend import OutcomeUpdate
from stopline.ledger.engine.db import Db

__all__ = ["record", "record_many", "record_params", "recorded"]


def record_params(op_id: str, update: OutcomeUpdate, now: float) -> dict[str, Any]:
    result_text, has_result, evidence = rows.kept_or_said(
        update.result, update.has_result, update.evidence
    )
    items = ",".join(rows.dump_data(e.to_json()) for e in evidence) or None
    rest: dict[str, Any] = {}
    if update.cause is not None:
        rest["cause"] = update.cause.value
    if update.error is not None:
        rest["error"] = update.error
    if update.late:
        rest["late"] = True
    # the event's data, {"evidence": [...], **rest}, written from the items already dumped
    data = '{"evidence":[' + (items or "") + "]"
    data += "," + rows.dump_data(rest)[1:-1] + "}" if rest else "}"
    return {
        "id": op_id,
        "now": now,
        "items": items,
        "cause": update.cause.value if update.cause else None,
        "error": update.error,
        "has_result": int(has_result),
        "result": result_text,
        "cancel_state": update.cancel_state,
        "kind": update.event.value,
        "data": data,
        "attempt": update.attempt,
    }


def recorded(
    op_id: str, event: OpEvent, source: str | None, row: Sequence[Any] | None
) -> OperationRecord:
    """What a compare-and-set found: the updated record, else the error ``record`` raises
    (the operation unknown, or the move illegal from the status read, or a read-back's
    verdict refused because the operation was sent again since: ADR 0099)."""
    if source is None:
        raise UnknownOperation(op_id)
    if row is None:
        status = OpStatus(source)
        apply(OPERATION_TABLE, status, event)  # raises IllegalTransition
        raise IllegalTransition(status, event)  # the table allows it: a later attempt's
    return rows.op_from_row(row)


async def record(
    db: Db, op_id: str, update: OutcomeUpdate, now: float | None = None
) -> OperationRecord:
    """Apply one transition (compare-and-set on the status read in the same transaction)."""
    params = record_params(op_id, update, time.time() if now is None else now)
    source, row = await db.dialect.apply_outcome(db, update.event, params)
    return recorded(op_id, update.event, source, row)


async def record_many(
    db: Db, items: Sequence[tuple[str, OutcomeUpdate]]
) -> list[OperationRecord | IllegalTransition]:
    """``record`` for many operations in one transaction, at one instant; an illegal
    transition is refused before anything is written and returned in its place.

    Set-based (a tree's interrupted calls are 10,000 for a tree of 10,000): each
    stretch of one event is one ``apply_outcomes``, a fixed number of statements. An
    operation named twice is recorded in a later stretch, as one after the other."""
    now = time.time()
    out: dict[int, OperationRecord | IllegalTransition] = {}
    shared: dict[int, dict[str, Any]] = {}  # one update object, its parameters spelled once
    async with db.transaction():
        for stretch in _stretches(items):
            event = items[stretch[0]][1].event
            params = []
            for i in stretch:
                op_id, update = items[i]
                spelled = shared.get(id(update))
                if spelled is None:
                    spelled = shared[id(update)] = record_params(op_id, update, now)
                params.append({**spelled, "id": op_id})
            found = await db.dialect.apply_outcomes(db, event, params)
            for i, (source, row) in zip(stretch, found, strict=True):
                try:
                    out[i] = recorded(items[i][0], event, source, row)
                except IllegalTransition as exc:
                    out[i] = exc
    return [out[i] for i in range(len(items))]


def _stretches(items: Sequence[tuple[str, OutcomeUpdate]]) -> list[list[int]]:
    """The items' indexes, in order, cut where the event changes or an id repeats."""
    stretches: list[list[int]] = []
    ids: set[str] = set()
    for i, (op_id, update) in enumerate(items):
        if not stretches or op_id in ids or update.event is not items[stretches[-1][0]][1].event:
            stretches.append([])
            ids = set()
        stretches[-1].append(i)
        ids.add(op_id)
    return stretches
