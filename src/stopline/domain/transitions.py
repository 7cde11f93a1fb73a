"""The transition tables: one per entity, and the one function that applies them.

Each table is a plain mapping ``(state, event) -> next_state``. Storage
guards compare-and-set on the state read in the same transaction, so the
tables below are the only place a legal move is defined; the docs diagram
(``docs/semantics.md``) is drawn from them by ``diagram()``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TypeVar

from stopline.domain.model import EventRecord, OperationRecord
from stopline.domain.vocab import OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition

__all__ = [
    "AGREES",
    "CONTRADICTS",
    "FINAL_RUN_STATES",
    "OPERATION_TABLE",
    "RUN_TABLE",
    "SETTLED_BY_LATER_EVIDENCE",
    "apply",
    "awaits_review",
    "diagram",
    "events_from",
    "later_evidence_settles",
    "review_entry",
    "settle_move",
    "settling_statuses",
]

_S = OpStatus
_E = OpEvent

OPERATION_TABLE: Mapping[tuple[OpStatus, OpEvent], OpStatus] = {
    (_S.NOT_STARTED, _E.GATE_PASSED): _S.REQUESTED,
    (_S.NOT_STARTED, _E.GATE_REFUSED): _S.PREVENTED,
    # a retry of an operation that provably did not commit keeps its id
    (_S.NOT_COMMITTED, _E.GATE_PASSED): _S.REQUESTED,
    # a resumed run dispatches what the fence had prevented, under the same id (R10)
    (_S.PREVENTED, _E.GATE_PASSED): _S.REQUESTED,
    (_S.REQUESTED, _E.ACCEPTED): _S.ACCEPTED,
    (_S.REQUESTED, _E.COMMITTED): _S.COMMITTED,
    (_S.REQUESTED, _E.REJECTED): _S.NOT_COMMITTED,
    (_S.REQUESTED, _E.NOT_SENT): _S.NOT_COMMITTED,
    (_S.REQUESTED, _E.LOST): _S.UNKNOWN,
    (_S.REQUESTED, _E.CANCEL_CONFIRMED): _S.NOT_COMMITTED,
    (_S.ACCEPTED, _E.COMMITTED): _S.COMMITTED,
    (_S.ACCEPTED, _E.REJECTED): _S.NOT_COMMITTED,
    (_S.ACCEPTED, _E.LOST): _S.UNKNOWN,
    (_S.ACCEPTED, _E.CANCEL_CONFIRMED): _S.NOT_COMMITTED,
    # R4: a late response settles an unknown
    (_S.UNKNOWN, _E.COMMITTED): _S.COMMITTED,
    (_S.UNKNOWN, _E.REJECTED): _S.NOT_COMMITTED,
    (_S.UNKNOWN, _E.CANCEL_CONFIRMED): _S.NOT_COMMITTED,
    (_S.UNKNOWN, _E.VERIFIED_COMMITTED): _S.COMMITTED,
    (_S.UNKNOWN, _E.VERIFIED_NOT_COMMITTED): _S.NOT_COMMITTED,
    (_S.UNKNOWN, _E.ESCALATED): _S.NEEDS_REVIEW,
    # evidence that contradicts a recorded outcome goes to a human; a corrected one's
    # too (its correction's own record stays: it happened, whatever the original did)
    (_S.COMMITTED, _E.CONFLICT): _S.NEEDS_REVIEW,
    (_S.NOT_COMMITTED, _E.CONFLICT): _S.NEEDS_REVIEW,
    (_S.COMPENSATING, _E.CONFLICT): _S.NEEDS_REVIEW,
    (_S.COMPENSATED, _E.CONFLICT): _S.NEEDS_REVIEW,
    (_S.COMPENSATION_FAILED, _E.CONFLICT): _S.NEEDS_REVIEW,
    # evidence that arrives after escalation settles the review item too; a read-back
    # only one in review for want of an answer (``later_evidence_settles``, ADR 0052)
    (_S.NEEDS_REVIEW, _E.COMMITTED): _S.COMMITTED,
    (_S.NEEDS_REVIEW, _E.REJECTED): _S.NOT_COMMITTED,
    (_S.NEEDS_REVIEW, _E.VERIFIED_COMMITTED): _S.COMMITTED,
    (_S.NEEDS_REVIEW, _E.VERIFIED_NOT_COMMITTED): _S.NOT_COMMITTED,
    (_S.NEEDS_REVIEW, _E.REVIEWED_COMMITTED): _S.COMMITTED,
    (_S.NEEDS_REVIEW, _E.REVIEWED_NOT_COMMITTED): _S.NOT_COMMITTED,
    # a reviewer finds that a corrected action happened: it stays corrected (ADR 0052)
    (_S.NEEDS_REVIEW, _E.REVIEWED_CORRECTED): _S.COMPENSATED,
    (_S.COMMITTED, _E.COMPENSATION_STARTED): _S.COMPENSATING,
    (_S.COMPENSATING, _E.COMPENSATED): _S.COMPENSATED,
    (_S.COMPENSATING, _E.COMPENSATION_FAILED): _S.COMPENSATION_FAILED,
    (_S.COMPENSATION_FAILED, _E.ESCALATED): _S.NEEDS_REVIEW,
}

_R = RunState
_V = RunEvent

RUN_TABLE: Mapping[tuple[RunState, RunEvent], RunState] = {
    (_R.RUNNING, _V.PAUSE): _R.PAUSING,
    (_R.PAUSING, _V.PAUSED): _R.PAUSED,
    (_R.PAUSING, _V.RESUME): _R.RUNNING,
    (_R.PAUSED, _V.RESUME): _R.RUNNING,
    (_R.RUNNING, _V.CANCEL): _R.CANCELLING,
    (_R.PAUSING, _V.CANCEL): _R.CANCELLING,
    (_R.PAUSED, _V.CANCEL): _R.CANCELLING,
    (_R.CANCELLING, _V.SETTLE): _R.SETTLING,
    (_R.CANCELLING, _V.SETTLED): _R.CANCELLED,
    (_R.SETTLING, _V.SETTLED): _R.CANCELLED,
    (_R.CANCELLING, _V.ESCALATE): _R.NEEDS_REVIEW,
    (_R.SETTLING, _V.ESCALATE): _R.NEEDS_REVIEW,
    (_R.NEEDS_REVIEW, _V.REVIEWED): _R.CANCELLED,
    # a settled cancel whose evidence moved on (a late response, a read-back contradicting
    # a recorded outcome, a correction failing): a human decides again (ADR 0093)
    (_R.CANCELLED, _V.ESCALATE): _R.NEEDS_REVIEW,
    (_R.RUNNING, _V.COMPLETE): _R.COMPLETED,
    (_R.RUNNING, _V.FAIL): _R.FAILED,
    # a workflow that ends while its run is pausing or paused has nothing left to pause
    (_R.PAUSING, _V.COMPLETE): _R.COMPLETED,
    (_R.PAUSED, _V.COMPLETE): _R.COMPLETED,
    (_R.PAUSING, _V.FAIL): _R.FAILED,
    (_R.PAUSED, _V.FAIL): _R.FAILED,
    (_R.RUNNING, _V.ESCALATE): _R.NEEDS_REVIEW,
    # R10: a cancelled run resumes only from an evidenced checkpoint (checked in the ledger)
    (_R.CANCELLED, _V.RESUME): _R.RUNNING,
}

# The states no run leaves (nothing in the table starts there): completed, failed. What
# its workflow did stands; doubt about its calls is its receipt's headline (ADR 0093).
FINAL_RUN_STATES = frozenset(RunState) - {state for state, _ in RUN_TABLE}

# Events that agree with an outcome already recorded: kept as evidence, no change.
AGREES: dict[OpEvent, frozenset[OpStatus]] = {
    OpEvent.COMMITTED: frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED}),
    OpEvent.VERIFIED_COMMITTED: frozenset(
        {OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED}
    ),
    OpEvent.REJECTED: frozenset({OpStatus.NOT_COMMITTED}),
    OpEvent.NOT_SENT: frozenset({OpStatus.NOT_COMMITTED}),
    OpEvent.CANCEL_CONFIRMED: frozenset({OpStatus.NOT_COMMITTED}),
    OpEvent.VERIFIED_NOT_COMMITTED: frozenset({OpStatus.NOT_COMMITTED}),
}
# Events that contradict a recorded outcome: a human decides. "It never happened"
# contradicts a corrected (or being corrected) operation as much as a committed one:
# a correction of an action that never happened is an effect of its own.
_HAPPENED = frozenset(
    {
        OpStatus.COMMITTED,
        OpStatus.COMPENSATING,
        OpStatus.COMPENSATED,
        OpStatus.COMPENSATION_FAILED,
    }
)
CONTRADICTS: dict[OpEvent, frozenset[OpStatus]] = {
    OpEvent.COMMITTED: frozenset({OpStatus.NOT_COMMITTED}),
    OpEvent.VERIFIED_COMMITTED: frozenset({OpStatus.NOT_COMMITTED}),
    OpEvent.REJECTED: _HAPPENED,
    OpEvent.CANCEL_CONFIRMED: _HAPPENED,
    OpEvent.VERIFIED_NOT_COMMITTED: _HAPPENED,
}

# What may settle an operation in review follows from what put it there: the status it
# entered review from, which its log keeps (docs/decisions/0052). From ``unknown`` (its
# answer lost, then the read-back budget spent or no verifier) the open question is
# "did it happen?", and later evidence answers it as a reviewer would. From any other
# status recorded evidence stands against it (a conflict), or the correction of a proven
# commit failed: a later read-back is one more voice in that dispute, not its answer, and
# a reviewer decides (``ledger.verify`` reads nothing for it; a provider's late answer
# is kept as a note, ``Outcomes.late_response``).
SETTLED_BY_LATER_EVIDENCE = frozenset({OpStatus.UNKNOWN})


def review_entry(events: Iterable[EventRecord]) -> OpStatus | None:
    """The status an operation last entered review from, read from its own events in
    ledger order (None: it never did)."""
    entry = None
    review = OpStatus.NEEDS_REVIEW.value
    for event in events:
        if event.to_state == review and event.from_state not in (None, review):
            entry = OpStatus(event.from_state)
    return entry


def later_evidence_settles(events: Iterable[EventRecord]) -> bool:
    """Whether later evidence (a read-back) may settle an operation in review, given its
    events: only one in review for want of an answer (``SETTLED_BY_LATER_EVIDENCE``)."""
    return review_entry(events) in SETTLED_BY_LATER_EVIDENCE


_State = TypeVar("_State", OpStatus, RunState)
_Event = TypeVar("_Event", OpEvent, RunEvent)


def apply(table: Mapping[tuple[_State, _Event], _State], state: _State, event: _Event) -> _State:
    """The next state, or ``IllegalTransition(state, event)``."""
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def events_from(table: Mapping[tuple[_State, _Event], _State], state: _State) -> list[_Event]:
    """The events legal in ``state``, in table order."""
    return [event for (source, event) in table if source == state]


def diagram(table: Mapping[tuple[_State, _Event], _State]) -> str:
    """The table as ``state --event--> next`` lines, for the docs."""
    return "\n".join(f"{s} --{e}--> {t}" for (s, e), t in table.items())


def settle_move(
    state: RunState, statuses: set[OpStatus], below: Collection[RunState] = ()
) -> tuple[RunEvent | None, bool]:
    """A cancelled run's next move (``None``: it stays), from the statuses of its
    operations and the states of the runs it owns exclusively not settled yet
    (``below``), and whether its ``unknown`` operations are to be verified: the
    settler's one rule, read by every step of every backend. A run is not settled
    before its tree: its receipt counts the tree's operations (a parent showed
    ``cancelled`` beside "verifying" while a child's call was in doubt).

    A settled run (``cancelled``) moves only to review: when one of its calls, or of
    its tree's, is in review again (ADR 0093). It said ``cancelled`` beside a receipt
    that said review, and a listing of the runs in review left it out."""
    move, verify = _own_move(state, statuses)
    if state is RunState.CANCELLED:
        if move is None and RunState.NEEDS_REVIEW in below:
            move = RunEvent.ESCALATE
        return move, verify
    if move not in (RunEvent.SETTLED, RunEvent.REVIEWED) or not below:
        return move, verify
    if RunState.CANCELLING in below or RunState.SETTLING in below:
        return (RunEvent.SETTLE if state is RunState.CANCELLING else None), verify
    return (RunEvent.ESCALATE if state is not RunState.NEEDS_REVIEW else None), verify


# a run's calls that keep it from settling (the run's, or, ended on its own, its
# owner's: ``settling.unsettled_below``), and those that send it to review
_OPEN = frozenset({OpStatus.UNKNOWN, OpStatus.COMPENSATING})
HOLDING_OPS = frozenset(s for s in OpStatus if s.in_flight) | _OPEN
REVIEW_OPS = frozenset({OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED})


def awaits_review(op: OperationRecord, correction: OperationRecord | None) -> bool:
    """An original being corrected whose latest correction waits for a reviewer: it
    waits for that reviewer too (``compensating``: nobody knows whether it was
    corrected, and only the review will say)."""
    return (
        op.status is OpStatus.COMPENSATING
        and correction is not None
        and correction.status in REVIEW_OPS
    )


def settling_statuses(ops: Iterable[OperationRecord]) -> set[OpStatus]:
    """The statuses a settle reads of a run's operations (``settle_move``): one that
    ``awaits_review`` counts as in review. It counted as a correction under way, and
    kept its run ``settling`` for ever beside a receipt that said review already."""
    ops = list(ops)
    latest = {op.compensates: op for op in ops if op.compensates}  # ledger order
    return {
        OpStatus.NEEDS_REVIEW if awaits_review(op, latest.get(op.id)) else op.status for op in ops
    }


def _own_move(state: RunState, statuses: set[OpStatus]) -> tuple[RunEvent | None, bool]:
    if any(status.in_flight for status in statuses):  # a correction is on its way
        return (RunEvent.SETTLE if state is RunState.CANCELLING else None), False
    if statuses & _OPEN:
        return (RunEvent.SETTLE if state is RunState.CANCELLING else None), True
    if statuses & REVIEW_OPS:
        return (RunEvent.ESCALATE if state is not RunState.NEEDS_REVIEW else None), False
    if state is RunState.NEEDS_REVIEW:  # every review item was settled by later evidence
        return RunEvent.REVIEWED, False
    if state is RunState.CANCELLED:  # settled already
        return None, False
    return RunEvent.SETTLED, False
