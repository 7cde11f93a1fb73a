"""The review queue: outcomes the evidence cannot settle, decided by a human.

An operation lands here (``needs_review``) when its read-back budget is
spent, its tool has no verifier, later evidence contradicts its recorded
outcome, or its correction failed. A reviewer lists the queue, inspects an
item (its run, all its evidence, every event, its corrections), and resolves
it as ``committed``, ``not_committed`` or ``compensate`` (it happened;
correct it). The reviewer's identity and reason are recorded as ``review``
evidence; the run's receipt and state follow.

What a read-back may do to an item follows from what put it in review (ADR
0052, ``transitions.later_evidence_settles``): it settles one that went there
for want of an answer; a contradiction, or a failed correction of a proven
commit, waits for a reviewer. An item that was corrected before its
contradiction stays corrected when the reviewer finds it happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

from stopline.domain.limits import check_limit
from stopline.domain.model import EventRecord, Evidence, OperationRecord, RunRecord
from stopline.domain.receipt import horizon_words
from stopline.domain.transitions import REVIEW_OPS, later_evidence_settles
from stopline.domain.vocab import EvidenceKind, OpEvent, OpStatus
from stopline.errors import (
    IllegalTransition,
    InvalidInput,
    NotCorrectable,
    NotInReview,
    NotPermitted,
)
from stopline.ledger.backend import OutcomeUpdate

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = [
    "REVIEW_STATUSES",
    "ReviewCase",
    "ReviewItem",
    "ReviewVerdict",
    "escalation",
    "evidence_settles",
    "inspect",
    "items",
]

REVIEW_STATUSES = REVIEW_OPS  # what a reviewer decides (``transitions.REVIEW_OPS``)


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
            raise InvalidInput("verdict", f"{value!r} is not one of: {allowed}") from None


# the event a decision records (for a decision refused: the move it would have been)
_REVIEW_EVENTS = {
    ReviewVerdict.COMMITTED: OpEvent.REVIEWED_COMMITTED,
    ReviewVerdict.NOT_COMMITTED: OpEvent.REVIEWED_NOT_COMMITTED,
    ReviewVerdict.COMPENSATE: OpEvent.REVIEWED_COMMITTED,
}


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


async def _events(core: Core, op: OperationRecord) -> tuple[EventRecord, ...]:
    return tuple(e for e in await core.backend.events(op.run_id) if e.op_id == op.id)


async def inspect(core: Core, op_id: str) -> ReviewCase:
    op = await core.backend.get_operation(op_id)
    run = await core.backend.get_run(op.run_id)
    corrections = tuple(await core.backend.compensations(op_id))
    return ReviewCase(run, op, await _events(core, op), corrections)


async def evidence_settles(core: Core, op: OperationRecord) -> bool:
    """Whether a read-back may settle ``op``, in review: only if it went there for want
    of an answer (its log says what it entered review from; ADR 0052)."""
    if op.status is not OpStatus.NEEDS_REVIEW:
        return False
    return later_evidence_settles(await _events(core, op))


async def resolve(
    core: Core, op_id: str, verdict: ReviewVerdict, *, by: str, note: str
) -> OperationRecord:
    """Record a reviewer's decision (``by`` already authorized) and settle what follows."""
    op = await core.backend.get_operation(op_id)
    if op.status not in REVIEW_STATUSES:  # before what a decision would need: it needs none
        raise NotInReview(op_id, op.status, _REVIEW_EVENTS[verdict])
    if verdict is ReviewVerdict.COMPENSATE:  # refuse before writing anything
        await core.compensator.may_start(op)
    if verdict is ReviewVerdict.NOT_COMMITTED:
        _may_not_have_happened(core, op)
    corrected = await _corrected(core, op_id, verdict)
    if op.status is OpStatus.COMPENSATION_FAILED:  # escalation interrupted: finish it first
        with contextlib.suppress(IllegalTransition):  # escalated meanwhile (its link, a peer)
            await core.backend.record(op_id, escalation())
    if verdict is ReviewVerdict.NOT_COMMITTED:
        event = OpEvent.REVIEWED_NOT_COMMITTED
    elif corrected:  # it happened, and its correction stands: corrected, as before
        event = OpEvent.REVIEWED_CORRECTED
    else:
        event = OpEvent.REVIEWED_COMMITTED
    decision = Evidence(EvidenceKind.REVIEW, by, f"{verdict.value}: {note}" if note else verdict)
    try:  # compare-and-set: refused, nothing written, unless the item is still in review
        op = await core.backend.record(op_id, OutcomeUpdate(event, [decision]))
    except IllegalTransition as exc:  # decided meanwhile (another reviewer, its evidence)
        now = (await core.backend.get_operation(op_id)).status
        raise NotInReview(op_id, now, event) from exc
    if verdict is ReviewVerdict.COMPENSATE:  # started before a settling step can see it
        try:
            await core.compensator.start(op_id, by=by, reason=f"review: {note}".rstrip(": "))
        except NotCorrectable as exc:
            if exc.state is not OpStatus.COMPENSATING:
                raise
            # the tool's compensation=always started the same correction first (a cancelled
            # run's step, in another task or process): what the reviewer asked is under way
        except NotPermitted as exc:  # paused since the check above: the decision stands
            raise NotPermitted(
                f"the decision is recorded ({op_id!r} happened) but its correction did not "
                f"start: {exc}; then correct it with ledger.compensate({op_id!r}, by=...)"
            ) from exc
        op = await core.backend.get_operation(op_id)
    if op.compensates is not None:  # a decided correction settles its link now: the
        await core.compensator.link(op)  # receipt returned says what the original is
    core.outcomes.after_change(op)
    await core.settler.advance(op.run_id)
    return op


def escalation() -> OutcomeUpdate:
    """A failed correction's original, to review: its link's step, or a reviewer's who
    finds the link interrupted between ``compensation_failed`` and review."""
    return OutcomeUpdate(
        OpEvent.ESCALATED, [Evidence.local("compensation_failed", "a reviewer decides what now")]
    )


def _may_not_have_happened(core: Core, op: OperationRecord) -> None:
    """R13 for a reviewer: "it did not happen" is refused while its effect can still
    land (before its horizon; the provider said nothing of the request ending), as a
    read-back's "not found" proves nothing then: its guidance would send it again."""
    horizon = core.settler.horizon_of(op)
    if horizon is None or horizon <= time.time():
        return
    until = horizon_words(horizon)
    raise NotPermitted(
        f"{op.id!r} may still land until {until} (R13): decide 'not_committed' after "
        "that, or 'committed' now if it happened"
    )


async def _corrected(core: Core, op_id: str, verdict: ReviewVerdict) -> bool:
    """Whether the item in review was corrected before (its latest correction committed);
    refused, nothing written, while a correction of it has no outcome, and for a second
    correction of a corrected one."""
    corrections = await core.backend.compensations(op_id)
    latest = corrections[-1] if corrections else None
    if latest is None:
        return False
    if not latest.status.settled:
        first = " (it is in review: decide it first)" if latest.status in REVIEW_STATUSES else ""
        raise NotPermitted(
            f"operation {op_id!r} is decided once its correction {latest.id!r} has an outcome; "
            f"that correction is {latest.status.value}{first}"
        )
    if latest.status is not OpStatus.COMMITTED:
        return False
    if verdict is ReviewVerdict.COMPENSATE:
        raise await core.compensator.refusal(op_id, OpStatus.COMPENSATED)
    return True
