"""What resuming a run will and will not repeat (R14), and what to do with one that ended.

``on_resume`` is the gate's own rule, read from the operation transition
table: a status from which ``gate_passed`` is allowed is sent (again) when
the resumed workflow reaches it; a committed (or corrected) operation is
replayed from the ledger; anything else blocks the resume until it is
resolved. ``Run`` dispatches by the same function, so a receipt's recovery
line and what a resume does cannot drift apart. Whether the resume itself is
allowed is the ledger's rule (R10): every operation of the run settled
(``OpStatus.settled``, the storage guard ``SETTLED``), corrections included;
``waits_for`` reads the same property, so the recovery line never offers a
resume the ledger refuses.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.transitions import OPERATION_TABLE
from stopline.domain.vocab import OpEvent, OpStatus, RunState

__all__ = [
    "OnResume",
    "correct_in_application",
    "correcting",
    "on_resume",
    "resume_rule",
    "tree_runs_read",
    "waits_for",
    "what_to_do",
]


class OnResume(enum.StrEnum):
    SENT = "sent"  # it provably never happened: the gate lets it go when the workflow calls it
    REPLAYED = "replayed"  # it happened: its recorded result is returned, nothing is sent
    BLOCKS = "blocks"  # in flight, unknown or in review: the run cannot resume before it settles


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


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


# a root in these states gets a recovery line that counts what a resume repeats, and
# reads the states of the runs of its tree that hold operations (``tree_runs_read``)
_COUNTED = frozenset({RunState.CANCELLED, RunState.NEEDS_REVIEW})


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


def _names(runs: Sequence[RunRecord]) -> str:
    ids = sorted({r.id for r in runs})
    shown = ", ".join(repr(i) for i in ids[:3])
    return shown if len(ids) <= 3 else f"{shown} and {len(ids) - 3} more"


def resume_rule(
    run: RunRecord,
    ops: Sequence[OperationRecord],
    runs: Mapping[str, RunRecord] | None = None,
) -> str:
    """The receipt's recovery line for the run, derived from ``on_resume``. ``runs``: the
    runs of its tree by id, those ``tree_runs_read`` names and their ancestors (a child
    that ended on its own is not run again: its calls are neither replayed nor sent)."""
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
    blocks = waits_for(ops)
    tree = runs or {}
    replayed = sent = 0
    ended: list[RunRecord] = []  # per operation not reached: the child run that ended
    for op in primary:
        follows = on_resume(op.status)
        end = _ended_above(op.run_id, run.id, tree) if op.run_id != run.id else None
        if end is not None and (end.state is RunState.FAILED or follows is OnResume.SENT):
            ended.append(end)
        elif follows is OnResume.REPLAYED:
            replayed += 1
        elif follows is OnResume.SENT:
            sent += 1
    if blocks or run.state in (RunState.CANCELLING, RunState.SETTLING):
        # a person is what it waits for when any operation, a correction too, is in review
        review = sum(op.status in _IN_REVIEW for op in blocks)
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
        f"{_not_run_again(ended)}A new run would send every action again."
    )


def _not_run_again(ended: Sequence[RunRecord]) -> str:
    """What the recovery line says of the operations of child runs that ended on their
    own: the resume does not run them again, and the re-entry meets ``RunEnded``."""
    if not ended:
        return ""
    failed = [r for r in ended if r.state is RunState.FAILED]
    completed = [r for r in ended if r.state is not RunState.FAILED]
    where = []
    if failed:
        where.append(f"entering a child run that failed ({_names(failed)})")
        where[-1] += " raises RunEnded"
    if completed:
        where.append(
            f"a call that never happened in a child run that completed ({_names(completed)})"
            " raises RunEnded when reached"
        )
    return (
        f"{_n(len(ended), 'action', 'actions')} of child runs that ended on their own "
        f"{'is' if len(ended) == 1 else 'are'} not sent again: {'; '.join(where)}. "
    )


def what_to_do(run: RunRecord, *, by_parent: bool = False) -> str:
    """For a run that has ended: how to go on (the ``RunEnded`` message). ``by_parent``:
    the run is a child its parent's re-entry reached (ADR 0053)."""
    if by_parent and run.state is RunState.FAILED:
        # a new run of it would send again what it completed
        return (
            "a child run that failed is not run again when its parent re-enters it (what "
            "its failed call would do now is not on record): none of its actions is sent "
            "again; the parent's new work goes in a child of another name"
        )
    if run.state in (RunState.COMPLETED, RunState.FAILED):
        return "it has ended and cannot be resumed; start a new run (its actions get new keys)"
    if run.state is RunState.NEEDS_REVIEW:
        return (
            "resolve its review items (ledger.review_items, ledger.resolve_review), then "
            "ledger.resume(run_id, by=...) and re-enter it"
        )
    if run.state in (RunState.CANCELLING, RunState.SETTLING):
        return (
            "wait until it settles (ledger.wait_settled; its receipt's recovery line says "
            "whether a reviewer must decide an operation first), then ledger.resume and "
            "re-enter it"
        )
    return (
        "ledger.resume(run_id, by=...) first, then re-enter it: completed actions are "
        "replayed, not repeated"
    )


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
