"""The review queue: outcomes the evidence cannot settle, decided by a human.

An operation lands here (``needs_review``) when its read-back budget is
spent, its tool has no verifier, later evidence contradicts its recorded
outcome, or its correction failed. A reviewer lists the queue, inspects an
item (its run, all its evidence, every event, its corrections), and resolves
it as ``committed``, ``not_committed`` or ``compensate`` (it happened;
correct it). The reviewer's identity and reason are recorded as ``review``
evidence; the run's receipt and state follow.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from stopline.domain.limits import check_limit
from stopline.domain.model import EventRecord, Evidence, OperationRecord, RunRecord
from stopline.domain.vocab import EvidenceKind, OpEvent, OpStatus
from stopline.ledger.backend import OutcomeUpdate

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["REVIEW_STATUSES", "ReviewCase", "ReviewItem", "ReviewVerdict", "inspect", "items"]

REVIEW_STATUSES = frozenset({OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED})


class ReviewVerdict(enum.StrEnum):
    COMMITTED = "committed"  # it happened
    NOT_COMMITTED = "not_committed"  # it did not happen
    COMPENSATE = "compensate"  # it happened, and must be corrected

    @classmethod
    def parse(cls, value: str | ReviewVerdict) -> ReviewVerdict:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(v.value for v in cls)
            raise ValueError(f"review verdict {value!r} is not one of: {allowed}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class ReviewItem:
    run: RunRecord
    op: OperationRecord

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run.id,
            "run_state": self.run.state.value,
            "owner": self.run.owner,
            "op_id": self.op.id,
            "what": self.op.description or self.op.tool,
            "status": self.op.status.value,
            "since": self.op.updated_at,
            "evidence": [e.to_json() for e in self.op.evidence],
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ReviewCase:
    """Everything a reviewer needs about one item."""

    run: RunRecord
    op: OperationRecord
    events: tuple[EventRecord, ...]  # this operation's, in ledger order
    corrections: tuple[OperationRecord, ...]  # its compensations, oldest first

    def to_json(self) -> dict[str, Any]:
        return {
            **ReviewItem(self.run, self.op).to_json(),
            "error": self.op.error,
            "cause": self.op.cause.value if self.op.cause else None,
            "can_verify": self.op.can_verify,
            "can_compensate": self.op.can_compensate,
            "events": [
                {"seq": e.seq, "at": e.at, "kind": e.kind, "to": e.to_state, "data": dict(e.data)}
                for e in self.events
            ],
            "corrections": [{"op_id": c.id, "status": c.status.value} for c in self.corrections],
        }


async def items(core: Core, *, limit: int = 1000) -> list[ReviewItem]:
    """The queue, oldest first, read through the open-operations index."""
    limit = check_limit("limit", limit)
    ops = await core.backend.unresolved(limit, statuses=REVIEW_STATUSES)
    runs: dict[str, RunRecord] = {}
    out = []
    for op in sorted(ops, key=lambda o: (o.updated_at, o.id)):
        if op.run_id not in runs:
            runs[op.run_id] = await core.backend.get_run(op.run_id)
        out.append(ReviewItem(runs[op.run_id], op))
    return out


async def inspect(core: Core, op_id: str) -> ReviewCase:
    op = await core.backend.get_operation(op_id)
    run = await core.backend.get_run(op.run_id)
    events = tuple(e for e in await core.backend.events(op.run_id) if e.op_id == op_id)
    corrections = tuple(await core.backend.compensations(op_id))
    return ReviewCase(run, op, events, corrections)


async def resolve(
    core: Core, op_id: str, verdict: ReviewVerdict, *, by: str, note: str
) -> OperationRecord:
    """Record a reviewer's decision (``by`` already authorized) and settle what follows."""
    op = await core.backend.get_operation(op_id)
    if verdict is ReviewVerdict.COMPENSATE:
        core.compensator.tool_for(op)  # refuse before writing anything
    if op.status is OpStatus.COMPENSATION_FAILED:  # escalation interrupted: finish it first
        escalated = Evidence.local("compensation_failed", "a reviewer decides what now")
        op = await core.backend.record(op_id, OutcomeUpdate(OpEvent.ESCALATED, [escalated]))
    event = (
        OpEvent.REVIEWED_NOT_COMMITTED
        if verdict is ReviewVerdict.NOT_COMMITTED
        else OpEvent.REVIEWED_COMMITTED
    )
    decision = Evidence(EvidenceKind.REVIEW, by, f"{verdict.value}: {note}" if note else verdict)
    # IllegalTransition (nothing written) unless the item is still in review
    op = await core.backend.record(op_id, OutcomeUpdate(event, [decision]))
    core.outcomes.after_change(op)
    if verdict is ReviewVerdict.COMPENSATE:
        await core.compensator.start(op_id, by=by, reason=f"review: {note}".rstrip(": "))
    await core.settler.advance(op.run_id)
    return op
