"""Truth after the fact: reconciliation, compensation, the review queue, crash recovery.

``TruthMixin`` gives ``Ledger`` its methods for closing the loop on what
passed the gate (CONTRACT.md R2, R3, R5, R8, R12). The work is done in
``reconcile``, ``compensate``, ``review`` and ``recovery``; this module is
the public face and the one place each is authorized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from stopline.domain.lifecycle import Action, Principal
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import RunState
from stopline.runtime.compensate import CompensationContext, Compensator
from stopline.runtime.context import CallContext
from stopline.runtime.reconcile import Reconciler, ReconcileSummary
from stopline.runtime.recovery import RecoveryReport, Workers
from stopline.runtime.review import ReviewCase, ReviewItem, ReviewVerdict
from stopline.runtime.review import inspect as _inspect
from stopline.runtime.review import items as _items
from stopline.runtime.review import resolve as _resolve_review

if TYPE_CHECKING:
    from stopline.domain.receipt import Receipt
    from stopline.runtime.ledger import Ledger, VerifyBudget
    from stopline.runtime.tool import Tool

__all__ = ["TruthMixin"]

_T = TypeVar("_T")


class TruthMixin:
    """Methods of ``Ledger`` about what happened after dispatch."""

    # -- parts, made on first use (Ledger.__init__ belongs to the core) ------------
    @property
    def _me(self) -> Ledger:
        return cast("Ledger", self)

    @property
    def _workers(self) -> Workers:
        return self._part("_truth_workers", Workers)

    @property
    def _reconciler(self) -> Reconciler:
        return self._part("_truth_reconciler", Reconciler)

    @property
    def _compensator(self) -> Compensator:
        return self._part("_truth_compensator", Compensator)

    def _part(self, name: str, make: Callable[[Ledger], _T]) -> _T:
        part = self.__dict__.get(name)
        if part is None:
            part = self.__dict__[name] = make(self._me)
        return cast(_T, part)

    @property
    def lease(self) -> float:
        """Seconds a worker's lease lasts; renewed at a third of it."""
        return self._workers.lease

    @lease.setter
    def lease(self, seconds: float) -> None:
        self._workers.lease = seconds

    # -- authority: the one place truth actions are checked (R11) -----------------
    async def _authorize_truth(self, by: str | Principal, action: Action, run_id: str) -> str:
        principal, _ = await self._me.authorize(by, action, run_id)
        return principal.id

    # -- crash recovery (R2, S17) ---------------------------------------------------
    async def recover(self) -> RecoveryReport:
        """Register this worker, mark what dead workers left in flight ``unknown``,
        queue every unknown operation for verification, and keep the lease alive.

        ``Ledger.__aenter__`` calls it; it reads only the open-operations index.
        """
        report = await self._workers.recover()
        self._me.spawn(self._workers.keep_alive)
        self._me.spawn(self._advance_stranded)
        return report

    async def _advance_stranded(self) -> None:
        """Cancelled runs a closed or dead worker left before settling them: move them on
        (their operations are resolved or being reconciled; the settler decides)."""
        for state in (RunState.CANCELLING, RunState.SETTLING):
            for run in await self._me.backend.list_runs(state=state, limit=10_000):
                if run.id not in self._me._local:
                    await self._me._settler.advance(run.id)

    async def _retire(self) -> None:
        await self._workers.retire()

    # -- reconciliation (R3, R5) ----------------------------------------------------------
    async def reconcile(
        self,
        *,
        tools: Iterable[Tool[Any]] = (),
        budget: VerifyBudget | None = None,
        accepted_after: float = 300.0,
        limit: int = 10_000,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> ReconcileSummary:
        """One pass over every operation in doubt: read back, never re-send.

        ``tools`` are registered first (an operation whose tool is not registered
        here is left for a process that has it, and counted as ``not_here``).
        ``on_progress(done, total)`` is called as operations are checked.
        """
        return await self._reconciler.run(
            tools=tools,
            budget=budget,
            accepted_after=accepted_after,
            limit=limit,
            on_progress=on_progress,
        )

    async def _call_context(self, op: OperationRecord, tool: Tool[Any]) -> CallContext:
        """The context a verifier (or compensator) of ``op`` receives."""
        if op.compensates is None:
            return CallContext(self._me, op.run_id, op.id, tool)
        original = await self._me.backend.get_operation(op.compensates)
        return CompensationContext(self._me, original, op.id, tool)

    # -- compensation (S8) ---------------------------------------------------------------
    async def compensate(
        self, op_id: str, *, by: str | Principal, reason: str = "", wait: bool = True
    ) -> OperationRecord:
        """Correct a committed operation with its tool's compensator (R7: a cancel of
        the run does not stop it). Returns the corrected operation: ``compensated``,
        ``compensating`` (``wait=False``, or the correction's outcome is in doubt), or
        ``needs_review`` (the correction failed)."""
        op = await self._me.backend.get_operation(op_id)
        who = await self._authorize_truth(by, Action.COMPENSATE, op.run_id)
        await self._start_compensation(op_id, by=who, reason=reason)
        if wait:
            await self._compensator.wait(op_id)
        return await self._me.backend.get_operation(op_id)

    async def _start_compensation(self, op_id: str, *, by: str, reason: str) -> OperationRecord:
        # approval hook: a policy requiring an approval for corrections checks it here
        return await self._compensator.start(op_id, by=by, reason=reason)

    async def stop_compensation(self, op_id: str, *, by: str | Principal, reason: str = "") -> bool:
        """Interrupt the correction of ``op_id`` running in this process (R7's explicit ask).

        The ask is recorded either way; returns whether a running correction was
        interrupted here. Its outcome becomes ``unknown`` and is verified as usual.
        """
        op = await self._me.backend.get_operation(op_id)
        who = await self._authorize_truth(by, Action.STOP_COMPENSATION, op.run_id)
        await self._me.backend.note(op_id, "compensation_stop_asked", {"by": who, "reason": reason})
        return self._compensator.stop(op_id)

    async def _auto_compensate(self, ops: list[OperationRecord]) -> bool:
        return await self._compensator.on_cancel(ops)

    def _after_truth_change(self, op: OperationRecord) -> None:
        """Called on every recorded change: a settled correction settles its link."""
        if op.compensates is not None and op.status.resolved:
            self._me.spawn(self._compensator.link, op)

    # -- the review queue ---------------------------------------------------------------
    async def review_items(self, *, limit: int = 1000) -> list[ReviewItem]:
        """Operations waiting for a human (``needs_review``, failed corrections)."""
        return await _items(self._me, limit=limit)

    async def inspect_review(self, op_id: str) -> ReviewCase:
        """One item with its run, all its evidence, its events and its corrections."""
        return await _inspect(self._me, op_id)

    async def resolve_review(
        self,
        op_id: str,
        verdict: str | ReviewVerdict,
        *,
        by: str | Principal,
        note: str = "",
    ) -> Receipt:
        """Decide an item as ``committed``, ``not_committed`` or ``compensate``; the
        reviewer and the note are recorded as ``review`` evidence. Returns the receipt."""
        decision = ReviewVerdict.parse(verdict)
        op = await self._me.backend.get_operation(op_id)
        who = await self._authorize_truth(by, Action.RESOLVE_REVIEW, op.run_id)
        return await _resolve_review(self._me, op_id, decision, by=who, note=note)
