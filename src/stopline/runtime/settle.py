"""After a cancel: ask providers, verify unknowns, settle the run.

``advance`` moves a cancelled run along ``cancelling -> settling ->
cancelled | needs_review`` as the evidence comes in; it is safe to call at
any time and from many places (it takes a per-run lock and re-reads the
ledger). Verification only reads (R5); an operation whose read-back budget
is spent, or whose tool has no verifier, goes to review.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from stopline.domain.model import CancelState, Evidence, OperationRecord
from stopline.domain.vocab import Cancellable, EvidenceKind, OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.runtime.ledger import Ledger

__all__ = ["Settler"]


class Settler:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._locks: dict[str, anyio.Lock] = {}
        self._verifying: set[str] = set()

    # -- providers ---------------------------------------------------------------
    def ask_provider_cancel(self, ctx: CallContext) -> None:
        tool = ctx.tool
        if tool.cancel_fn is None or tool.cancellable is Cancellable.NEVER:
            return
        if ctx._accepted and tool.cancellable is not Cancellable.AFTER_ACCEPTED:
            return
        self._ledger.spawn(self._ask, ctx)

    async def _ask(self, ctx: CallContext) -> None:
        ledger = self._ledger
        assert ctx.tool.cancel_fn is not None
        await ledger.backend.note(ctx.op_id, "cancel_asked", {}, cancel_state=CancelState.ASKED)
        ledger._changed(ctx.run_id)
        try:
            confirmed = await ctx.tool.cancel_fn(ctx)
            detail = ""
        except Exception as exc:
            confirmed, detail = False, f"{type(exc).__name__}: {exc}"
        if confirmed:
            await ledger._resolve(
                ctx.op_id,
                OutcomeUpdate(
                    OpEvent.CANCEL_CONFIRMED,
                    [Evidence(EvidenceKind.PROVIDER_RECEIPT, "cancel_confirmed")],
                    cancel_state=CancelState.CONFIRMED,
                ),
            )
        else:
            await ledger.backend.note(
                ctx.op_id, "cancel_refused", {"detail": detail}, cancel_state=CancelState.REFUSED
            )
            ledger._changed(ctx.run_id)

    # -- verification (R5: reads only) -----------------------------------------------
    def verify_soon(self, op: OperationRecord) -> None:
        if op.id in self._verifying:
            return
        tool = self._ledger._tools.get(op.tool)
        if tool is None:
            return  # not verifiable from this process; the reconciler takes it
        self._verifying.add(op.id)
        self._ledger.spawn(self._verify, op)

    async def _verify(self, op: OperationRecord) -> None:
        ledger = self._ledger
        try:
            delays = [*ledger.verify_budget.delays(), None]
            for delay in delays:
                current = await self.read_back(op)
                if current.status is not OpStatus.UNKNOWN:
                    return  # proven, escalated, or settled meanwhile by a late response
                if delay is not None:
                    await anyio.sleep(delay)
            await ledger._resolve(
                op.id,
                OutcomeUpdate(
                    OpEvent.ESCALATED,
                    [
                        Evidence.local(
                            "verify_budget_spent", f"{len(delays)} read-backs found no answer"
                        )
                    ],
                ),
            )
        finally:
            self._verifying.discard(op.id)

    async def read_back(self, op: OperationRecord) -> OperationRecord:
        """One read-only look at the destination; records what it proves (R5)."""
        ledger = self._ledger
        tool = ledger._tools.get(op.tool)
        if tool is None:
            return op
        if tool.verify_fn is None:
            return await ledger._resolve(
                op.id,
                OutcomeUpdate(
                    OpEvent.ESCALATED,
                    [Evidence.local("no_verifier", f"tool {tool.name!r} has no read-back")],
                ),
            )
        ctx = CallContext(ledger, op.run_id, op.id, tool)
        try:
            answer = await tool.verify_fn(ctx)
            read = answer if isinstance(answer, ReadBack) else ReadBack(answer)
        except Exception as exc:
            read = ReadBack(Verdict.UNKNOWN, detail=f"{type(exc).__name__}: {exc}")
        if read.verdict is Verdict.UNKNOWN:
            return await ledger.backend.get_operation(op.id)
        committed = read.verdict is Verdict.COMMITTED
        event = OpEvent.VERIFIED_COMMITTED if committed else OpEvent.VERIFIED_NOT_COMMITTED
        evidence = Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", read.detail)
        return await ledger._resolve(
            op.id,
            OutcomeUpdate(
                event,
                [evidence],
                result=read.result,
                has_result=committed and read.result is not None,
            ),
        )

    # -- the run -------------------------------------------------------------------
    async def advance(self, run_id: str) -> None:
        """Move a cancelled run towards settled, as far as the evidence allows."""
        ledger = self._ledger
        lock = self._locks.setdefault(run_id, anyio.Lock())
        async with lock:
            run = await ledger.backend.get_run(run_id)
            if run.state not in (RunState.CANCELLING, RunState.SETTLING, RunState.NEEDS_REVIEW):
                return
            if run_id in ledger._local and ledger._local[run_id]._inflight:
                return  # local calls still running; their outcomes call us again
            ops = await ledger.backend.operations(run_id)
            statuses = {op.status for op in ops}
            if statuses & {OpStatus.REQUESTED, OpStatus.ACCEPTED}:
                return
            try:
                if statuses & {OpStatus.UNKNOWN, OpStatus.COMPENSATING}:
                    if run.state is RunState.CANCELLING:
                        await ledger.backend.run_event(run_id, RunEvent.SETTLE, by="stopline")
                    for op in ops:
                        if op.status is OpStatus.UNKNOWN:
                            self.verify_soon(op)
                elif statuses & {OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED}:
                    if run.state is not RunState.NEEDS_REVIEW:
                        await ledger.backend.run_event(run_id, RunEvent.ESCALATE, by="stopline")
                elif run.state is RunState.NEEDS_REVIEW:
                    # every review item was settled by later evidence or a reviewer
                    await ledger.backend.run_event(run_id, RunEvent.REVIEWED, by="stopline")
                else:
                    await ledger.backend.run_event(run_id, RunEvent.SETTLED, by="stopline")
            except IllegalTransition:
                pass  # another process moved it first
            ledger._changed(run_id)
