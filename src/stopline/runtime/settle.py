"""After a cancel: ask providers, verify unknowns, settle the run.

``advance`` moves a cancelled run along ``cancelling -> settling ->
cancelled | needs_review`` as the evidence comes in; it is safe to call at
any time and from many places (it takes a per-run lock and re-reads the
ledger). Verification only reads (R5); an operation whose read-back budget
is spent, or whose tool has no verifier, goes to review. A cancelled run's
committed operations whose tool declares ``compensation=always`` are
corrected before the run settles (S8).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from stopline.domain.lifecycle import SYSTEM
from stopline.domain.model import CancelState, Evidence, OperationRecord
from stopline.domain.vocab import Cancellable, EvidenceKind, OpEvent, OpStatus, RunEvent, RunState
from stopline.errors import IllegalTransition
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.context import CallContext
from stopline.runtime.tool import ReadBack, Verdict

if TYPE_CHECKING:
    from stopline.runtime.ledger import Ledger

__all__ = ["Settler", "VerifyBudget"]

_CANCELLED = frozenset({RunState.CANCELLING, RunState.SETTLING, RunState.NEEDS_REVIEW})


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyBudget:
    """How hard to try a read-back before handing an operation to review."""

    attempts: int = 6
    first_delay: float = 0.2
    factor: float = 2.0
    max_delay: float = 10.0

    def delays(self) -> list[float]:
        out, delay = [], self.first_delay
        for _ in range(self.attempts - 1):
            out.append(min(delay, self.max_delay))
            delay *= self.factor
        return out


class Settler:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._locks: dict[str, anyio.Lock] = {}
        # runs with an advance waiting to start: another request for one is redundant,
        # as the waiting one reads the state when it starts (a cancelled tree asks often)
        self._queued: set[str] = set()
        self._verifying: dict[str, anyio.Event] = {}  # op id -> set when its verification ends
        self._asking: dict[str, int] = {}  # run id -> provider cancel requests awaiting answer
        self.busy = 0  # background steps running now
        self._idle = anyio.Event()  # set while ``busy`` is 0
        self._idle.set()

    @contextlib.asynccontextmanager
    async def working(self) -> AsyncIterator[None]:
        """Count a background step while it runs."""
        if self.busy == 0:
            self._idle = anyio.Event()
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            if self.busy == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Until no background step runs (returns at once if none does)."""
        while self.busy:
            await self._idle.wait()

    # -- providers ---------------------------------------------------------------
    def ask_provider_cancel(self, ctx: CallContext) -> None:
        tool = ctx.tool
        if tool.cancel_fn is None or tool.cancellable is Cancellable.NEVER:
            return
        if ctx._accepted and tool.cancellable is not Cancellable.AFTER_ACCEPTED:
            return
        self._ledger.spawn(self._ask, ctx)

    async def _ask(self, ctx: CallContext) -> None:
        """Ask, and hold the run's settlement until the provider has answered: its answer
        (a confirmed or refused cancel) is part of the receipt, which must not change
        after the run is called settled."""
        self._asking[ctx.run_id] = self._asking.get(ctx.run_id, 0) + 1
        try:
            async with self.working():
                await self._ask_provider(ctx)
        finally:
            self._asking[ctx.run_id] -= 1
            if not self._asking[ctx.run_id]:
                del self._asking[ctx.run_id]
        await self.advance(ctx.run_id)

    async def _ask_provider(self, ctx: CallContext) -> None:
        ledger = self._ledger
        assert ctx.tool.cancel_fn is not None
        await ledger.backend.note(ctx.op_id, "cancel_asked", {}, cancel_state=CancelState.ASKED)
        ledger._changed(ctx.run_id)
        answered = False
        try:
            # a provider that never answers must not hold the run open forever
            with anyio.move_on_after(ledger.cancel_answer_timeout):
                confirmed = await ctx.tool.cancel_fn(ctx)
                answered = True
            detail = ""
        except Exception as exc:
            answered, confirmed, detail = True, False, f"{type(exc).__name__}: {exc}"
        if not answered:
            await ledger.backend.note(
                ctx.op_id, "cancel_unanswered", {"after_s": ledger.cancel_answer_timeout}
            )
            ledger._changed(ctx.run_id)
            return  # the operation's own outcome (or its read-back) decides
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
    def can_verify_here(self, op: OperationRecord) -> bool:
        """A read-back (or, with no verifier declared, an escalation) is possible here."""
        return op.tool in self._ledger._tools or not op.can_verify

    def verify_soon(self, op: OperationRecord) -> None:
        if op.id in self._verifying or not self.can_verify_here(op):
            return  # in hand already; or not verifiable from this process: a reconcile takes it
        self._verifying[op.id] = anyio.Event()
        self._ledger.spawn(self._verify, op, None)

    async def verify_with_budget(
        self, op: OperationRecord, budget: VerifyBudget | None = None
    ) -> OperationRecord:
        """Verify until proven, escalated or settled meanwhile; join one already running."""
        running = self._verifying.get(op.id)
        if running is not None:
            await running.wait()
            return await self._ledger.backend.get_operation(op.id)
        if not self.can_verify_here(op):
            return op
        self._verifying[op.id] = anyio.Event()
        return await self._verify(op, budget)

    async def _verify(self, op: OperationRecord, budget: VerifyBudget | None) -> OperationRecord:
        ledger = self._ledger
        current = op
        try:
            async with self.working():
                delays = [*(budget or ledger.verify_budget).delays(), None]
                current = await ledger.backend.get_operation(op.id)  # read after a stale list
                for delay in delays:
                    if current.status is not OpStatus.UNKNOWN:
                        return current
                    current = await self.read_back(current)
                    if current.status is not OpStatus.UNKNOWN:
                        return current  # proven, escalated, or settled by a late response
                    if delay is not None:
                        await anyio.sleep(delay)  # backoff between read-backs
                spent = Evidence.local(
                    "verify_budget_spent", f"{len(delays)} read-backs found no answer"
                )
                current = await ledger._resolve(op.id, OutcomeUpdate(OpEvent.ESCALATED, [spent]))
                return current
        finally:
            done = self._verifying.pop(op.id, None)
            if done is not None:
                done.set()

    async def read_back(self, op: OperationRecord) -> OperationRecord:
        """One read-only look at the destination; records what it proves (R5)."""
        ledger = self._ledger
        tool = ledger._tools.get(op.tool)
        verify_fn = None
        if tool is not None:
            verify_fn = tool.compensation_verify_fn if op.compensates else tool.verify_fn
        elif op.can_verify:
            return op  # its tool is not registered here: leave it for one that has it
        if verify_fn is None:
            name = op.tool if tool is None else tool.name
            return await ledger._resolve(
                op.id,
                OutcomeUpdate(
                    OpEvent.ESCALATED,
                    [Evidence.local("no_verifier", f"tool {name!r} has no read-back")],
                ),
            )
        assert tool is not None
        ctx = await ledger._call_context(op, tool)
        try:
            answer = await verify_fn(ctx)
            read = answer if isinstance(answer, ReadBack) else ReadBack(answer)
        except Exception as exc:
            # kept as evidence: a verifier's error is part of why the outcome is in doubt
            failed = Evidence.local("verify_error", f"{type(exc).__name__}: {exc}")
            return await ledger.backend.note(
                op.id, "verify_failed", {"evidence": [failed.to_json()]}
            )
        if read.verdict is Verdict.UNKNOWN:
            if not read.detail:
                return await ledger.backend.get_operation(op.id)
            # kept as evidence: why this look found no answer (a verifier's transport error)
            looked = Evidence(EvidenceKind.READ_BACK, read.ref or "read-back", read.detail)
            return await ledger.backend.note(
                op.id, "verify_unknown", {"evidence": [looked.to_json()]}
            )
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
        if run_id in self._queued:
            return
        self._queued.add(run_id)
        try:
            async with self.working():
                await self._advance(run_id)
        finally:
            self._queued.discard(run_id)

    @contextlib.asynccontextmanager
    async def _run_lock(self, run_id: str) -> AsyncIterator[None]:
        """The run's lock, dropped from the map once nobody waits for it (bounded)."""
        lock = self._locks.setdefault(run_id, anyio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.statistics().tasks_waiting and self._locks.get(run_id) is lock:
                del self._locks[run_id]

    async def _advance(self, run_id: str) -> None:
        ledger = self._ledger
        async with self._run_lock(run_id):
            self._queued.discard(run_id)  # from here on, what happens next is read
            run = await ledger.backend.get_run(run_id)
            if run.state not in _CANCELLED:
                return
            if run_id in ledger._local and ledger._local[run_id]._inflight:
                return  # local calls still running; their outcomes call us again
            if run_id in self._asking:
                return  # a provider has yet to answer our cancel; its answer calls us again
            ops = await ledger.backend.operations(run_id)
            statuses = {op.status for op in ops}
            if statuses & {OpStatus.REQUESTED, OpStatus.ACCEPTED}:
                return
            if run.state is not RunState.NEEDS_REVIEW and await ledger._auto_compensate(ops):
                ops = await ledger.backend.operations(run_id)
                statuses = {op.status for op in ops}
            try:
                if statuses & {OpStatus.REQUESTED, OpStatus.ACCEPTED}:
                    if run.state is RunState.CANCELLING:  # a correction is on its way
                        await ledger.backend.run_event(run_id, RunEvent.SETTLE, by=SYSTEM.id)
                elif statuses & {OpStatus.UNKNOWN, OpStatus.COMPENSATING}:
                    if run.state is RunState.CANCELLING:
                        await ledger.backend.run_event(run_id, RunEvent.SETTLE, by=SYSTEM.id)
                    for op in ops:
                        if op.status is OpStatus.UNKNOWN:
                            self.verify_soon(op)
                elif statuses & {OpStatus.NEEDS_REVIEW, OpStatus.COMPENSATION_FAILED}:
                    if run.state is not RunState.NEEDS_REVIEW:
                        await ledger.backend.run_event(run_id, RunEvent.ESCALATE, by=SYSTEM.id)
                elif run.state is RunState.NEEDS_REVIEW:
                    # every review item was settled by later evidence or a reviewer
                    await ledger.backend.run_event(run_id, RunEvent.REVIEWED, by=SYSTEM.id)
                else:
                    await ledger.backend.run_event(run_id, RunEvent.SETTLED, by=SYSTEM.id)
            except IllegalTransition:
                pass  # another process moved it first
            ledger._changed(run_id)
