"""Truth after the fact: reconciliation, compensation, the review queue, crash recovery.

``Truth`` is the component of ``Ledger`` that closes the loop on what passed
the gate (CONTRACT.md R2, R3, R5, R8, R12). The work is done in
``reconcile``, ``compensate``, ``review`` and ``recovery``; this module is
their face and the one place each is authorized (through ``Lifecycle``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from stopline.domain.lifecycle import Action, Principal
from stopline.domain.limits import check_limit, check_wait
from stopline.domain.model import OperationRecord
from stopline.domain.transitions import REVIEW_OPS
from stopline.domain.vocab import NoteKind, RunState
from stopline.runtime.boundary import retryable
from stopline.runtime.reconcile import Reconciler, ReconcileSummary
from stopline.runtime.recovery import RecoveryReport, Workers
from stopline.runtime.review import ReviewCase, ReviewItem, ReviewVerdict
from stopline.runtime.review import inspect as _inspect
from stopline.runtime.review import items as _items
from stopline.runtime.review import resolve as _resolve_review

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.lifecycle import Lifecycle
    from stopline.runtime.settle import VerifyBudget
    from stopline.runtime.tool import Tool

__all__ = ["Truth"]


class Truth:
    """Recovery, reconciliation, compensation and review, over the runtime's ``Core``."""

    def __init__(self, core: Core, lifecycle: Lifecycle) -> None:
        self._core = core
        self._lifecycle = lifecycle  # authority: who may correct, stop, resolve (R11)
        self._kept_alive = False  # the lease's one loop runs (a second recover adds none)
        self.workers = Workers(core)
        self._reconciler = Reconciler(core, self.workers)

    # -- authority: the one place truth actions are checked (R11) -----------------
    async def _authorize(self, by: str | Principal, action: Action, op_id: str) -> str:
        # a correction runs, and a decision settles, in the ledger's loop: its background
        # work started from another thread's loop ended with that loop, unfinished (ADR
        # 0086, amendment); refused there before anything is read or written
        self._core.at_home(f"{action.value} of {op_id!r} is asked")
        op = await self._core.backend.get_operation(op_id)
        principal, _ = await self._lifecycle.authorize(by, action, op.run_id)
        return principal.id

    # -- crash recovery (R2, S17) ---------------------------------------------------
    async def recover(self) -> RecoveryReport:
        """Register this worker, mark what dead workers left in flight ``unknown``,
        queue every unknown operation for verification, and keep the lease alive."""
        report = await self.workers.recover()
        if not self._kept_alive:  # one loop renews the lease and sweeps, however many calls
            self._kept_alive = True
            self._core.spawn(self._keep_alive)
        self._core.spawn(self._advance_stranded)
        return report

    async def _keep_alive(self) -> None:
        """The lease's loop (its error boundary runs it again after a fault that may
        clear); one the boundary gave up on is started again by the next ``recover``."""
        try:
            await self.workers.keep_alive()
        except Exception as exc:
            if not retryable(exc):
                self._kept_alive = False
            raise

    async def _advance_stranded(self) -> None:
        """Cancelled runs a closed or dead worker left before settling them: move them on
        (their operations are resolved or being reconciled; the settler decides)."""
        core = self._core
        for state in (RunState.CANCELLING, RunState.SETTLING):
            runs = await core.backend.list_runs(state=state, limit=10_000)
            # together: a tree's runs settle in one step (run by run, each child's
            # settling stepped its owner, which read the whole tree again: 9 s for 500)
            await core.settler.advance_many([r.id for r in runs if r.id not in core.runs])
        # settled runs whose call went back to review, their step lost with the worker that
        # recorded it (ADR 0093): the review queue (an index of open calls) names them
        in_review = await core.backend.unresolved(10_000, statuses=REVIEW_OPS)
        await core.settler.advance_many(sorted({op.run_id for op in in_review} - core.runs.keys()))

    async def retire(self) -> None:
        await self.workers.retire()

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
        return await self._reconciler.run(
            tools=tools,
            budget=budget,
            accepted_after=check_wait("accepted_after", accepted_after),
            limit=check_limit("limit", limit),
            on_progress=on_progress,
        )

    # -- compensation (S8) ---------------------------------------------------------------
    async def compensate(
        self, op_id: str, *, by: str | Principal, reason: str = "", wait: bool = True
    ) -> OperationRecord:
        compensator = self._core.compensator
        who = await self._authorize(by, Action.COMPENSATE, op_id)
        await compensator.start(op_id, by=who, reason=reason)
        if wait:
            await compensator.wait(op_id)
        return await self._core.backend.get_operation(op_id)

    async def stop_compensation(self, op_id: str, *, by: str | Principal, reason: str = "") -> bool:
        who = await self._authorize(by, Action.STOP_COMPENSATION, op_id)
        await self._core.backend.note(
            op_id, NoteKind.COMPENSATION_STOP_ASKED, {"by": who, "reason": reason}
        )
        return self._core.compensator.stop(op_id)

    # -- the review queue ---------------------------------------------------------------
    async def review_items(self, *, limit: int = 1000) -> list[ReviewItem]:
        return await _items(self._core, limit=limit)

    async def inspect_review(self, op_id: str) -> ReviewCase:
        return await _inspect(self._core, op_id)

    async def resolve_review(
        self, op_id: str, verdict: str | ReviewVerdict, *, by: str | Principal, note: str = ""
    ) -> OperationRecord:
        """Record a reviewer's decision; returns the operation as decided."""
        decision = ReviewVerdict.parse(verdict)
        who = await self._authorize(by, Action.RESOLVE_REVIEW, op_id)
        return await _resolve_review(self._core, op_id, decision, by=who, note=note)
