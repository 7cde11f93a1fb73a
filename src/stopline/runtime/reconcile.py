"""Reconciliation: proving what happened to every operation in doubt (R3, R5).

One pass takes every operation left ``unknown`` (after marking what dead
workers left in flight ``unknown`` first) and every operation ``accepted``
for longer than ``accepted_after`` seconds, and reads its destination by
idempotency key through the tool's verifier, with backoff, within a budget.
It never sends a write (R5). Outcomes:

- ``committed`` / ``not_committed``: a read-back proved it;
- ``needs_review``: the budget was spent, or the tool declares no verifier;
- left alone: the tool is not registered in this process (pass it with
  ``tools=[...]``), or an ``accepted`` operation whose provider is still working.

A long-``accepted`` operation is only peeked at: one read-back, recorded if
it proves something, never escalated (its worker may still be waiting on it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.model import Evidence, OperationRecord
from stopline.domain.vocab import EvidenceKind, OpEvent, OpStatus
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.boundary import typed
from stopline.runtime.compensate import context_for
from stopline.runtime.readback import ask
from stopline.runtime.tool import Tool, Verdict

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.recovery import Workers
    from stopline.runtime.settle import VerifyBudget

__all__ = ["ReconcileSummary", "Reconciler"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReconcileSummary:
    """What one reconciliation pass did, operation ids by outcome."""

    recovered: tuple[str, ...] = ()  # left in flight by a dead worker, marked unknown
    committed: tuple[str, ...] = ()
    not_committed: tuple[str, ...] = ()
    needs_review: tuple[str, ...] = ()
    still_unknown: tuple[str, ...] = ()  # no read-back answer yet, budget left elsewhere
    still_accepted: tuple[str, ...] = ()
    not_here: tuple[str, ...] = ()  # their tool is not registered in this process

    @property
    def checked(self) -> int:
        return sum(
            len(ids)
            for ids in (
                self.committed,
                self.not_committed,
                self.needs_review,
                self.still_unknown,
                self.still_accepted,
                self.not_here,
            )
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checked": self.checked}
        out.update({f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)})
        return out

    def __str__(self) -> str:
        parts = [
            f"{len(getattr(self, f.name))} {f.name.replace('_', ' ')}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name)
        ]
        return f"reconciled {self.checked} operation(s): " + (", ".join(parts) or "nothing to do")


class Reconciler:
    def __init__(self, core: Core, workers: Workers) -> None:
        self._core = core
        self._workers = workers

    async def run(
        self,
        *,
        tools: Iterable[Tool[Any]] = (),
        budget: VerifyBudget | None = None,
        accepted_after: float = 300.0,
        limit: int = 10_000,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> ReconcileSummary:
        core = self._core
        settler = core.settler
        for tool in tools:
            core.register_tool(tool)
        async with settler.working():
            earlier = self._workers.take_unreported()  # the open's recovery took them
            _, swept = await self._workers.sweep()
            recovered = [*earlier, *swept]
            open_ops = await core.backend.unresolved(limit)
            for op in recovered:
                core.changed(op.run_id)
            now = time.time()
            unknown = [op for op in open_ops if op.status is OpStatus.UNKNOWN]
            accepted = [
                op
                for op in open_ops
                if op.status is OpStatus.ACCEPTED and op.updated_at < now - accepted_after
            ]
            finals: dict[str, OperationRecord] = {}
            total = len(unknown) + len(accepted)
            if on_progress is not None:
                on_progress(0, total)

            async def one(op: OperationRecord) -> None:  # its read-backs take a slot each
                if op.status is OpStatus.UNKNOWN:
                    finals[op.id] = await settler.verify_with_budget(op, budget)
                else:
                    finals[op.id] = await self.peek_accepted(op, budget)
                if on_progress is not None:
                    on_progress(len(finals), total)

            try:
                async with anyio.create_task_group() as tg:
                    for op in [*unknown, *accepted]:
                        tg.start_soon(one, op)
            except BaseExceptionGroup as group:  # the ledger failed under the reads: typed
                error = typed(group)
                if error is group:
                    raise
                raise error from group
            for op in earlier:  # resolved since (a review), or still open: as it is now
                if op.id not in finals:
                    finals[op.id] = await core.backend.get_operation(op.id)
            for run_id in {op.run_id for op in finals.values()}:
                await settler.advance(run_id)
        return _summary(recovered, finals, settler.can_verify_here)

    async def peek_accepted(
        self, op: OperationRecord, budget: VerifyBudget | None = None
    ) -> OperationRecord:
        """One read-back of an operation accepted long ago; recorded only if it proves."""
        core = self._core
        tool = core.tools.get(op.tool)
        verify_fn = None if tool is None else tool.verify_fn
        if tool is None or verify_fn is None or op.compensates is not None:
            return op
        ctx = await context_for(core, op, tool)
        try:
            limit = (budget or core.verify_budget).read_timeout
            read = await ask(verify_fn, ctx, limit, core.settler.read_slots)
        except Exception:
            return op
        if read.verdict is Verdict.UNKNOWN or core.settler.not_yet(op, read, in_flight=True):
            return op
        evidence = [Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", read.detail)]
        if read.verdict is Verdict.COMMITTED:
            update = OutcomeUpdate(
                OpEvent.COMMITTED, evidence, result=read.result, has_result=read.result is not None
            )
        else:  # "never will": the provider dropped it (past the horizon, or it said so)
            update = OutcomeUpdate(OpEvent.REJECTED, evidence, error="read-back: not committed")
        return await core.outcomes.resolve(op.id, update)


def _summary(
    recovered: list[OperationRecord],
    finals: dict[str, OperationRecord],
    verifiable_here: Any,
) -> ReconcileSummary:
    by: dict[str, list[str]] = {}
    for op in finals.values():
        if op.status is OpStatus.UNKNOWN and not verifiable_here(op):
            key = "not_here"
        elif op.status in (OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED):
            key = "committed"
        elif op.status is OpStatus.NOT_COMMITTED:
            key = "not_committed"
        elif op.status in (OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED):
            key = "needs_review"
        elif op.status is OpStatus.ACCEPTED:
            key = "still_accepted"
        else:
            key = "still_unknown"
        by.setdefault(key, []).append(op.id)
    return ReconcileSummary(
        recovered=tuple(op.id for op in recovered),
        **{key: tuple(sorted(ids)) for key, ids in by.items()},
    )
