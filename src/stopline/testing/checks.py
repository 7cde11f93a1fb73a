"""The rules the explorer checks after every cell, from the ledger and the providers' truth.

Each check reads plain records (``Observed``) and returns the violations it
found; nothing here does I/O. ``headline_for`` is bound at import time, so a
test that patches the receipt's headline (``stopline.testing.mutations``)
is judged against the real precedence.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

from stopline.domain.model import CancelState, EventRecord, OperationRecord, RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.receipt import headline_for as _headline_for
from stopline.domain.vocab import Headline, NoteKind, OpEvent, OpStatus, RunEvent
from stopline.testing.matrix import Violation
from stopline.testing.providers import FakeProvider

__all__ = ["Observed", "Truth", "check"]

_SAYS_COMMITTED = frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED})
_SAYS_NOT = frozenset({OpStatus.NOT_COMMITTED, OpStatus.PREVENTED})
_ANSWERS = frozenset({CancelState.CONFIRMED, CancelState.REFUSED})  # a FakeProvider's


@dataclasses.dataclass(frozen=True, slots=True)
class Truth:
    """What one tool's destination really holds for the run: its ground truth."""

    who: str  # how a violation names it: "provider 'mail'", "tool 'send_mail'"
    effects: Sequence[str]  # the keys of every effect committed, in order, repeats kept
    # what only a ``FakeProvider`` tells (None: not known, not checked)
    requests: Sequence[str] | None = None
    cancel_requests: Sequence[str] | None = None
    compensated: frozenset[str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """Everything one cell left behind: of the run's tree (the run and the child runs
    it owns exclusively), as its receipt tells them (S4)."""

    run: RunRecord
    ops: Sequence[OperationRecord]  # the tree's
    events: Sequence[EventRecord]  # the tree's, in ledger order
    receipt: Receipt  # as it stands once everything else was gathered
    settled: bool  # the run settled (after a crash: every operation resolved)
    providers: Mapping[str, FakeProvider]
    # (receipt, effects the providers had committed when it was returned), per cancel
    cancels: Sequence[tuple[Receipt, frozenset[str]]] = ()
    settled_receipt: Receipt | None = None  # what ``wait_settled`` returned
    cancel_after_settled: Receipt | None = None
    late: Sequence[str] = ()
    entries: int = 1
    crashed: bool = False
    recovered: bool = False
    # the user's own tools' ground truth (``explore(ground_truth=...)``): tool name ->
    # the keys of this run's effects its destination holds
    truth: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    error: str | None = None  # what the workflow raised, if it did
    # resumed and entered again (``CancelResume``): the effects by tool of a run never
    # cancelled, which the resumed run's may not exceed
    baseline: Mapping[str, int] | None = None

    @property
    def tree(self) -> tuple[str, ...]:
        """The ids of the run and of every child run with an operation in ``ops``."""
        return tuple(dict.fromkeys([self.run.id, *(op.run_id for op in self.ops)]))

    def truths(self) -> dict[str, Truth]:
        """Every ground truth known for this run, by tool name."""
        out = {name: Truth(f"tool {name!r}", tuple(keys)) for name, keys in self.truth.items()}
        tree = self.tree
        for name, p in self.providers.items():
            out[p.tool.name] = Truth(
                f"provider {name!r}",
                p.of_runs("effects", tree),
                p.of_runs("requests", tree),
                p.of_runs("cancel_requests", tree),
                frozenset(p.compensated),
            )
        return out

    def effects(self) -> list[tuple[str, str]]:
        """(who, key) of every effect a destination committed for this run, in order."""
        return [(t.who, key) for t in self.truths().values() for key in t.effects]

    def unverified(self) -> tuple[str, ...]:
        """The tools this run called whose effects no ground truth tells: R3 and R8
        could not be checked against them."""
        known, corrections = self.truths(), _corrections(self)
        return tuple(sorted({op.tool for op in self.ops if op.id not in corrections} - set(known)))

    def reviews(self) -> tuple[str, ...]:
        """``tool: why`` for each operation the run left to human review: what its
        read-back last said (a verifier that raised or gave no answer), else the
        evidence the review rests on. Not a broken rule: the report tells it, as a
        read-back that never works passes every cell on the reviewer's back."""
        said: dict[str, str] = {}
        for e in self.events:
            if e.op_id and e.kind in (NoteKind.VERIFY_FAILED, NoteKind.VERIFY_UNKNOWN):
                for ev in e.data.get("evidence", ()):
                    detail = str(ev.get("detail", ""))
                    raised = e.kind == NoteKind.VERIFY_FAILED
                    said[e.op_id] = f"the read-back raised {detail}" if raised else detail
            elif e.op_id and e.kind == OpEvent.CONFLICT and e.data.get("error"):
                said[e.op_id] = f"evidence in conflict: {e.data['error']}"
        out = []
        for op in self.ops:
            if op.status is OpStatus.NEEDS_REVIEW:
                last = op.evidence[-1] if op.evidence else None
                why = said.get(op.id) or (last.detail if last is not None else "")
                out.append(f"{op.tool}: {why}" if why else op.tool)
        return tuple(dict.fromkeys(out))


def check(seen: Observed, *, require_ground_truth: bool = False) -> tuple[list[Violation], bool]:
    """The violations, and whether the run waits on a recovery this runtime lacks.

    ``require_ground_truth``: a tool with no ground truth is a violation ("truth"),
    not a silence."""
    violations = [
        *_r1(seen),
        *_r2(seen),
        *_r3_r4(seen),
        *_r7(seen),
        *_r8(seen),
    ]
    if require_ground_truth:
        violations.extend(
            Violation(
                "truth",
                f"tool {tool!r} has no ground truth: R3/R8 were not checked against its "
                "effects (a FakeProvider, or explore(..., ground_truth=...))",
            )
            for tool in seen.unverified()
        )
    needs_recovery = seen.crashed and not seen.recovered and bool(_unresolved(seen))
    return violations, needs_recovery


def _own(seen: Observed) -> list[EventRecord]:
    """The run's own events (a child run's cancel is its parent's, delivered)."""
    return [e for e in seen.events if e.run_id == seen.run.id]


def _fenced(seen: Observed) -> list[tuple[int, float]]:
    """(the first cancel, the resume that lifted it or infinity), per fence of the run:
    a resume (``CancelResume``) lets the run dispatch again."""
    out: list[tuple[int, float]] = []
    fence: int | None = None
    for e in _own(seen):
        if e.kind == RunEvent.CANCEL and fence is None:
            fence = e.seq
        elif e.kind == RunEvent.RESUME and fence is not None:
            out.append((fence, e.seq))
            fence = None
    return [*out, (fence, float("inf"))] if fence is not None else out


def _passed(seen: Observed) -> Counter[str]:
    return Counter(e.op_id for e in seen.events if e.kind == OpEvent.GATE_PASSED and e.op_id)


def _corrections(seen: Observed) -> set[str]:
    """Compensations: they pass the gate under ``compensate``, which a cancel keeps (R7)."""
    return {op.id for op in seen.ops if getattr(op, "compensates", None)}


def _unresolved(seen: Observed) -> list[OperationRecord]:
    passed = _passed(seen)
    return [op for op in seen.ops if op.id in passed and not op.status.resolved]


def _r1(seen: Observed) -> Iterator[Violation]:
    """No dispatch after the fence (the run's cancel, which fences its tree): in ledger
    order, and at the providers."""
    corrections = _corrections(seen)
    for fence, lifted in _fenced(seen):
        for e in seen.events:
            if e.kind != OpEvent.GATE_PASSED or e.op_id in corrections:
                continue
            if fence < e.seq < lifted:
                yield Violation(
                    "R1", f"{e.op_id} passed the gate (seq {e.seq}) after the cancel (seq {fence})"
                )
    passed = _passed(seen)
    for truth in seen.truths().values():
        for key, n in Counter(truth.requests or ()).items():
            if n > passed[key]:
                yield Violation(
                    "R1",
                    f"{truth.who} received {key} {n} time(s); the gate recorded {passed[key]}",
                )


def _r2(seen: Observed) -> Iterator[Violation]:
    """Nothing is forgotten: every operation that passed the gate is in the ledger and,
    once the run settled, resolved or in review."""
    ids = {op.id for op in seen.ops}
    for op_id in _passed(seen):
        if op_id not in ids:
            yield Violation("R2", f"{op_id} passed the gate but is missing from the ledger")
    if seen.crashed and not seen.recovered:
        return  # "recover": only a recovery pass can resolve what the crash left
    if not seen.settled and not seen.crashed:
        yield Violation(
            "R2",
            f"the run did not settle in time: {seen.run.state.value}, "
            f"receipt {seen.receipt.headline.value}",
        )
    when = "once settled" if seen.settled else "when the wait for it ended"
    for op in _unresolved(seen):
        last = op.evidence[-1] if op.evidence else None
        why = f" (last evidence: {last.ref}: {last.detail})" if last is not None else ""
        yield Violation("R2", f"{op.id} is still {op.status.value} {when}{why}")


def _r3_r4(seen: Observed) -> Iterator[Violation]:
    """The ledger agrees with the providers' ground truth; late answers are kept."""
    ops = {op.id: op for op in seen.ops}
    corrections = _corrections(seen)
    for (who, key), n in Counter(seen.effects()).items():
        if n > 1 and key in corrections:  # a correction re-sent under its own key (R5)
            yield Violation("R3", f"{who} applied the correction {key} {n} times")
        elif n > 1:
            yield Violation("R3", f"{who} committed {key} {n} times")
    for who, key in dict.fromkeys(seen.effects()):
        op = ops.get(key)
        if op is None:
            yield Violation("R3", f"{who} committed {key}; the ledger has no record")
        elif op.status in _SAYS_NOT:
            yield Violation("R3", f"{key} is {op.status.value} in the ledger; {who} committed it")
        if op is not None and op.cancel_state is CancelState.CONFIRMED:
            # a confirmed cancel is evidence the effect never happened: the ledger may
            # have caught the lie (the response came: review), the canceller still told it
            yield Violation(
                "R3",
                f"{who} committed {key}, yet its canceller confirmed the cancel: a "
                "canceller confirms only a cancel that stopped the effect",
            )
    truths = seen.truths()
    for op in seen.ops:
        truth = truths.get(op.tool) if op.id not in corrections else None
        if truth is None:
            continue
        if op.status in _SAYS_COMMITTED and op.id not in truth.effects:
            yield Violation(
                "R3", f"{op.id} is {op.status.value} in the ledger; {truth.who} has no such effect"
            )
        if (
            op.status is OpStatus.COMPENSATED
            and truth.compensated is not None
            and op.id not in truth.compensated
        ):
            yield Violation(
                "R3", f"{op.id} is compensated in the ledger; {truth.who} corrected nothing"
            )
    yield from _answers(seen, corrections)
    if seen.entries > 1:
        yield Violation("R4", f"the workflow was started {seen.entries} times")
    if seen.baseline is not None:
        yield from _repeated(seen, seen.baseline)
    kept = {e.op_id for e in seen.events if e.data.get("late")}
    for op_id in seen.late:
        if op_id not in kept:
            yield Violation("R4", f"the late response for {op_id} was not kept as evidence")


def _repeated(seen: Observed, baseline: Mapping[str, int]) -> Iterator[Violation]:
    """R4 after a resume and a re-entry (``CancelResume``): no destination holds more
    effects than a run never cancelled makes (a call made again under another key)."""
    for tool, truth in seen.truths().items():
        done, once = len(truth.effects), baseline.get(tool, 0)
        if done > once:
            yield Violation(
                "R4",
                f"{truth.who} holds {done} effects after a cancel, a resume and the workflow "
                f"entered again; a run never cancelled makes {once}: the re-entered "
                "workflow repeated what was done",
            )


def _answers(seen: Observed, corrections: set[str]) -> Iterator[Violation]:
    """A ``FakeProvider``'s answer to a cancel is the one the ledger records (R14: worded
    as observed): a refusal is not a confirmation, nor an answer one never asked for."""
    providers = {p.tool.name: p for p in seen.providers.values()}
    for op in seen.ops:
        p = providers.get(op.tool)
        if p is None or op.id in corrections or op.cancel_state not in _ANSWERS:
            continue
        if op.id in p.refused:
            said = "refused"
        elif op.id in p.cancel_requests:
            said = "confirmed"
        else:
            said = "was never asked to cancel"
        if said != op.cancel_state.value:
            yield Violation(
                "R14",
                f"{op.id}: the ledger records the cancel {op.cancel_state.value}; "
                f"provider {p.name!r} {said}",
            )


def _r7(seen: Observed) -> Iterator[Violation]:
    """Cancel is idempotent: one cancellation, the same principal, one provider cancel."""
    count = sum(1 for e in _own(seen) if e.kind == RunEvent.CANCEL)
    if count > 1:
        yield Violation("R7", f"{count} cancel events for one run")
    by = {r.cancelled_by for r, _ in seen.cancels}
    if len(by) > 1:
        yield Violation("R7", f"cancels name different principals: {sorted(map(str, by))}")
    for truth in seen.truths().values():
        for key, n in Counter(truth.cancel_requests or ()).items():
            if n > 1:
                yield Violation("R7", f"{truth.who} was asked {n} times to cancel {key}")
    again, before = seen.cancel_after_settled, seen.settled_receipt
    if again is not None and before is not None and again != before:
        yield Violation(
            "R7",
            f"a cancel after settling changed the receipt: {before.headline.value} "
            f"-> {again.headline.value}",
        )


def _r8(seen: Observed) -> Iterator[Violation]:
    """The headline is the one the evidence justifies, and never denies an effect."""
    justified = _headline_for(seen.run, seen.ops)
    if seen.receipt.headline is not justified:
        yield Violation(
            "R8",
            f"headline {seen.receipt.headline.value}; the evidence justifies {justified.value}",
        )
    effects = frozenset(key for _, key in seen.effects())
    # which receipt said it: a cell's cancels and its final receipt read the same else
    said = [f"cancel #{n} returned" for n in range(1, len(seen.cancels) + 1)]
    judged = [*zip(said, seen.cancels, strict=True), ("the receipt says", (seen.receipt, effects))]
    for who, (receipt, done) in judged:
        if receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION and done:
            yield Violation(
                "R8",
                f"{who} '{receipt.message}' while effects were committed: {sorted(done)}",
            )
