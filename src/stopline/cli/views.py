"""What the operator surfaces show, read from the ledger: no typer, no HTML here.

The CLI and the web console both render these values, so a run reads the
same in a terminal, in ``--json`` and in a browser.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stopline.domain.advice import Do, Step, Terms, reading_back, reviewing
from stopline.domain.lifecycle import SYSTEM, Principal, operator
from stopline.domain.limits import check_id
from stopline.domain.model import EventRecord, Evidence, OperationRecord, RunRecord
from stopline.domain.receipt import horizon_words
from stopline.domain.transitions import REVIEW_OPS
from stopline.domain.vocab import EvidenceKind, LogKind, NoteKind, OpEvent, OpStatus, RunEvent
from stopline.errors import InvalidInput, StoplineError
from stopline.runtime.review import ReviewItem, ReviewVerdict

__all__ = [
    "CLI_TERMS",
    "MAX_NOTE_CHARS",
    "TimelineEntry",
    "UsageError",
    "acting_as",
    "check_note",
    "check_principal",
    "decide",
    "event_to_json",
    "lands_until",
    "op_to_json",
    "parse_age",
    "review_item_json",
    "run_to_json",
    "shell_command",
    "started_within",
    "timeline",
]

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
REVIEW_STATUSES = REVIEW_OPS  # what a reviewer decides
MAX_NOTE_CHARS = 1000  # a reviewer's note, kept whole as the decision's evidence
REVIEW_VERDICTS = frozenset(v.value for v in ReviewVerdict)


class UsageError(StoplineError):
    """A malformed argument (exit code 2)."""


def check_principal(what: str, principal: str) -> str:
    """``principal`` if an operator surface can record actions by it, else ``InvalidInput``
    naming ``what``: an id a ledger can hold, and not stopline's own (which the access
    policy refuses to anyone else: an action by it was refused as an unknown run, after
    its refusal was logged). Checked before the ledger is opened (the CLI's ``--by``) or
    at start and at each login (the console), never first at a cancel."""
    check_id(what, principal)
    if principal == SYSTEM.id:
        raise InvalidInput(what, f"{principal!r} is stopline's own principal: no one acts as it")
    return principal


def check_note(note: str) -> str:
    """A reviewer's note, which the decision's evidence keeps whole: one longer than
    ``MAX_NOTE_CHARS`` is ``InvalidInput``, refused before anything is written, in the
    CLI as in the console (the ledger cut a longer one silently, altering the record)."""
    if len(note) > MAX_NOTE_CHARS:
        raise InvalidInput("note", f"{len(note):,} characters; at most {MAX_NOTE_CHARS:,}")
    return note


def acting_as(principal: str) -> Principal:
    """The operator a command's ``--by`` names (``check_principal``)."""
    return operator(check_principal("by", principal))


# -- recovery steps as a shell user takes them (ADR 0066) ------------------------------
def shell_command(command: str, ids: Sequence[str], options: str = "") -> str:
    """``stopline <command> <ids> <options>`` as a shell user types it: each id quoted
    for a POSIX shell, and behind ``--`` (the options first) when one starts with ``-``,
    which the command would read as an option."""
    quoted = " ".join(shlex.quote(i) for i in ids)
    if any(i.startswith("-") for i in ids):
        return " ".join(part for part in ("stopline", command, options, "--", quoted) if part)
    return " ".join(part for part in ("stopline", command, quoted, options) if part)


def lands_until(horizon: float | None, now: float | None = None) -> str:
    """A horizon still ahead (R13), as the surfaces say it: "13:52:48 UTC", with its
    date when not today's; "" when none is recorded or it has passed."""
    now = time.time() if now is None else now
    if horizon is None or horizon <= now:
        return ""
    return horizon_words(horizon, now)


def decide(step: Step) -> str:
    """A review step's decisions as commands, for its one operation (``review show``
    says them too). While its effect may still land (its horizon, R13), ``--as
    not_committed`` is refused, so it is offered for after it (ADR 0092)."""
    committed = shell_command("review resolve", step.op_ids, "--as committed")
    not_committed = shell_command("review resolve", step.op_ids, "--as not_committed")
    until = lands_until(step.horizon)
    if not until:
        return f"`{committed}` or `{not_committed}`, as its evidence shows"
    return (
        f"`{committed}` if its evidence shows it happened, or `{not_committed}` if it did "
        f"not, only after {until}: its effect may still land until then"
    )


def _review(step: Step) -> str:
    if len(step.op_ids) == 1:
        how = f"`{shell_command('review show', step.op_ids)}`, then {decide(step)}"
    else:
        how = (
            "`stopline review list` names them; for each, "
            "`stopline review resolve OP --as committed` or `--as not_committed`, as its "
            "evidence shows"
        )
        until = lands_until(step.horizon)
        if until:
            how += (
                "; `--as not_committed` only once an operation's effect can no longer "
                f"land: for one of them, not before {until} (`stopline review show OP` says "
                "until when)"
            )
    return f"{reviewing(step)} ({how})"


CLI_TERMS: Terms = {
    # a cancel of a run cancelled already is that same cancel (R7): it only waits
    Do.WAIT: lambda step: (
        f"wait until it settles (`{shell_command('cancel', [step.run_id], '--wait')}` waits "
        "for it; the run is cancelled already, so nothing more is cancelled)"
        + reading_back(
            step,
            "a worker of your application opened with it, or `ledger.reconcile(tools=[...])` "
            "in one; not this command",
        )
    ),
    Do.REVIEW: _review,
    Do.RESUME: lambda step: f"resume with `{shell_command('resume', [step.run_id])}`",
    Do.REENTER: lambda step: "re-enter the run from your application with the same run id",
}


def parse_age(text: str) -> float:
    """``90s``, ``15m``, ``1h``, ``2d``, ``1w`` -> seconds."""
    match = _AGE.match(text)
    if match is None:
        raise UsageError(f"bad age {text!r}: use a number and a unit s, m, h, d or w (e.g. 2h)")
    return float(match.group(1)) * _UNIT[match.group(2)]


def started_within(since: float | None) -> Callable[[RunRecord], bool]:
    """Whether a run started within ``since`` seconds of now (any run without it)."""
    cutoff = -math.inf if since is None else time.time() - since
    return lambda run: run.created_at >= cutoff


def run_to_json(run: RunRecord) -> dict[str, Any]:
    return {
        "id": run.id,
        "name": run.name,
        "owner": run.owner,
        "tenant": run.tenant,
        "parent_id": run.parent_id,
        "state": run.state.value,
        "phase": run.phase.value if run.phase else None,
        "policy": run.policy.value,
        "fence": run.fence,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "cancelled_by": run.cancelled_by,
        "cancel_reason": run.cancel_reason,
        "cancelled_at": run.cancelled_at,
    }


def op_to_json(op: OperationRecord) -> dict[str, Any]:
    return {
        "id": op.id,
        "run_id": op.run_id,
        "tool": op.tool,
        "description": op.description,
        "status": op.status.value,
        "cancellable": op.cancellable.value,
        "can_verify": op.can_verify,
        "can_compensate": op.can_compensate,
        "cancel_state": op.cancel_state,
        "attempts": op.attempts,
        "error": op.error,
        "cause": op.cause.value if op.cause else None,
        "evidence": [e.to_json() for e in op.evidence],
        "horizon": op.horizon,  # R13: recorded, until when its effect could still land
        "created_at": op.created_at,
        "updated_at": op.updated_at,
    }


def event_to_json(event: EventRecord) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "at": event.at,
        "run_id": event.run_id,
        "op_id": event.op_id,
        "kind": event.kind,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "data": dict(event.data),
    }


# -- the timeline ------------------------------------------------------------------
_WORDS: dict[str, str] = {
    LogKind.RUN_CREATED: "run started",
    LogKind.PHASE: "phase entered",
    RunEvent.CANCEL: "cancel committed: the fence is raised, initiate revoked",
    RunEvent.SETTLE: "settling: waiting for in-flight operations",
    RunEvent.SETTLED: "settled: every operation resolved",
    RunEvent.ESCALATE: "needs review: an outcome cannot be determined",
    RunEvent.REVIEWED: "review finished",
    RunEvent.COMPLETE: "run completed",
    RunEvent.FAIL: "run failed",
    RunEvent.PAUSE: "pause requested",
    RunEvent.PAUSED: "paused",
    RunEvent.RESUME: "resumed",
    OpEvent.GATE_PASSED: "passed the dispatch gate: intent recorded",
    OpEvent.GATE_REFUSED: "refused at the dispatch gate",
    OpEvent.ACCEPTED: "accepted by the provider",
    OpEvent.COMMITTED: "response proves it committed",
    OpEvent.REJECTED: "provider refused before commit",
    OpEvent.NOT_SENT: "abandoned before the first byte left",
    OpEvent.LOST: "no answer: outcome unknown",
    OpEvent.CANCEL_CONFIRMED: "provider confirmed the cancel",
    NoteKind.CANCEL_ASKED: "provider asked to cancel",
    NoteKind.CANCEL_REFUSED: "provider refused the cancel",
    NoteKind.CANCEL_ERROR: "the cancel request ended in an error",
    NoteKind.CANCEL_ACKNOWLEDGED: "provider acknowledged the cancel",
    NoteKind.TASK_CANCEL_REQUESTED: "tasks/cancel sent for the call's task",
    OpEvent.VERIFIED_COMMITTED: "read-back found it committed",
    OpEvent.VERIFIED_NOT_COMMITTED: "read-back found it did not happen",
    OpEvent.ESCALATED: "handed to human review",
    OpEvent.CONFLICT: "evidence contradicts the recorded outcome",
    OpEvent.REVIEWED_COMMITTED: "reviewer decided: committed",
    OpEvent.REVIEWED_NOT_COMMITTED: "reviewer decided: not committed",
    OpEvent.REVIEWED_CORRECTED: "reviewer decided: committed; it stays corrected",
    OpEvent.COMPENSATION_STARTED: "correction started",
    OpEvent.COMPENSATED: "corrected",
    OpEvent.COMPENSATION_FAILED: "correction failed",
    NoteKind.PROGRESS: "progress reported",
    NoteKind.VERIFY_UNKNOWN: "read-back could not tell",
    NoteKind.VERIFY_FAILED: "read-back failed",
    NoteKind.READ_BEFORE_RETRY: "read-back of an earlier attempt, kept as evidence",
    NoteKind.LATE_RESPONSE: "late response kept as evidence",
    NoteKind.REPEAT_ANSWERED: "a later call repeating it was answered from this record",
}


@dataclasses.dataclass(frozen=True, slots=True)
class TimelineEntry:
    seq: int
    at: float
    kind: str
    op_id: str | None
    subject: str  # "run" or the operation's description
    words: str
    transition: str  # "from -> to", or ""
    detail: str
    evidence: tuple[Evidence, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "at": self.at,
            "kind": self.kind,
            "op_id": self.op_id,
            "subject": self.subject,
            "words": self.words,
            "transition": self.transition,
            "detail": self.detail,
            "evidence": [e.to_json() for e in self.evidence],
        }


def _detail(event: EventRecord) -> str:
    data: Mapping[str, Any] = event.data
    parts = []
    if event.kind == LogKind.PHASE:
        parts.append(f"{data.get('phase')} ({data.get('policy')})")
    keys = ("owner", "cut_by", "by", "channel", "reason", "cause", "error", "detail", "message")
    for key in keys:
        value = data.get(key)
        if value:
            parts.append(f"{key.replace('_', ' ')}: {value}")
    owners = data.get("owners")  # a run left to its owners (R6): which
    if isinstance(owners, list) and owners:
        parts.append("owners: " + ", ".join(str(owner) for owner in owners))
    if data.get("late"):
        parts.append("late")
    if data.get("retry"):
        parts.append("retry")
    return "; ".join(parts)


def _evidence(event: EventRecord) -> tuple[Evidence, ...]:
    raw = event.data.get("evidence") or ()
    out = []
    for item in raw:
        try:
            out.append(Evidence.from_json(item))
        except (KeyError, ValueError, TypeError):
            continue
    return tuple(out)


# an operation's disputed outcome: the event that recorded it (if shown), the conflict
Disputed = tuple["TimelineEntry | None", "TimelineEntry"]
_DECIDED = frozenset(
    {OpEvent.REVIEWED_COMMITTED, OpEvent.REVIEWED_NOT_COMMITTED, OpEvent.REVIEWED_CORRECTED}
)


def _decision(entry: TimelineEntry, disputed: Disputed | None) -> str:
    """A reviewer's decision as it happened: who decided, on what (their note), and,
    for an item in review because evidence contradicted its recorded outcome, which of
    the two the decision overrules."""
    parts = []
    for item in entry.evidence:
        if item.kind is EvidenceKind.REVIEW:
            parts.append(f"decided by: {item.ref}")
            verdict, _, note = item.detail.partition(": ")
            if note and verdict in REVIEW_VERDICTS:
                parts.append(f"note: {note}")
            elif item.detail not in REVIEW_VERDICTS:
                parts.append(f"note: {item.detail}")
            else:
                parts.append("no note given")
            break
    if disputed is not None:
        recorded, conflict = disputed
        was = conflict.transition.partition(" -> ")[0]  # the outcome the evidence contradicts
        against = ", ".join(f"{e.kind.value}:{e.ref}" for e in conflict.evidence) or "evidence"
        against = f"the contradicting {against} ({fmt_time(conflict.at, clock=True)})"
        kept = (was != OpStatus.NOT_COMMITTED) == (entry.kind != OpEvent.REVIEWED_NOT_COMMITTED)
        if kept:
            parts.append(f"overrules {against}; the recorded {was} stands")
        else:
            how = f" ({recorded.words}, {fmt_time(recorded.at, clock=True)})" if recorded else ""
            parts.append(f"overrules the recorded {was}{how}, as {against} says")
    return "; ".join(parts)


def timeline(events: Sequence[EventRecord], ops: Sequence[OperationRecord]) -> list[TimelineEntry]:
    """Every ledger event of a run in order, in plain words, with its evidence; a
    reviewer's decision with who made it, their note, and what it overrules."""
    names = {op.id: op.description or op.tool for op in ops}
    out: list[TimelineEntry] = []
    moved: dict[str, TimelineEntry] = {}  # by operation: the event that last moved it
    disputed: dict[str, Disputed] = {}
    for event in events:
        words = _WORDS.get(event.kind, event.kind.replace("_", " "))
        if event.kind.startswith("evidence_"):
            words = f"{event.kind.removeprefix('evidence_')} again: kept as evidence"
        moved_now = event.from_state != event.to_state and event.to_state is not None
        transition = f"{event.from_state or '-'} -> {event.to_state}" if moved_now else ""
        entry = TimelineEntry(
            seq=event.seq,
            at=event.at,
            kind=event.kind,
            op_id=event.op_id,
            subject=names.get(event.op_id, event.op_id) if event.op_id else "run",
            words=words,
            transition=transition,
            detail=_detail(event),
            evidence=_evidence(event),
        )
        op_id = event.op_id
        if op_id and event.kind in _DECIDED:
            decided = _decision(entry, disputed.pop(op_id, None))
            detail = "; ".join(part for part in (decided, entry.detail) if part)
            entry = dataclasses.replace(entry, detail=detail)
        elif op_id and event.kind == OpEvent.CONFLICT:
            disputed[op_id] = (moved.get(op_id), entry)
        if op_id and moved_now:
            moved[op_id] = entry
        out.append(entry)
    return out


def review_item_json(item: ReviewItem) -> dict[str, Any]:
    """An item of the review queue as the CLI prints it."""
    return {"run": run_to_json(item.run), "operation": op_to_json(item.op)}


def fmt_time(at: float | None, *, clock: bool = False) -> str:
    """Local time; ``clock`` gives only the time of day, to the millisecond."""
    if at is None:
        return ""
    if clock:
        return time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def fmt_seconds(value: float | None) -> str:
    """A duration: ``3.8 ms`` under a second, else ``1.25 s``; ``-`` for none."""
    return "-" if value is None else f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def fmt_age(at: float, now: float | None = None) -> str:
    seconds = max(0.0, (now or time.time()) - at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
