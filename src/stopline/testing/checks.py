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

from stopline.domain.model import EventRecord, OperationRecord, RunRecord
from stopline.domain.receipt import Receipt
from stopline.domain.receipt import headline_for as _headline_for
from stopline.domain.vocab import Headline, OpEvent, OpStatus, RunEvent
from stopline.testing.matrix import Violation
from stopline.testing.providers import FakeProvider

__all__ = ["Observed", "check"]

_SAYS_COMMITTED = frozenset({OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED})
_SAYS_NOT = frozenset({OpStatus.NOT_COMMITTED, OpStatus.PREVENTED})


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """Everything one cell left behind."""

    run: RunRecord
    ops: Sequence[OperationRecord]
    events: Sequence[EventRecord]
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

    def effects(self) -> list[tuple[str, str]]:
        """(provider, key) of every effect a provider committed for this run, in order."""
        return [
            (name, key)
            for name, provider in self.providers.items()
            for key in provider.of_run("effects", self.run.id)
        ]


def check(seen: Observed) -> tuple[list[Violation], bool]:
    """The violations, and whether the run waits on a recovery this runtime lacks."""
    violations = [
        *_r1(seen),
        *_r2(seen),
        *_r3_r4(seen),
        *_r7(seen),
        *_r8(seen),
    ]
    needs_recovery = seen.crashed and not seen.recovered and bool(_unresolved(seen))
    return violations, needs_recovery


def _passed(seen: Observed) -> Counter[str]:
    return Counter(e.op_id for e in seen.events if e.kind == OpEvent.GATE_PASSED and e.op_id)


def _corrections(seen: Observed) -> set[str]:
    """Compensations: they pass the gate under ``compensate``, which a cancel keeps (R7)."""
    return {op.id for op in seen.ops if getattr(op, "compensates", None)}


def _unresolved(seen: Observed) -> list[OperationRecord]:
    passed = _passed(seen)
    return [op for op in seen.ops if op.id in passed and not op.status.resolved]


def _r1(seen: Observed) -> Iterator[Violation]:
    """No dispatch after the fence: in ledger order, and at the providers."""
    cancels = [e.seq for e in seen.events if e.kind == RunEvent.CANCEL]
    if cancels:
        fence, corrections = min(cancels), _corrections(seen)
        for e in seen.events:
            if e.kind == OpEvent.GATE_PASSED and e.seq > fence and e.op_id not in corrections:
                yield Violation(
                    "R1", f"{e.op_id} passed the gate (seq {e.seq}) after the cancel (seq {fence})"
                )
    passed = _passed(seen)
    for name, provider in seen.providers.items():
        received = Counter(provider.of_run("requests", seen.run.id))
        for key, n in received.items():
            if n > passed[key]:
                yield Violation(
                    "R1",
                    f"provider {name!r} received {key} {n} time(s); "
                    f"the gate recorded {passed[key]}",
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
            f"the run did not settle: {seen.run.state.value}, "
            f"receipt {seen.receipt.headline.value}",
        )
    for op in _unresolved(seen):
        yield Violation("R2", f"{op.id} is still {op.status.value} once settled")


def _r3_r4(seen: Observed) -> Iterator[Violation]:
    """The ledger agrees with the providers' ground truth; late answers are kept."""
    ops = {op.id: op for op in seen.ops}
    for (name, key), n in Counter(seen.effects()).items():
        if n > 1:
            yield Violation("R3", f"provider {name!r} committed {key} {n} times")
    for name, key in dict.fromkeys(seen.effects()):
        op = ops.get(key)
        if op is None:
            yield Violation("R3", f"provider {name!r} committed {key}; the ledger has no record")
        elif op.status in _SAYS_NOT:
            yield Violation(
                "R3", f"{key} is {op.status.value} in the ledger; provider {name!r} committed it"
            )
    by_tool = {p.tool.name: p for p in seen.providers.values()}
    corrections = _corrections(seen)
    for op in seen.ops:
        provider = by_tool.get(op.tool) if op.id not in corrections else None
        if (
            provider is not None
            and op.status in _SAYS_COMMITTED
            and op.id not in provider.committed
        ):
            yield Violation(
                "R3",
                f"{op.id} is {op.status.value} in the ledger; "
                f"provider {provider.name!r} has no such effect",
            )
    if seen.entries > 1:
        yield Violation("R4", f"the workflow was started {seen.entries} times")
    kept = {e.op_id for e in seen.events if e.data.get("late")}
    for op_id in seen.late:
        if op_id not in kept:
            yield Violation("R4", f"the late response for {op_id} was not kept as evidence")


def _r7(seen: Observed) -> Iterator[Violation]:
    """Cancel is idempotent: one cancellation, the same principal, one provider cancel."""
    count = sum(1 for e in seen.events if e.kind == RunEvent.CANCEL)
    if count > 1:
        yield Violation("R7", f"{count} cancel events for one run")
    by = {r.cancelled_by for r, _ in seen.cancels}
    if len(by) > 1:
        yield Violation("R7", f"cancels name different principals: {sorted(map(str, by))}")
    for name, provider in seen.providers.items():
        for key, n in Counter(provider.of_run("cancel_requests", seen.run.id)).items():
            if n > 1:
                yield Violation("R7", f"provider {name!r} was asked {n} times to cancel {key}")
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
    judged = [*((r, e) for r, e in seen.cancels), (seen.receipt, effects)]
    for receipt, done in judged:
        if receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION and done:
            yield Violation(
                "R8",
                f"'{receipt.message}' while providers had committed {sorted(done)}",
            )
