"""What resuming a run will and will not repeat (R14), and what to do with one that ended.

``on_resume`` is the gate's own rule, read from the operation transition
table: a status from which ``gate_passed`` is allowed is sent (again) when
the resumed workflow reaches it; a committed (or corrected) operation is
replayed from the ledger; anything else blocks the resume until it is
resolved. ``Run`` dispatches by the same function, so a receipt's recovery
line and what a resume does cannot drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.transitions import OPERATION_TABLE
from stopline.domain.vocab import OpEvent, OpStatus, RunState

__all__ = ["OnResume", "on_resume", "resume_rule", "what_to_do"]


class OnResume(enum.StrEnum):
    SENT = "sent"  # it provably never happened: the gate lets it go when the workflow calls it
    REPLAYED = "replayed"  # it happened: its recorded result is returned, nothing is sent
    BLOCKS = "blocks"  # in flight, unknown or in review: the run cannot resume before it settles


_REPLAYED = frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED})


def on_resume(status: OpStatus) -> OnResume:
    """What a resumed workflow's call of an operation in ``status`` does."""
    if status in _REPLAYED:
        return OnResume.REPLAYED
    if (status, OpEvent.GATE_PASSED) in OPERATION_TABLE:
        return OnResume.SENT
    return OnResume.BLOCKS


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def resume_rule(run: RunRecord, ops: Sequence[OperationRecord]) -> str:
    """The receipt's recovery line for the run, derived from ``on_resume``."""
    if run.state in (RunState.PAUSED, RunState.PAUSING):
        return "can be resumed by a principal allowed to resume"
    if run.state not in (
        RunState.CANCELLING,
        RunState.SETTLING,
        RunState.CANCELLED,
        RunState.NEEDS_REVIEW,
    ):
        return ""
    primary = [op for op in ops if op.compensates is None]
    blocks = [op for op in primary if on_resume(op.status) is OnResume.BLOCKS]
    replayed = sum(on_resume(op.status) is OnResume.REPLAYED for op in primary)
    sent = sum(on_resume(op.status) is OnResume.SENT for op in primary)
    if blocks or run.state in (RunState.CANCELLING, RunState.SETTLING):
        review = sum(op.status is OpStatus.NEEDS_REVIEW for op in blocks)
        first = (
            f"a reviewer decides {_n(review, 'operation', 'operations')} in review"
            if review
            else "wait until it settles (ledger.wait_settled)"
        )
        return (
            f"{first}; resuming is refused until every operation is resolved. "
            "A new run would send every action again."
        )
    return (
        "resume with ledger.resume(run_id, by=...), then re-enter the run with the same run id: "
        f"{_n(replayed, 'completed action is', 'completed actions are')} returned from the "
        f"ledger, not repeated; {_n(sent, 'action', 'actions')} that never happened "
        f"{'is' if sent == 1 else 'are'} sent when the workflow reaches "
        f"{'it' if sent == 1 else 'them'}; calls it had not reached yet are made as usual. "
        "A new run would send every action again."
    )


def what_to_do(run: RunRecord) -> str:
    """For a run that has ended: how to go on (the ``RunEnded`` message)."""
    if run.state in (RunState.COMPLETED, RunState.FAILED):
        return "it has ended and cannot be resumed; start a new run (its actions get new keys)"
    if run.state is RunState.NEEDS_REVIEW:
        return (
            "resolve its review items (ledger.review_items, ledger.resolve_review), then "
            "ledger.resume(run_id, by=...) and re-enter it"
        )
    if run.state in (RunState.CANCELLING, RunState.SETTLING):
        return "wait until it settles (ledger.wait_settled), then ledger.resume and re-enter it"
    return (
        "ledger.resume(run_id, by=...) first, then re-enter it: completed actions are "
        "replayed, not repeated"
    )
