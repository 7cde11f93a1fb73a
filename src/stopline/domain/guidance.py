"""What resuming a run will and will not repeat (R14), and what to do with one that ended.

``on_resume`` is the gate's own rule, read from the operation transition
table: a status from which ``gate_passed`` is allowed is sent (again) when
the resumed workflow reaches it; a committed (or corrected) operation is
replayed from the ledger; anything else may have happened: a cancelled run
cannot resume before it is resolved, and a paused one (which resumes with it)
does not send it again before a read-back or a reviewer proves it did not
happen. ``Run`` dispatches by the same function, so a receipt's recovery line
and what a resume does cannot drift apart. Whether the resume itself is
allowed is the ledger's rule (R10): of a cancelled run, every operation
settled (``OpStatus.settled``, the storage guard ``SETTLED``), corrections
included; ``waits_for`` reads the same property, so the recovery line never
offers a resume the ledger refuses.

``advice_for`` gives the recovery as data (``advice.Advice``); each surface
says its steps in its own terms (ADR 0066).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

from stopline.domain.advice import LIBRARY_TERMS, NEW_RUN, Advice, Do, Step, Terms
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.transitions import OPERATION_TABLE
from stopline.domain.vocab import OpEvent, OpStatus, RunState

__all__ = [
    "OnResume",
    "advice_for",
    "correct_in_application",
    "correcting",
    "on_resume",
    "resume_rule",
    "review_step",
    "tree_runs_read",
    "waits_for",
    "what_to_do",
]


class OnResume(enum.StrEnum):
    SENT = "sent"  # it provably never happened: the gate lets it go when the workflow calls it
    REPLAYED = "replayed"  # it happened: its recorded result is returned, nothing is sent
    # in flight, unknown or in review: a cancelled run cannot resume before it settles; a
    # paused one's call of it is not sent before a read-back or a reviewer proves it never
    # happened (``Run`` reads it back first, or raises ``OperationInDoubt``)
    BLOCKS = "blocks"


# (``compensating`` is replayed when a running workflow calls it again: it happened. A
# resume is refused while one is, as ``waits_for`` says.)
_REPLAYED = frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED})
_IN_REVIEW = frozenset({OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED})


def on_resume(status: OpStatus) -> OnResume:
    """What a resumed workflow's call of an operation in ``status`` does."""
    if status in _REPLAYED:
        return OnResume.REPLAYED
    if (status, OpEvent.GATE_PASSED) in OPERATION_TABLE:
        return OnResume.SENT
    return OnResume.BLOCKS


def waits_for(ops: Sequence[OperationRecord]) -> list[OperationRecord]:
    """The operations a resume of a cancelled run waits for (R10): every one not settled,
    a correction as much as the action it corrects. The ledger's resume applies the same
    property (``OpStatus.settled``; storage's ``SETTLED``)."""
    return [op for op in ops if not op.status.settled]


# a run in these states has a recovery line (a resume is refused while the cancel's
# operations settle: the line says what it waits for)
_AFTER_CANCEL = frozenset(
    {RunState.CANCELLING, RunState.SETTLING, RunState.CANCELLED, RunState.NEEDS_REVIEW}
)
# a root in these states gets a recovery line that counts what a resume repeats, and
# reads the states of the runs of its tree that hold operations (``tree_runs_read``)
_COUNTED = frozenset({RunState.CANCELLED, RunState.NEEDS_REVIEW, RunState.PAUSED, RunState.PAUSING})


def tree_runs_read(run: RunRecord, ops: Sequence[OperationRecord]) -> set[str]:
    """The runs, other than the root, whose records ``resume_rule`` reads: those of the
    tree's operations (a child that ended on its own is not run again, ADR 0053). The
    runs between them and the root are read too (``resume_rule`` is given the chain)."""
    if run.state not in _COUNTED:
        return set()
    return {op.run_id for op in ops if op.run_id != run.id}


def _ended_above(run_id: str, root: str, runs: Mapping[str, RunRecord]) -> RunRecord | None:
    """The child run, ``run_id`` or one of its ancestors below ``root``, through which a
    resumed root's re-entry does not reach ``run_id``'s calls: the one nearest the root
    that failed (entering it raises ``RunEnded``, so nothing under it is reached), else
    ``run_id`` itself if it completed (it replays: a call of it that did not happen
    raises ``RunEnded``). ``None``: its calls are reached as any."""
    chain: list[RunRecord] = []
    at = runs.get(run_id)
    while at is not None and at.id != root and len(chain) < len(runs):
        chain.append(at)
        at = runs.get(at.parent_id or "")
    failed = [r for r in chain if r.state is RunState.FAILED]
    if failed:
        return failed[-1]
    if chain and chain[0].state is RunState.COMPLETED:
        return chain[0]
    return None


def advice_for(
    run: RunRecord,
    ops: Sequence[OperationRecord],
    runs: Mapping[str, RunRecord] | None = None,
) -> Advice:
    """The receipt's recovery, as data (``Advice``), derived from ``on_resume``. ``runs``:
    the runs of its tree by id, those ``tree_runs_read`` names and their ancestors (a
    child that ended on its own is not run again: its calls are neither replayed nor
    sent)."""
    paused = run.state in (RunState.PAUSED, RunState.PAUSING)
    if not paused and run.state not in _AFTER_CANCEL:
        return Advice()
    blocks = waits_for(ops)
    if not paused and (blocks or run.state in (RunState.CANCELLING, RunState.SETTLING)):
        # a person is what it waits for when any operation, a correction too, is in review
        review = [op for op in blocks if op.status in _IN_REVIEW]
        first = review_step(run.id, review) if review else Step(Do.WAIT, run.id, _read(blocks))
        return Advice(steps=(first,), refused=True)
    tree = runs or {}
    replayed: list[str] = []
    sent: list[str] = []
    held: list[str] = []  # may have happened: a paused run resumes with them
    ended: list[RunRecord] = []  # per operation not reached: the child run that ended
    for op in ops:
        if op.compensates is not None:
            continue
        follows = on_resume(op.status)
        end = _ended_above(op.run_id, run.id, tree) if op.run_id != run.id else None
        if end is not None and (end.state is RunState.FAILED or follows is OnResume.SENT):
            ended.append(end)
        elif follows is OnResume.REPLAYED:
            replayed.append(op.id)
        elif follows is OnResume.SENT:
            sent.append(op.id)
        else:
            held.append(op.id)
    return Advice(
        steps=(Step(Do.RESUME, run.id), Step(Do.REENTER, run.id)),
        paused=paused,
        replayed=tuple(replayed),
        sent=tuple(sent),
        held=tuple(held),
        not_run_again=len(ended),
        failed_children=_ids(r for r in ended if r.state is RunState.FAILED),
        completed_children=_ids(r for r in ended if r.state is not RunState.FAILED),
    )


def resume_rule(
    run: RunRecord,
    ops: Sequence[OperationRecord],
    runs: Mapping[str, RunRecord] | None = None,
) -> str:
    """The receipt's recovery line for the run, in the library's terms (``advice_for``)."""
    return advice_for(run, ops, runs).say()


def review_step(run_id: str, ops: Sequence[OperationRecord]) -> Step:
    """A reviewer's step for ``ops``, in review, with the latest horizon recorded of them
    (R13): until it passes, "not committed" of one may be refused (``ReviewVerdict``),
    and every surface's guidance says so, not offering a decision the ledger refuses."""
    horizons = [at for op in ops if (at := op.horizon) is not None]
    return Step(Do.REVIEW, run_id, tuple(op.id for op in ops), max(horizons, default=None))


def _read(ops: Sequence[OperationRecord]) -> tuple[str, ...]:
    """Of the operations a wait is for, those only a read-back settles, which only a
    process with their tool registered makes (ADR 0087): a wait for them ends when
    such a process runs, not by waiting alone."""
    return tuple(op.id for op in ops if op.status is OpStatus.UNKNOWN and op.can_verify)


def _ids(runs: Iterable[RunRecord]) -> tuple[str, ...]:
    return tuple(sorted({r.id for r in runs}))


def what_to_do(run: RunRecord, *, by_parent: bool = False, terms: Terms = LIBRARY_TERMS) -> str:
    """For a run that has ended: how to go on (the ``RunEnded`` message), each step in
    ``terms``. ``by_parent``: the run is a child its parent's re-entry reached (ADR
    0053)."""
    if by_parent and run.state is RunState.FAILED:
        # a new run of it would send again what it completed
        return (
            "a child run that failed is not run again when its parent re-enters it (what "
            "its failed call would do now is not on record): none of its actions is sent "
            "again; the parent's new work goes in a child of another name"
        )
    if run.state in (RunState.COMPLETED, RunState.FAILED):
        # not "start a new run": of a run that did anything, that repeats it (ADR 0007)
        return (
            f"it has ended and cannot be resumed; its receipt says what it did. {NEW_RUN[:-1]} "
            "(its actions get new keys): start one only for work this run did not do"
        )
    resume = terms[Do.RESUME](Step(Do.RESUME, run.id))
    reenter = terms[Do.REENTER](Step(Do.REENTER, run.id))
    if run.state is RunState.NEEDS_REVIEW:
        review = terms[Do.REVIEW](Step(Do.REVIEW, run.id))
        return f"{review}, then {resume} and {reenter}"
    if run.state in (RunState.CANCELLING, RunState.SETTLING):
        wait = terms[Do.WAIT](Step(Do.WAIT, run.id))
        return (
            f"{wait}; its receipt's recovery line says whether a reviewer must decide an "
            f"operation first; then {resume} and {reenter}"
        )
    return f"{resume} first, then {reenter}: completed actions are replayed, not repeated"


def correcting(op_id: str, status: OpStatus, by: str = "") -> str:
    """Why ``ledger.compensate`` refuses an operation in ``status`` (only a committed one
    is corrected), and what to do instead; ``by`` names a correction already made."""
    if status in (OpStatus.REQUESTED, OpStatus.ACCEPTED, OpStatus.UNKNOWN):
        return (
            f"its outcome is not known yet ({status.value}): wait until it is verified "
            f"(ledger.verify({op_id!r}) reads it back), then correct it if it committed"
        )
    if status is OpStatus.NEEDS_REVIEW:
        return (
            "it waits for human review: a reviewer who finds it happened corrects it with "
            f"ledger.resolve_review({op_id!r}, 'compensate', by=...)"
        )
    if status in (OpStatus.NOT_COMMITTED, OpStatus.PREVENTED, OpStatus.NOT_STARTED):
        return f"it did not happen ({status.value}): there is nothing to correct"
    made = f" ({by})" if by else ""
    if status is OpStatus.COMPENSATING:
        return (
            f"a correction of it is already under way{made}: wait for its outcome "
            "(ledger.wait_settled); nothing is corrected twice"
        )
    if status is OpStatus.COMPENSATED:
        return f"it was corrected already{made}; nothing is corrected twice"
    return (  # compensation_failed: its escalation to review is on its way
        "its correction failed and it goes to human review: a reviewer decides, "
        f"ledger.resolve_review({op_id!r}, 'compensate', by=...) to correct it again"
    )


def correct_in_application(op_id: str, tool: str, *, here: str) -> str:
    """Where an operation in review is corrected when the surface at hand (a shell, the
    web console) has not loaded its tool: a correction runs the tool's compensator,
    code only the application's process has. ``here`` is how that surface records
    that it happened."""
    return (
        f"a correction runs the compensator of tool {tool!r}, which is code in your "
        f"application and is not loaded here. If it happened, {here}, then correct it "
        f"from your application with `await ledger.compensate({op_id!r}, by=...)`; or "
        f"decide it there in one step with `await ledger.resolve_review({op_id!r}, "
        "'compensate', by=...)`"
    )
