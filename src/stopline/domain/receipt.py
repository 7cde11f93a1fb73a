"""Receipts: the answer to "what happened?", never claiming more than the evidence.

The headline follows R8's precedence, worst first; each operation gets one
line in plain words. ``build_receipt`` is pure: it reads records only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from stopline.domain.advice import Advice, Terms
from stopline.domain.guidance import advice_for
from stopline.domain.model import (
    SAYS_NOTHING_OF_THE_WORK,
    CancelState,
    Evidence,
    LazyEvidence,
    OperationRecord,
    RunRecord,
)
from stopline.domain.transitions import awaits_review
from stopline.domain.vocab import Cancellable, Headline, OpStatus, RunState

__all__ = [
    "HEADLINE_MESSAGES",
    "OperationLine",
    "Receipt",
    "build_receipt",
    "headline_for",
    "horizon_words",
]

HEADLINE_MESSAGES: dict[Headline, str] = {
    Headline.CANCELED_BEFORE_EXTERNAL_ACTION: "Canceled before external action.",
    Headline.STOPPED_WITH_COMPLETED_ACTIONS: (
        "Stopped. {n} actions had already completed and were kept."
    ),
    Headline.CORRECTION_QUEUED: "Action had already completed; correction queued.",
    Headline.CORRECTED: "Action had already completed; it was corrected.",
    Headline.AWAITING_CONFIRMATION: "Cancellation requested; waiting for vendor confirmation.",
    Headline.VERIFYING: (
        "The action may already have happened; verifying before closing this run."
    ),
    Headline.NEEDS_REVIEW: "Status unknown; human review required.",
    Headline.RUNNING: "Running.",
    Headline.PAUSED: "Paused. No new actions are dispatched until it is resumed.",
    Headline.COMPLETED: "Completed.",
    Headline.FAILED: "Failed.",
}

_PLAIN_STATUS: dict[OpStatus, str] = {
    OpStatus.NOT_STARTED: "not started",
    OpStatus.PREVENTED: "not sent: stopped at the dispatch gate",
    OpStatus.REQUESTED: "sent; no answer yet",
    OpStatus.ACCEPTED: "accepted by the provider; not finished yet",
    OpStatus.COMMITTED: "completed",
    OpStatus.NOT_COMMITTED: "did not happen",
    OpStatus.UNKNOWN: "may have happened; verifying",
    OpStatus.NEEDS_REVIEW: "outcome unknown; waiting for human review",
    OpStatus.COMPENSATING: "completed; correction in progress",
    OpStatus.COMPENSATED: "completed, then corrected",
    OpStatus.COMPENSATION_FAILED: "completed; the correction failed",
}

_SETTLED_STATES = frozenset(
    {RunState.CANCELLED, RunState.NEEDS_REVIEW, RunState.COMPLETED, RunState.FAILED}
)


def headline_for(run: RunRecord, ops: Sequence[OperationRecord]) -> Headline:
    """R8: the worst outcome any operation justifies, whatever state the run is in.

    Doubt (review, verification) shows on every run; the outcomes of a stop
    (awaiting confirmation, correction, kept actions) only on a cancelled one. A
    call in flight waits for its vendor's confirmation only if its provider was asked
    to cancel it, or will be (``_cancel_asked``); one nobody asks runs to its end,
    and may already have happened: "verifying" (R14).
    """
    statuses = {op.status for op in ops}
    # a correction's own progress is the correction of another line, not a new action
    # (unless what it corrected proved never to have happened: ``_standalone``)
    primary = {op.status for op in ops if op.compensates is None}
    if _standalone(ops):
        primary.add(OpStatus.COMMITTED)
    if statuses & {OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED}:
        return Headline.NEEDS_REVIEW
    if run.state is RunState.NEEDS_REVIEW:
        return Headline.NEEDS_REVIEW
    if OpStatus.UNKNOWN in statuses:
        return Headline.VERIFYING
    if not run.state.fenced:
        return _STATE_HEADLINES.get(run.state, Headline.RUNNING)
    sending = [op for op in ops if op.compensates is None and op.status.in_flight]
    if any(not _cancel_asked(op) for op in sending):  # R14: nobody waits for a vendor's word
        return Headline.VERIFYING
    if sending:
        return Headline.AWAITING_CONFIRMATION
    if OpStatus.COMPENSATING in primary:
        return Headline.CORRECTION_QUEUED
    if OpStatus.COMMITTED in primary:
        return Headline.STOPPED_WITH_COMPLETED_ACTIONS
    if OpStatus.COMPENSATED in primary:
        return Headline.CORRECTED
    return Headline.CANCELED_BEFORE_EXTERNAL_ACTION


# what a provider was asked about a cancel, or said of one: a call in flight with one of
# these is waiting for its vendor's word on the cancel (R14)
_ASKED = frozenset(
    {
        CancelState.ASKED,
        CancelState.REFUSED,
        CancelState.UNANSWERED,
        CancelState.ERROR,
        CancelState.ACKNOWLEDGED,
        CancelState.CONFIRMED,
    }
)


def _cancel_asked(op: OperationRecord) -> bool:
    """R14: a call in flight whose provider was asked to cancel it, or will be (not
    asked yet, and it still can: the worker sending it asks on the cancel). One its
    provider is not asked about (not declared cancellable, past the point it cancels
    until, an interface with no way to ask) runs to its end at the provider: a cancel
    "waiting for vendor confirmation" claimed an ask that was never made, when the
    run waits for the call's own outcome (ADR 0093)."""
    answer = _answer(op)
    return answer in _ASKED or (answer is CancelState.NOT_ASKED and op.provider_can_cancel)


_STATE_HEADLINES = {
    RunState.COMPLETED: Headline.COMPLETED,
    RunState.FAILED: Headline.FAILED,
    RunState.PAUSED: Headline.PAUSED,
    RunState.PAUSING: Headline.PAUSED,
}


def _standalone(ops: Sequence[OperationRecord]) -> list[OperationRecord]:
    """Committed corrections of operations that proved not to have happened (a reviewer
    decided so after the correction ran): an effect of their own, a completed action
    the run keeps (R8: the receipt never says nothing was done)."""
    corrections = [op for op in ops if op.compensates is not None]
    if not corrections:
        return []
    status = {op.id: op.status for op in ops}
    return [
        op
        for op in corrections
        if op.status is OpStatus.COMMITTED
        and status.get(op.compensates or "") is OpStatus.NOT_COMMITTED
    ]


_ANSWER_WORDS: dict[CancelState, str] = {
    CancelState.CONFIRMED: "the provider confirmed the cancel",
    CancelState.REFUSED: "the provider refused to cancel it",
    CancelState.ASKED: "cancel asked; no answer from the provider yet",
    CancelState.UNANSWERED: "cancel asked; the provider did not answer",
    CancelState.NOT_SUPPORTED: "not asked to cancel: the call offers no way to ask",
    # R14: an answer, neither a refusal (the work goes on) nor silence; it says nothing
    # of the work, which is still read (ADR 0083)
    CancelState.ERROR: "the cancel request ended in an error; that says nothing of the work",
    CancelState.ACKNOWLEDGED: "the provider acknowledged the cancel; that says nothing of the work",
}


# R14: ``never`` is what a tool that declared nothing about cancelling holds (the
# default) as much as one that declared it: the record proves only that no way to
# cancel was declared, so no cancel is asked; what its provider could do is not known
_NOT_DECLARED = "not declared cancellable: its provider is not asked to cancel it"


def _answer(op: OperationRecord) -> CancelState:
    return CancelState.parse(str(op.cancel_state))


def _cancel_words(op: OperationRecord) -> str:
    """R14: the provider's answer to a cancel, as observed; R12 while in flight."""
    answer = _answer(op)
    if answer is CancelState.ASKED and not op.status.in_flight:
        return "cancel asked; no answer from the provider"
    words = _ANSWER_WORDS.get(answer)
    if words is not None:
        return words
    if op.status.in_flight or op.status is OpStatus.UNKNOWN:
        if op.provider_can_cancel:
            return "the provider can still cancel it"
        # R12: said exactly when it matters, while it is in flight; R14: "once accepted"
        # only of an operation the provider was seen to accept
        if op.cancellable is Cancellable.NEVER:
            return _NOT_DECLARED
        if op.status is OpStatus.ACCEPTED:
            return "the provider cannot cancel it once accepted"
        return "the provider cannot cancel it once accepted; whether it accepted is not known"
    return ""


def horizon_words(at: float, now: float | None = None) -> str:
    """A horizon as every surface says it (R13: "until 12:03:05 UTC"), with its date when
    it is not today's (``now``'s, UTC): "until 00:34:11 UTC" said at 23:34 read as a time
    already past, where the effect may still land for an hour."""
    now = time.time() if now is None else now
    if time.gmtime(at)[:3] == time.gmtime(now)[:3]:
        return time.strftime("%H:%M:%S UTC", time.gmtime(at))
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _status_words(op: OperationRecord) -> str:
    words = _PLAIN_STATUS[op.status]
    if op.status not in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW) or op.horizon is None:
        return words  # (the evidence of a settled operation is not decoded for this)
    until = horizon_words(op.horizon)
    if op.status is OpStatus.UNKNOWN:  # R13: until then "not found" is "not yet"
        words += " until " + until
    elif op.status is OpStatus.NEEDS_REVIEW:  # what a reviewer must weigh (R13)
        words += f" (its effect could land until {until})"
    return words


_CORRECTION_FAILED = "a reviewer decides: committed, not committed, or correct it again"


def _recovery(op: OperationRecord, related: OperationRecord | None) -> str:
    """What follows for ``op``; ``related`` is its latest correction (for an operation
    being corrected), or the operation it corrected (for a correction)."""
    if op.status is OpStatus.UNKNOWN:
        return "verify by reading the destination" if op.can_verify else "human review"
    if op.status.in_flight:
        answer = _answer(op)
        if answer is CancelState.ASKED:
            return "waiting for the provider's answer to the cancel"
        if op.provider_can_cancel and answer not in SAYS_NOTHING_OF_THE_WORK:
            return "waiting for the provider's answer"
        # R12: it will run to its end at the provider; say what happens then
        then = "verify by reading the destination" if op.can_verify else "human review if no answer"
        if op.can_compensate and op.compensates is None:
            then += "; if it completed, it can be corrected by its compensation"
        if op.cancellable is Cancellable.NEVER or answer in SAYS_NOTHING_OF_THE_WORK:
            return f"its provider may still complete it; then {then}"  # not "cannot stop"
        return f"it runs to completion at the provider; then {then}"
    if op.status is OpStatus.NEEDS_REVIEW:
        failed = related is not None and related.status is OpStatus.NOT_COMMITTED
        if failed and op.compensates is None:  # its latest correction failed
            return _CORRECTION_FAILED
        if op.horizon is not None:  # R13: "it did not happen" is refused before it
            return (
                "a reviewer decides committed, or not committed once its effect can no "
                f"longer land (after {horizon_words(op.horizon)})"
            )
        return "a reviewer decides committed or not committed"
    if op.status is OpStatus.COMMITTED and op.can_compensate and op.compensates is None:
        return "can be corrected by its compensation"
    if op.status is OpStatus.COMPENSATING:
        return _correcting(related)
    if op.status is OpStatus.COMPENSATION_FAILED:
        return _CORRECTION_FAILED
    if (
        op.compensates is not None
        and op.status is OpStatus.COMMITTED
        and related is not None
        and related.status is OpStatus.NOT_COMMITTED
    ):
        return "it corrected an action that did not happen; a person decides whether to undo it"
    return ""


def _correcting(correction: OperationRecord | None) -> str:
    """The recovery of an operation being corrected: what its correction waits for."""
    status = None if correction is None else correction.status
    if status is OpStatus.NEEDS_REVIEW:  # a person, not time, settles it (R14)
        return "its correction waits for human review: a reviewer decides whether it happened"
    if status is OpStatus.UNKNOWN and correction is not None and not correction.can_verify:
        return "its correction's answer was lost and it has no read-back: it goes to human review"
    # not "before this run closes": a correction of a run that completed runs after it
    return "correction queued; its outcome is recorded when it answers, else read back"


@dataclasses.dataclass(frozen=True, slots=True)
class OperationLine:
    op_id: str
    what: str
    status: OpStatus
    status_words: str
    provider_cancel: str
    recovery: str
    # the operation's, immutable: a tuple, or the record's ``LazyEvidence`` (decoded
    # when a reader asks for it; a page or a settled check never does)
    evidence: Sequence[Evidence]
    # the response is in hand and its record queued, not yet durable (ADR 0022)
    recording: bool = False
    # being corrected, the correction in review: settled as far as time goes (a
    # reviewer, not time, changes it: ``transitions.awaits_review``)
    awaits_review: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "what": self.what,
            "status": self.status.value,
            "status_words": self.status_words,
            "provider_cancel": self.provider_cancel,
            "recovery": self.recovery,
            "evidence": [e.to_json() for e in self.evidence],
            "recording": self.recording,
        }

    def text(self) -> str:
        parts = [f"- {self.what}: {self.status_words}"]
        if self.provider_cancel:
            parts.append(f"; {self.provider_cancel}")
        if self.recovery:
            parts.append(f"; next: {self.recovery}")
        refs = ", ".join(_last_refs(self.evidence, 3))
        if refs:
            parts.append(f" [evidence: {refs}]")
        return "".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Receipt:
    run_id: str
    run_state: RunState
    headline: Headline
    message: str
    lines: tuple[OperationLine, ...]
    cancelled_by: str | None
    cancel_reason: str | None
    # the recovery line, in the library's terms (``advice.say()``)
    resume_rule: str
    # the recovery as data: the steps and what following them repeats (ADR 0066)
    advice: Advice = dataclasses.field(default_factory=Advice)

    @property
    def settled(self) -> bool:
        """The run has ended and every operation is resolved (R2): this no longer changes
        by itself. A run in review is settled so (a reviewer's decision, not time,
        changes it: ``Headline.NEEDS_REVIEW`` says so), as is an operation being
        corrected whose correction is in review (``transitions.awaits_review``).

        A run in review whose items were all settled is about to close, so not yet.
        """
        if self.run_state not in _SETTLED_STATES:
            return False
        if not all(line.status.resolved or line.awaits_review for line in self.lines):
            return False
        in_review = any(line.status is OpStatus.NEEDS_REVIEW for line in self.lines)
        return in_review or self.run_state is not RunState.NEEDS_REVIEW

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_state": self.run_state.value,
            "headline": self.headline.value,
            "message": self.message,
            "cancelled_by": self.cancelled_by,
            "cancel_reason": self.cancel_reason,
            "resume_rule": self.resume_rule,
            "advice": self.advice.to_json(),
            "settled": self.settled,
            "operations": [line.to_json() for line in self.lines],
        }

    def worded(self, terms: Terms) -> Receipt:
        """This receipt with its recovery line said in ``terms``: a surface's way to do
        each step (a CLI command, a console page), what following it repeats unchanged."""
        if not self.advice.steps:  # nothing to do (or a receipt made without its advice)
            return self
        return dataclasses.replace(self, resume_rule=self.advice.say(terms))

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def text(self) -> str:
        out = [self.message]
        out.extend(line.text() for line in self.lines)

        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()


def _line(op: OperationRecord, recording: bool, related: OperationRecord | None) -> OperationLine:
    return OperationLine(
        op_id=op.id,
        what=op.description or op.tool,
        status=op.status,
        status_words=_RECORDING_WORDS if recording else _status_words(op),
        provider_cancel=_cancel_words(op),
        recovery=_recovery(op, related),
        evidence=op.evidence if isinstance(op.evidence, LazyEvidence) else tuple(op.evidence),
        recording=recording,
        awaits_review=awaits_review(op, related),
    )


_RECORDING_WORDS = "answered; recording the outcome (not yet durable)"


def _related(ops: Sequence[OperationRecord]) -> dict[str, OperationRecord]:
    """By id: a corrected operation's latest correction, and a correction's original."""
    related: dict[str, OperationRecord] = {}
    by_id: dict[str, OperationRecord] | None = None
    for op in ops:
        if op.compensates is None:
            continue
        if by_id is None:
            by_id = {o.id: o for o in ops}
        related[op.compensates] = op  # in ledger order: the latest correction wins
        original = by_id.get(op.compensates)
        if original is not None:
            related[op.id] = original
    return related


def build_receipt(
    run: RunRecord,
    ops: Sequence[OperationRecord],
    *,
    recording: Collection[str] = (),
    runs: Mapping[str, RunRecord] | None = None,
) -> Receipt:
    """``recording``: operations whose outcome the caller holds but has not committed yet;
    a line still in flight in the records says so instead of "no answer yet". ``runs``:
    the runs of its tree the recovery line reads (``guidance.tree_runs_read``)."""
    headline = headline_for(run, ops)
    committed = sum(1 for op in ops if op.status is OpStatus.COMMITTED and op.compensates is None)
    committed += len(_standalone(ops))
    message = HEADLINE_MESSAGES[headline].format(n=committed)
    if committed == 1:  # plural-correct (ADR 0007)
        message = message.replace("1 actions had", "1 action had").replace("were kept", "was kept")
    related = _related(ops)
    advice = advice_for(run, ops, runs)
    lines = tuple(
        _line(op, op.status.in_flight and op.id in recording, related.get(op.id)) for op in ops
    )
    return Receipt(
        run_id=run.id,
        run_state=run.state,
        headline=headline,
        message=message,
        lines=lines,
        # who cancelled it, while its state is the cancel's (a cancel before a resume
        # is history: a paused run's receipt named it as if it were the cause)
        cancelled_by=run.cancelled_by if run.state.fenced else None,
        cancel_reason=run.cancel_reason if run.state.fenced else None,
        resume_rule=advice.say(),
        advice=advice,
    )


def _last_refs(evidence: Sequence[Evidence], at_most: int) -> list[str]:
    """The last ``at_most`` distinct references of a line's evidence, in their order:
    two records of one reference (a correction started, then done) are one to read."""
    found: list[str] = []
    for e in reversed(evidence):
        ref = f"{e.kind.value}:{e.ref}"
        if ref not in found:
            found.append(ref)
            if len(found) == at_most:
                break
    return found[::-1]
