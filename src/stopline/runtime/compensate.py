"""Compensation: correcting a committed operation with an operation of its own (S8).

A compensation is a full operation: its own id (``<op id>~compensate``, then
``~compensate.2`` ... for later attempts), its own gate pass under the
``compensate`` grant (which a cancel keeps), its own outcome and evidence,
linked to the operation it corrects by ``compensates``. Starting one moves
the corrected operation ``committed -> compensating`` in the same transaction
as the gate (``Backend.begin_compensation``), so a crash never leaves one
without the other. The compensation's outcome then settles the link:
committed -> the original is ``compensated``; not committed -> the original's
``compensation_failed`` goes to review; unknown -> verified like any
operation, the link waiting meanwhile.

The runner lives on the ledger's task group, not the workflow's scope: a
cancel of the run does not stop it (R7). Only ``stop_compensation`` by a
principal with that right does, and only in the process running it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.guidance import correcting
from stopline.domain.lifecycle import SYSTEM
from stopline.domain.model import (
    Evidence,
    OperationRecord,
    OperationSpec,
    committed_evidence,
    digest,
)
from stopline.domain.vocab import Cancellable, Cause, EvidenceKind, NoteKind, OpEvent, OpStatus
from stopline.errors import (
    IllegalTransition,
    NotCorrectable,
    NotPermitted,
    StoplineError,
    describe,
)
from stopline.ledger.backend import GateVerdict, OutcomeUpdate
from stopline.runtime.context import CallContext
from stopline.runtime.outcomes import lost_update
from stopline.runtime.review import escalation
from stopline.runtime.tool import Compensation, NoAnswer, Rejected, Tool

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["CompensationContext", "Compensator", "compensation_id", "context_for"]


def compensation_id(op_id: str, attempt: int) -> str:
    """The id (and idempotency key) of the ``attempt``-th correction of ``op_id``."""
    return f"{op_id}~compensate" if attempt <= 1 else f"{op_id}~compensate.{attempt}"


class CompensationContext(CallContext):
    """What a compensator sees: ``key`` is the correction's own idempotency key,
    ``compensates`` the key of the operation it corrects, ``original`` its record."""

    __slots__ = ("compensates", "original")

    def __init__(
        self, core: Core, original: OperationRecord, op_id: str, tool: Tool[object]
    ) -> None:
        super().__init__(core, original.run_id, op_id, tool)
        self.compensates = original.id
        self.original = original


async def context_for(core: Core, op: OperationRecord, tool: Tool[Any]) -> CallContext:
    """The context a verifier (or compensator) of ``op`` receives."""
    if op.compensates is None:
        return CallContext(core, op.run_id, op.id, tool)
    original = await core.backend.get_operation(op.compensates)
    return CompensationContext(core, original, op.id, tool)


class Compensator:
    def __init__(self, core: Core) -> None:
        self._core = core
        self._scopes: dict[str, anyio.CancelScope] = {}  # original id -> its running correction
        self._corrects: dict[str, str] = {}  # a running correction's id -> the original's
        self._done: dict[str, anyio.Event] = {}
        self._proposed: set[str] = set()
        self._links: dict[str, anyio.Lock] = {}

    def tool_for(self, op: OperationRecord) -> Tool[Any]:
        """The registered tool that can correct ``op``, or ``NotPermitted`` saying why not."""
        if op.compensates is not None:
            raise NotPermitted(f"operation {op.id!r} is itself a correction; it is not corrected")
        tool = self._core.tools.get(op.tool)
        if not op.can_compensate or (tool is not None and tool.compensate_fn is None):
            raise NotPermitted(
                f"operation {op.id!r} cannot be corrected: tool {op.tool!r} declares no compensator"
            )
        if tool is None:
            raise NotPermitted(
                f"operation {op.id!r}: tool {op.tool!r} is not registered in this process; "
                "pass it with stopline.open(url, tools=[...]) or ledger.register_tool()"
            )
        return tool

    async def may_start(self, op: OperationRecord) -> Tool[Any]:
        """``tool_for``, and a refusal while the run is paused (its gate passes nothing):
        what a review's ``compensate`` checks before it records its decision."""
        tool = self.tool_for(op)
        if (await self._core.backend.get_run(op.run_id)).state.paused:
            raise _paused(op)
        return tool

    async def start(self, op_id: str, *, by: str, reason: str = "") -> OperationRecord:
        """Queue the correction of a committed operation; returns the compensation's record.

        (The approval hook: a policy requiring an approval for corrections checks it here.)
        """
        core = self._core
        op = await core.backend.get_operation(op_id)
        tool = self.tool_for(op)
        if op.status is not OpStatus.COMMITTED:
            raise await self.refusal(op_id, op.status)
        attempt = len(await core.backend.compensations(op_id)) + 1
        comp_id = compensation_id(op_id, attempt)
        spec = OperationSpec(
            id=comp_id,
            run_id=op.run_id,
            tool=tool.name,
            args_digest=digest(["compensate", op_id, attempt]),
            description=f"correct: {op.description or op.tool}",
            cancellable=Cancellable.NEVER,
            can_verify=tool.compensation_verify_fn is not None,
            can_compensate=False,
            compensates=op_id,
            worker=core.worker_id,
        )
        why = f"correction asked by {by}" + (f": {reason}" if reason else "")
        asked = Evidence.local(comp_id, why)
        try:
            gate = await core.backend.begin_compensation(spec, [asked])
        except IllegalTransition as exc:  # another correction started first: nothing written
            now = exc.state if isinstance(exc.state, OpStatus) else op.status
            raise await self.refusal(op_id, now) from exc
        if gate.verdict is GateVerdict.PAUSED:
            raise _paused(op)
        if gate.verdict is not GateVerdict.PASSED:
            raise NotPermitted(
                f"run {op.run_id!r} may not compensate (gate: {gate.verdict.value}); "
                f"{op_id!r} stays committed"
            )
        core.changed(op.run_id)
        done = self._done[op_id] = anyio.Event()
        scope = self._scopes[op_id] = anyio.CancelScope()
        self._corrects[comp_id] = op_id
        comp = await core.backend.get_operation(comp_id)
        core.spawn(self._run, op, comp, tool, scope, done)
        return comp

    async def refusal(self, op_id: str, status: OpStatus) -> NotCorrectable:
        """Why ``op_id``, in ``status``, is not corrected (only a committed operation is),
        naming the correction made or under way, and what to do instead."""
        made = await self._core.backend.compensations(op_id)
        by = made[-1].id if made and status is not OpStatus.NEEDS_REVIEW else ""
        why = correcting(op_id, status, by)
        return NotCorrectable(op_id, status, OpEvent.COMPENSATION_STARTED, why)

    async def wait(self, op_id: str) -> None:
        """Until the correction of ``op_id`` running in this process has an outcome."""
        done = self._done.get(op_id)
        if done is not None:
            await done.wait()

    def stop(self, op_id: str) -> bool:
        """Interrupt the correction of ``op_id`` running here (``op_id`` names the operation
        corrected, or the correction itself: its receipt line's id); its outcome becomes
        unknown."""
        scope = self._scopes.get(self._corrects.get(op_id, op_id))
        if scope is None:
            return False
        scope.cancel()
        return True

    async def _run(
        self,
        original: OperationRecord,
        comp: OperationRecord,
        tool: Tool[Any],
        scope: anyio.CancelScope,
        done: anyio.Event,
    ) -> None:
        core = self._core
        settler = core.settler
        ctx = CompensationContext(core, original, comp.id, tool)
        try:
            async with settler.working():
                with scope:
                    try:
                        await self._dispatch(ctx, tool)
                    except anyio.get_cancelled_exc_class():
                        if not scope.cancel_called:  # not a stop (below): the ledger closes
                            await self._closed(ctx)
                        raise
                if scope.cancelled_caught:  # its effect may still land: with its horizon
                    stopped = lost_update(ctx, Cause.USER_CANCEL, "stopped on request")
                    await core.outcomes.resolve(comp.id, stopped)
                await self.link(await core.backend.get_operation(comp.id))
        finally:  # its own only: a next correction may be registered already (its link
            # sent the original to review, where a reviewer asked to correct it again)
            if self._scopes.get(original.id) is scope:
                del self._scopes[original.id]
            if self._done.get(original.id) is done:
                del self._done[original.id]
            self._corrects.pop(comp.id, None)
            done.set()

    async def _closed(self, ctx: CompensationContext) -> None:
        """The ledger closes under a running correction: its answer is lost, not a crash's
        (recorded if the ledger still takes it; else recovery marks it)."""
        why = "the ledger closed while the correction ran"
        with anyio.CancelScope(shield=True), contextlib.suppress(StoplineError, OSError):
            await self._core.outcomes.resolve(ctx.op_id, lost_update(ctx, Cause.LOCAL_ERROR, why))

    async def _dispatch(self, ctx: CompensationContext, tool: Tool[Any]) -> None:
        core = self._core
        assert tool.compensate_fn is not None
        try:
            result = tool.answer(await tool.compensate_fn(ctx), of="compensator")
        except Rejected as exc:
            refused = Evidence(EvidenceKind.PROVIDER_RECEIPT, exc.ref or "rejected", exc.reason)
            update = OutcomeUpdate(
                OpEvent.REJECTED, [refused], cause=Cause.SERVER_ERROR, error=exc.reason
            )
        except NoAnswer as exc:  # lost as a call's answer is: with its horizon (R13)
            update = lost_update(ctx, exc.cause, exc.detail)
        except Exception as exc:  # R3: anything else is unknown, never "did not happen"
            cause = Cause.TRANSPORT if isinstance(exc, OSError) else Cause.LOCAL_ERROR
            update = lost_update(ctx, cause, describe(exc))
        else:
            evidence, kept = committed_evidence(result)
            update = OutcomeUpdate(
                OpEvent.COMMITTED, evidence, result=result if kept else None, has_result=kept
            )
        with anyio.CancelScope(shield=True):
            await core.outcomes.resolve(ctx.op_id, update)

    # -- the link --------------------------------------------------------------
    async def link(self, comp: OperationRecord) -> None:
        """Carry a correction's outcome to the operation it corrects."""
        core = self._core
        if comp.compensates is None:
            return
        corrected = comp.compensates
        lock = self._links.setdefault(corrected, anyio.Lock())
        async with core.settler.working(), lock:
            comp = await core.backend.get_operation(comp.id)  # as it is now, under the lock
            original = await core.backend.get_operation(corrected)
            if original.status is not OpStatus.COMPENSATING:
                return
            linked = Evidence.local(comp.id, f"correction {comp.status.value}")
            if comp.status is OpStatus.COMMITTED:
                await core.outcomes.resolve(
                    original.id,
                    OutcomeUpdate(OpEvent.COMPENSATED, [linked, *comp.evidence[-1:]]),
                )
            elif comp.status is OpStatus.NOT_COMMITTED:
                failed = OutcomeUpdate(
                    OpEvent.COMPENSATION_FAILED, [linked], error=comp.error or "correction failed"
                )
                await core.outcomes.resolve(original.id, failed)
                await core.outcomes.resolve(original.id, escalation())

    # -- the per-tool policy on cancel ---------------------------------------------
    async def on_cancel(self, ops: list[OperationRecord]) -> bool:
        """Apply ``always`` and ``ask`` to a cancelled run's committed operations.

        Returns whether a correction was queued.
        """
        core = self._core
        queued = False
        for op in ops:
            if op.status is not OpStatus.COMMITTED or op.compensates is not None:
                continue
            tool = core.tools.get(op.tool)
            if tool is None or tool.compensate_fn is None or not op.can_compensate:
                continue
            if tool.compensation is Compensation.ALWAYS:
                if await core.backend.compensations(op.id):
                    continue  # corrected before, or a reviewer decided after a failed one
                try:
                    await self.start(op.id, by=SYSTEM.id, reason="compensation=always on cancel")
                    queued = True
                except (NotPermitted, IllegalTransition):
                    continue  # moved meanwhile, or the run may not compensate
            elif tool.compensation is Compensation.ASK and op.id not in self._proposed:
                # the approval hook: until approvals of corrections exist, the proposal
                # is recorded on the operation and its receipt line offers the correction
                self._proposed.add(op.id)
                await core.backend.note(op.id, NoteKind.COMPENSATION_PROPOSED, {"policy": "ask"})
        return queued


def _paused(op: OperationRecord) -> NotPermitted:
    return NotPermitted(f"run {op.run_id!r} is paused; resume it to correct {op.id!r}")
