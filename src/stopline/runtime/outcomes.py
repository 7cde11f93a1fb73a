"""Outcomes: recording what a call proved, and what follows each change.

``Outcomes`` is the one place an operation's outcome is written from the
runtime: a call's answer (now, or deferred to the next group commit), a lost
answer (R3, with its horizon, R13), a late response (R4), the calls a cancel
interrupted, a run that ended on its own. Repeats that agree become
evidence; contradictions go to review. After every change the run's waiters
wake, an ``unknown`` is queued for verification, a settled correction
settles its link, and a cancelled or pausing run moves on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import TaskStatus

from stopline.domain.model import (
    Evidence,
    OperationRecord,
    OperationSpec,
    committed_evidence,
    horizon_evidence,
    result_digest,
)
from stopline.domain.transitions import CONTRADICTS
from stopline.domain.vocab import Cause, EvidenceKind, NoteKind, OpEvent, OpStatus, RunEvent
from stopline.errors import IllegalTransition, StoplineError, UnknownOperation, describe
from stopline.ledger import surface_rearmed
from stopline.ledger.backend import GateResult, OutcomeUpdate
from stopline.runtime.batches import Batches
from stopline.runtime.context import CallContext
from stopline.runtime.review import evidence_settles
from stopline.runtime.tool import Verdict, as_verdict

if TYPE_CHECKING:
    from stopline.runtime.core import Core

__all__ = ["INTERRUPTED", "Outcomes", "lost_update"]

log = logging.getLogger("stopline.background")

INTERRUPTED = "local abort: the call was interrupted"


def lost_update(
    ctx: CallContext, cause: Cause, detail: str, now: float | None = None
) -> OutcomeUpdate:
    """R3: a lost answer, with its horizon when the effect can still land after now (R13)."""
    evidence = [Evidence.local(cause.value, detail)]
    now = time.time() if now is None else now
    horizon = ctx.horizon(now)
    if horizon > now:
        evidence.append(horizon_evidence(horizon))
    return OutcomeUpdate(OpEvent.LOST, evidence, cause=cause)


class Outcomes:
    def __init__(self, core: Core) -> None:
        self._core = core
        # outcomes this process holds whose record has not committed yet: "recording"
        self.recording: set[str] = set()
        # ... and those whose record has committed, waiting for ``finish``
        self._committed: collections.deque[
            tuple[str, OutcomeUpdate, Callable[[], OperationRecord]]
        ] = collections.deque()
        self._committed_ready = anyio.Event()
        self._verdicts: Batches[tuple[str, OutcomeUpdate], OperationRecord] = Batches(
            core, self._record_verdicts
        )

    def in_hand(self) -> set[str]:
        """Operations whose outcome this process holds, not durable yet: queued for the
        next group commit, or held by the outbox until the ledger can take it."""
        return self.recording | self._core.outbox.held.keys()

    # -- recording -------------------------------------------------------------------
    async def resolve(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        """Record an outcome; agreeing repeats become evidence, contradictions go to review.

        The write and what follows it (``after_change``: an ``unknown`` queued for its
        read-back, the run moved on) go to their end whoever stops waiting. A scope's
        cancel (anyio's, trio's) is held by the callers' shields; asyncio's own
        ``Task.cancel`` is not (a framework cancelling the task it runs a tool in, again
        while it unwinds: LangGraph's runner, a ``gather``). It cut the wait once the
        write had landed, and the ``unknown`` was never read back nor sent to review
        (ADR 0071). On asyncio, in a task being cancelled (the cut that made an outcome
        ``unknown`` is such a cancel), they run in a task of their own that a further
        cancel does not reach; a cancelled caller waits for its end, as the ledger holds
        one for its write, then its cancel goes on up. Otherwise inline: a task of its
        own cost the write a turn of the loop (a provider's confirmation of a cancel,
        recorded in the same step, missed the receipt ``cancel()`` returns)."""
        if not _asked_to_cancel():  # the common case, inline: its write queued at once
            return await self._resolved(op_id, update)
        task = asyncio.ensure_future(self._resolved(op_id, update))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_unawaited)  # its error, if any, is nobody's: logged
            with anyio.CancelScope(shield=True):  # a scope's cancel waits; asyncio's own:
                while not task.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait((task,))  # ... each delivered once, taken here
            raise

    async def _resolved(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        try:
            op = await self._core.backend.record(op_id, update)
        except IllegalTransition:
            op = await self._repeated(op_id, update)
        self.after_change(op)
        return op

    async def gate(self, spec: OperationSpec) -> GateResult:
        """The gate, for a call of this process. A cancel that cuts the caller's wait
        (asyncio's own ``Task.cancel``: a shield holds a scope's) may leave the intent
        durable with no one to send it (``requested`` for good, R2): such an intent is
        recorded as not sent, then the cancel goes on up."""
        try:
            return await self._core.backend.gate(spec)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._orphaned(spec)
            raise

    async def _orphaned(self, spec: OperationSpec) -> None:
        """``spec``'s intent, if it landed for this worker and no call of this process
        sends it: not sent. Not landed (or in doubt): nothing to record."""
        try:
            op = await self._core.backend.get_operation(spec.id)
        except StoplineError:  # not landed, or the ledger cannot tell now
            return
        run = self._core.runs.get(spec.run_id)
        sending = run is not None and any(c.op_id == spec.id for c in run.in_flight)
        if op.status is OpStatus.REQUESTED and op.worker == spec.worker and not sending:
            await self.not_sent(spec.id, by_run=False)

    async def not_sent(self, op_id: str, *, by_run: bool) -> None:
        """A call whose intent is recorded and that was never sent: its run's cancel
        (``by_run``) or its caller's own landed between the gate and the first byte. It
        did not happen: recorded so, shielded (a cancelled caller records it too)."""
        why = "cancelled before sending" if by_run else "its caller cancelled it before sending"
        evidence = [Evidence.local("not_dispatched", why)]
        cause = Cause.USER_CANCEL if by_run else Cause.LOCAL_ERROR
        with anyio.CancelScope(shield=True):
            await self.resolve(op_id, OutcomeUpdate(OpEvent.NOT_SENT, evidence, cause=cause))

    async def unless_cancelled(self, op_id: str) -> None:
        """Before a call's first byte: its caller's cancel (a deadline, a task cancel) that
        came due while the gate recorded the intent (a wait the gate shields) is raised
        here, the call recorded as not sent; it was raised at the tool's first await, the
        call recorded as interrupted (``unknown``), or not at all in a tool that never
        awaits, which then ran to its end."""
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            await surface_rearmed()  # asyncio's own, held back by the writer, asked again
            if _asked_to_cancel():  # asyncio's own, pending when the gate answered
                await anyio.lowlevel.checkpoint()
        except anyio.get_cancelled_exc_class():
            await self.not_sent(op_id, by_run=False)
            raise

    async def verdict(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        """``resolve`` for what a read-back proved: the verdicts found at one moment (a
        cancelled tree's calls, verified together) are recorded in one transaction."""
        return await self._verdicts.one((op_id, update))

    async def _record_verdicts(
        self, items: list[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | Exception]:
        try:
            results = await self._core.backend.record_many(items)
        except UnknownOperation:  # one is not in the ledger, and none was written: alone
            return [await self._alone(op_id, update) for op_id, update in items]
        out: list[OperationRecord | Exception] = []
        for (op_id, update), result in zip(items, results, strict=True):
            if isinstance(result, IllegalTransition):
                out.append(await self._alone(op_id, update, refused=True))
                continue
            out.append(result)
        self.after_changes([r for r in results if not isinstance(r, IllegalTransition)])
        return out

    async def _alone(
        self, op_id: str, update: OutcomeUpdate, *, refused: bool = False
    ) -> OperationRecord | Exception:
        """``resolve``, its error returned (``refused``: its record was refused already)."""
        try:
            if not refused:
                return await self.resolve(op_id, update)
            op = await self._repeated(op_id, update)
        except Exception as exc:
            return exc
        self.after_change(op)
        return op

    async def _repeated(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        """An outcome the operation's status refused: a contradiction goes to review, a
        repeat that agrees is kept as evidence. A read-back's verdict of an attempt
        before the operation was sent again proves nothing of the later one: kept as
        evidence, whatever it says (ADR 0099)."""
        backend = self._core.backend
        current = await backend.get_operation(op_id)
        if update.attempt is not None and current.attempts != update.attempt:
            evidence = [e.to_json() for e in update.evidence]
            said = {"evidence": evidence, "attempt": update.attempt, "verdict": update.event.value}
            return await backend.note(op_id, NoteKind.READ_BEFORE_RETRY, said)
        if current.status in CONTRADICTS.get(update.event, ()):
            return await backend.record(
                op_id,
                dataclasses.replace(
                    update,
                    event=OpEvent.CONFLICT,
                    error=f"{update.event.value} contradicts recorded {current.status.value}",
                ),
            )
        return await backend.note(
            op_id,
            f"evidence_{update.event.value}",  # derived from the OpEvent
            {"evidence": [e.to_json() for e in update.evidence], "late": update.late},
            cancel_state=update.cancel_state,
        )

    def defer(self, op_id: str, update: OutcomeUpdate) -> None:
        """Queue a call's outcome for the next group commit (ADR 0022); ``recording``
        until it commits, then finished by the one task that finishes outcomes."""
        self.recording.add(op_id)
        self._core.backend.record_deferred(
            op_id, update, functools.partial(self._recorded, op_id, update)
        )

    def _recorded(
        self, op_id: str, update: OutcomeUpdate, outcome: Callable[[], OperationRecord]
    ) -> None:
        """A deferred outcome has committed, called on the loop outside any task: hand
        it to the one task that finishes outcomes."""
        self.recording.discard(op_id)
        self._committed.append((op_id, update, outcome))
        self._committed_ready.set()

    async def finish(self, *, task_status: TaskStatus[None]) -> None:
        """What ``resolve`` does after its write, for deferred outcomes: one task for
        all of them, woken once per group commit, instead of a task per call."""
        task_status.started()
        while True:
            await self._committed_ready.wait()
            self._committed_ready = anyio.Event()
            while self._committed:
                op_id, update, outcome = self._committed.popleft()
                try:
                    op = outcome()
                except IllegalTransition:
                    self._core.spawn(self.resolve, op_id, update)  # agreeing or contradicting
                    continue
                except StoplineError:  # not taken: held, retried behind the boundary
                    self._core.spawn(self._core.outbox.record, op_id, update)
                    continue
                self.after_change(op)

    async def lost(self, ctx: CallContext, cause: Cause, detail: str) -> None:
        """R3: no answer is ``unknown``, never ``not_committed``. R13: when the effect can
        still land after now, the horizon is recorded with it."""
        await self._core.outbox.record(ctx.op_id, lost_update(ctx, cause, detail))

    async def record_interrupted(
        self, ctxs: Sequence[CallContext], release: Callable[[], None] | None = None
    ) -> None:
        """R3 for every call a cancel interrupted here: ``unknown``, in one transaction
        for the whole tree instead of one per call. ``release`` lets their runs' steps
        read again once the record is written or has failed (``Settler.hold_steps``)."""
        core = self._core
        now = time.time()
        alike: dict[tuple[Evidence, ...], OutcomeUpdate] = {}  # one object per distinct update
        updates = []
        for ctx in ctxs:
            update = lost_update(ctx, Cause.USER_CANCEL, INTERRUPTED, now)
            updates.append((ctx.op_id, alike.setdefault(tuple(update.evidence), update)))
        try:
            with anyio.CancelScope(shield=True):
                results = await core.backend.record_many(updates)
        finally:
            if release is not None:
                release()  # failed: a retry asks for the step; till then a step moves nothing
        recorded = []
        for (op_id, update), result in zip(updates, results, strict=True):
            if isinstance(result, IllegalTransition):
                core.spawn(self.resolve, op_id, update)  # it ended meanwhile: evidence
                continue
            recorded.append(result)
        self.after_changes(recorded)  # their runs move on together, in one step

    async def late_response(
        self, op_id: str, verdict: Verdict, *, result: Any = None, ref: str = "", detail: str = ""
    ) -> OperationRecord:
        """R4: attach a response that came after cancel or timeout; never restarts anything."""
        verdict = as_verdict(verdict)  # a string read as "refused" proved nothing
        kept = verdict is Verdict.COMMITTED
        if kept:  # a result the ledger cannot keep is said so, as an answer in time is
            evidence, kept = committed_evidence(result, detail or "late")
        else:
            said = result_digest(result)[0]  # as an answer's, whatever it holds
            evidence = [Evidence(EvidenceKind.RESPONSE_DIGEST, said, detail or "late")]
        if ref:
            evidence.insert(0, Evidence(EvidenceKind.PROVIDER_RECEIPT, ref))
        if verdict is not Verdict.UNKNOWN and await self._disputed(op_id):
            verdict = Verdict.UNKNOWN  # one more voice in a dispute: kept for the reviewer
        if verdict is Verdict.UNKNOWN:
            op = await self._core.backend.note(
                op_id, NoteKind.LATE_RESPONSE, {"evidence": [e.to_json() for e in evidence]}
            )
            self._core.changed(op.run_id)
            return op
        event = OpEvent.COMMITTED if verdict is Verdict.COMMITTED else OpEvent.REJECTED
        return await self.resolve(
            op_id,
            OutcomeUpdate(
                event, evidence, result=result if kept else None, has_result=kept, late=True
            ),
        )

    async def _disputed(self, op_id: str) -> bool:
        """In review for contradicting evidence (or a failed correction of a commit): a
        late answer does not settle it, a reviewer does (ADR 0052)."""
        op = await self._core.backend.get_operation(op_id)
        return op.status is OpStatus.NEEDS_REVIEW and not await evidence_settles(self._core, op)

    # -- runs ------------------------------------------------------------------------
    async def end(self, run_id: str, by: str, error: BaseException | None = None) -> None:
        """A run that ended on its own: ``completed`` (``failed`` with ``error``), unless
        it was cancelled meanwhile, in which case it settles."""
        event = RunEvent.COMPLETE if error is None else RunEvent.FAIL
        reason = "" if error is None else describe(error)
        try:
            run, _ = await self._core.backend.run_event(run_id, event, by=by, reason=reason)
        except IllegalTransition:  # cancelled elsewhere meanwhile: it settles below
            run = None
        self._core.changed(run_id)
        if run is not None and self._core.settler.ended(run):
            return  # nothing to settle, now or later
        await self._core.settler.advance(run_id)

    async def settle_pause(self, run_id: str) -> None:
        await self._core.backend.settle_pause(run_id)
        self._core.changed(run_id)

    # -- what follows a change ---------------------------------------------------------
    def after_change(self, op: OperationRecord, *, advance: bool = True) -> None:
        """Wake the run's waiters, settle a correction's link, verify an ``unknown``, and
        (with ``advance``) move a cancelled or pausing run on."""
        self.after_changes([op], advance=advance)

    def after_changes(self, ops: Sequence[OperationRecord], *, advance: bool = True) -> None:
        """``after_change`` for many operations: their cancelled runs move on together."""
        core = self._core
        for op in ops:
            core.changed(op.run_id)
            if op.compensates is not None and op.status.resolved:
                core.spawn(core.compensator.link, op)  # a settled correction settles its link
            if op.status is OpStatus.UNKNOWN:
                core.settler.verify_soon(op)
        if not advance:
            return
        moving = []
        for run_id in dict.fromkeys(op.run_id for op in ops):
            run = core.runs.get(run_id)
            if run is None or run.cancel_requested:
                moving.append(run_id)
            elif run.pause_requested and not run.in_flight:
                core.spawn(self.settle_pause, run_id)
        if moving:
            core.spawn(core.settler.advance_many, moving)


def _unawaited(task: asyncio.Future[OperationRecord]) -> None:
    """An outcome's write whose caller was cancelled meanwhile has ended: its error, kept
    in the log (the caller's cancel goes on up in its place)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("an outcome recorded after its caller was cancelled failed: %s", describe(exc))


def _asked_to_cancel() -> bool:
    """asyncio's own ``Task.cancel`` asked of this task and not yet delivered (nor
    withdrawn): a scope knows nothing of it, and the next await raises it."""
    if sniffio.current_async_library() != "asyncio":
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
