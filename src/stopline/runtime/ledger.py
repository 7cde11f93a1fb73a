"""The ledger as the runtime uses it: runs, cancel, settlement, receipts.

``async with stopline.open(url) as ledger`` opens the backend and a task
group for background work that outlives a workflow's own scope: asking
providers to cancel, verifying unknown outcomes, settling cancelled runs.
Closing the ledger stops that work; what it had not finished stays truthful
in the ledger (``unknown``, ``cancel asked``) for the next start to pick up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from stopline.domain.lifecycle import AccessPolicy, Action, OwnerOrTenantAdmin, Principal
from stopline.domain.limits import check_id, sanitise
from stopline.domain.model import Evidence, OperationRecord, digest
from stopline.domain.receipt import Receipt, build_receipt
from stopline.domain.transitions import CONTRADICTS
from stopline.domain.vocab import (
    Cause,
    EvidenceKind,
    OpEvent,
    OpStatus,
    Policy,
    RunEvent,
)
from stopline.errors import (
    IllegalTransition,
    StoplineError,
)
from stopline.ledger import open_backend, resolve_url
from stopline.ledger.backend import Backend, OutcomeUpdate, RunSpec
from stopline.runtime.boundary import Boundary, Health, typed
from stopline.runtime.context import CallContext
from stopline.runtime.lifecycle import LifecycleMixin
from stopline.runtime.outbox import Outbox
from stopline.runtime.reads import Reads
from stopline.runtime.run import INTERRUPTED, Run
from stopline.runtime.scope import RunScope
from stopline.runtime.settle import Settler, VerifyBudget
from stopline.runtime.tool import Tool, Verdict
from stopline.runtime.truth import TruthMixin

__all__ = ["Ledger", "RunScope", "VerifyBudget", "open"]


class Ledger(LifecycleMixin, TruthMixin):
    """Open with ``async with stopline.open(url) as ledger``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        verify: VerifyBudget | None = None,
        backend: Backend | None = None,
        observers: Sequence[Callable[[Backend], Backend]] = (),
        access: AccessPolicy | None = None,
        tools: Sequence[Tool[Any]] = (),
        durable_outcomes: bool = False,
    ) -> None:
        self.url = resolve_url(url)
        # R11: who may cancel, pause, resume, approve and resolve; the default lets the
        # owner, a tenant admin and an operator act
        self.access: AccessPolicy = access or OwnerOrTenantAdmin()
        # False (default): the outcome commits with the next group commit, within a few
        # ms, and a crash in between leaves it to reconciliation. True (strict): a call
        # returns once its outcome is durable (ADR 0022, revisiting 0006)
        self.durable_outcomes = durable_outcomes
        # outcomes this process holds whose record has not committed yet: "recording"
        self._recording: set[str] = set()
        # ... and those whose record has committed, waiting for ``_finish_outcomes``
        self._committed: collections.deque[
            tuple[str, OutcomeUpdate, Callable[[], OperationRecord]]
        ] = collections.deque()
        self._committed_ready = anyio.Event()
        # how long the settler waits for a provider's answer to a cancel request before
        # it records "cancel_unanswered" and lets the operation's own outcome decide
        self.cancel_answer_timeout = 30.0
        # each observer wraps the backend to see every durable write (stopline.telemetry)
        self._observers = tuple(observers)
        self.verify_budget = verify or VerifyBudget()
        self._backend = backend
        self._tg: TaskGroup | None = None
        self._closing = False
        self._local: dict[str, Run] = {}
        self._tools: dict[str, Tool[Any]] = {t.name: t for t in reversed(tools)}
        self._adopted: dict[Callable[..., Any], Tool[Any]] = {}
        self._changes: dict[str, anyio.Event] = {}
        self._settler = Settler(self)
        # runs, operations and the log, read under the access policy (R11)
        self.reads = Reads(lambda: self.backend, lambda: self.access)
        # background work runs behind an error boundary; what it saw is `health`
        self.health = Health()
        self._boundary = Boundary(self.health)
        self._outbox = Outbox(self)
        # called with the fenced run ids of every cancel this process learns of
        self._cancel_listeners: list[Callable[[Sequence[str]], None]] = []
        # this process's identity in the ledger: operations record the worker that
        # passed the gate, so crash recovery can tell a dead worker's from a live one's
        self.worker_id = f"worker_{uuid.uuid4().hex[:16]}"

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the ledger is not open: use 'async with stopline.open(...)'")
        return self._backend

    async def __aenter__(self) -> Ledger:
        if self._backend is None:
            self._backend = await open_backend(self.url)
        raw = self._backend  # observers wrap the seam's methods, not the notification hook
        for observe in self._observers:
            self._backend = observe(self._backend)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            # cancels committed by other processes reach this one's in-flight calls
            await self._tg.start(raw.watch_cancels, self._on_remote_cancel)
            await self._tg.start(self._finish_outcomes)
            await self.recover()  # register this worker; reconcile what dead ones left (R2)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._tg, self._closing = self._tg, None, True
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                try:
                    await tg.__aexit__(None, None, None)
                except BaseExceptionGroup as group:  # only typed errors leave stopline.open
                    raise typed(group) from group
        finally:
            with anyio.CancelScope(shield=True):
                await self._outbox.flush()
                await self._retire()
                await self.backend.close()

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start background work that outlives the caller's scope."""
        if self._tg is None:
            if self._closing:
                return  # closing: background work stops with the ledger (see the module doc)
            raise RuntimeError("the ledger is not open")
        self._tg.start_soon(self._boundary.run, fn, *args)

    # -- tools -------------------------------------------------------------------
    def register_tool(self, tool: Tool[Any]) -> None:
        """Known tools can be verified and cancelled from this process."""
        self._tools.setdefault(tool.name, tool)

    def adopt(self, fn: Callable[..., Awaitable[Any]]) -> Tool[Any]:
        """A plain async function used as a tool: effectful, with no capabilities."""
        tool = self._adopted.get(fn)
        if tool is None:
            tool = self._adopted[fn] = Tool(fn)
        return tool

    # -- runs ----------------------------------------------------------------------
    def run(
        self,
        name: str,
        *,
        owner: str,
        tenant: str = "default",
        run_id: str | None = None,
        parent_id: str | None = None,
        shared: bool = False,
        policy: Policy = Policy.VERIFY,
    ) -> RunScope:
        """A run; with ``parent_id`` a child owned by that run, exclusively unless ``shared``.

        Entering it with the ``run_id`` of a run that has ended raises ``RunEnded``
        saying what to do (resume it first, resolve its review, or start a new run).
        """
        if run_id is not None:  # "" is refused, never replaced by a new id
            check_id("run_id", run_id)
        spec = RunSpec(
            id=check_id("run_id", run_id or f"run_{uuid.uuid4().hex[:16]}"),
            name=check_id("name", name),
            owner=check_id("owner", owner),
            tenant=check_id("tenant", tenant),
            parent_id=parent_id if parent_id is None else check_id("parent_id", parent_id),
            shared=shared,
            policy=policy,
        )
        return RunScope(self, spec, attach=run_id is not None)

    async def cancel(self, run_id: str, *, by: str | Principal, reason: str = "") -> Receipt:
        """Fence the run and what it owns exclusively (durably, first, in one transaction),
        then interrupt local work by phase policy and ask providers that can to cancel.

        Idempotent (R7). Returns the receipt as it stands now; ``wait_settled`` gives
        the final one. Checked against ``access`` (R11).
        """
        principal, _ = await self.authorize(by, Action.CANCEL, check_id("run_id", run_id))
        # a reason that cannot be stored never stands between a cancel and its fence
        reason = sanitise(reason)
        result = await self.backend.cancel(run_id, by=principal.id, reason=reason)
        interrupted = self._interrupt_local(result.fenced)
        for released in result.released:
            self._changed(released)
        rest = [r for r in result.fenced if r not in interrupted]  # those advance once recorded
        if rest:
            self.spawn(self._advance_all, rest)
        return await self.receipt(run_id)

    def _interrupt_local(self, run_ids: Sequence[str]) -> set[str]:
        """Deliver a committed cancel to this process's runs: interrupt by phase policy
        and ask providers that can to cancel what is in flight. Once per run: the
        cancel's own return and its notification may both bring it."""
        interrupted: list[CallContext] = []
        for fenced in run_ids:
            run = self._local.get(fenced)
            if run is not None and not run.cancel_requested:
                inflight = list(run._inflight.values())
                at_providers = run._at_providers()
                if run._deliver_cancel():
                    interrupted.extend(inflight)
                for ctx in at_providers:
                    self._settler.ask_provider_cancel(ctx)
            self._changed(fenced)
        if interrupted:
            for ctx in interrupted:
                ctx.lost_recorded = True  # their own unwinding records nothing more
            self.spawn(self._record_interrupted, interrupted)
        for listener in self._cancel_listeners:
            listener(run_ids)
        return {ctx.run_id for ctx in interrupted}

    def on_cancel(self, listener: Callable[[Sequence[str]], None]) -> Callable[[], None]:
        """Call ``listener(run_ids)`` for every cancel this process commits or is notified
        of (the backend's notification), after the fence is durable: how an engine
        integration carries a stopline cancel into its own cancel. May be called twice
        for one cancel (its own return and its notification): make it idempotent.
        Returns a function that removes the listener."""
        self._cancel_listeners.append(listener)
        return lambda: self._cancel_listeners.remove(listener)

    async def end(self, run_id: str, by: str, error: BaseException | None = None) -> None:
        """A run that ended on its own: ``completed`` (``failed`` with ``error``), unless
        it was cancelled meanwhile, in which case it settles."""
        event = RunEvent.COMPLETE if error is None else RunEvent.FAIL
        reason = "" if error is None else f"{type(error).__name__}: {error}"
        with contextlib.suppress(IllegalTransition):  # cancelled elsewhere: settle below
            await self.backend.run_event(run_id, event, by=by, reason=reason)
        self._changed(run_id)
        await self._settler.advance(run_id)

    def _on_remote_cancel(self, run_ids: list[str]) -> None:
        """A cancel committed by any process (the backend's notification; our own too)."""
        self._interrupt_local(run_ids)

    async def _record_interrupted(self, ctxs: Sequence[CallContext]) -> None:
        """R3 for every call a cancel interrupted here: ``unknown``, in one transaction
        for the whole tree instead of one per call."""
        updates = [(ctx.op_id, _lost_update(ctx, Cause.USER_CANCEL, INTERRUPTED)) for ctx in ctxs]
        with anyio.CancelScope(shield=True):
            results = await self.backend.record_many(updates)
        runs: dict[str, None] = {}
        for (op_id, update), result in zip(updates, results, strict=True):
            if isinstance(result, IllegalTransition):
                self.spawn(self._resolve, op_id, update)  # it ended meanwhile: evidence
                continue
            runs[result.run_id] = None
            self._changed(result.run_id)
            self._after_truth_change(result)
            if result.status is OpStatus.UNKNOWN:
                self._settler.verify_soon(result)
        await self._advance_all(list(runs))  # what _resolve would have done, run by run

    async def _advance_all(self, run_ids: Sequence[str]) -> None:
        for run_id in run_ids:
            await self._settler.advance(run_id)

    async def receipt(self, run_id: str, *, by: str | Principal | None = None) -> Receipt:
        """What happened: this run's operations and those of the runs it owns exclusively.

        With ``by``, a principal of another tenant is told the run does not exist (R11).
        """
        run = await self.reads.run(check_id("run_id", run_id), by=by)
        ops = await self.backend.operations(run_id, descendants=True)
        # in hand, not durable yet: queued for the next group commit, or held by the
        # outbox until the ledger can take it
        return build_receipt(run, ops, recording=self._recording | self._outbox.held.keys())

    async def wait_settled(self, run_id: str, *, timeout: float | None = None) -> Receipt:
        """Wait until the receipt can no longer change by itself, and return it."""
        with anyio.fail_after(timeout):
            while True:
                receipt = await self.receipt(run_id)
                if receipt.settled:
                    return receipt
                await self.wait_for_change(run_id)

    async def wait_for_change(self, run_id: str, *, poll: float = 0.25) -> None:
        """Until this process changes the run, or ``poll`` s for other processes' changes."""
        event = self._changes.get(run_id)
        if event is None:
            event = self._changes[run_id] = anyio.Event()
        with anyio.move_on_after(poll):
            await event.wait()
        if not event.statistics().tasks_waiting and self._changes.get(run_id) is event:
            del self._changes[run_id]  # per-run state ends when nobody waits on it

    @property
    def idle(self) -> bool:
        """No background step (verification, settling, correction) is running now."""
        return self._settler.busy == 0

    async def wait_idle(self) -> None:
        """Until no background step is running (at once if none is)."""
        await self._settler.wait_idle()

    def _changed(self, run_id: str) -> None:
        event = self._changes.pop(run_id, None)
        if event is not None:
            event.set()

    # -- outcomes --------------------------------------------------------------
    async def late_response(
        self, op_id: str, verdict: Verdict, *, result: Any = None, ref: str = "", detail: str = ""
    ) -> OperationRecord:
        """R4: attach a response that came after cancel or timeout; never restarts anything.

        ``verdict`` says what the response proves: ``committed`` (a success),
        ``not_committed`` (the provider's refusal), ``unknown`` (kept only).
        """
        evidence = [Evidence(EvidenceKind.RESPONSE_DIGEST, digest(result), detail or "late")]
        if ref:
            evidence.insert(0, Evidence(EvidenceKind.PROVIDER_RECEIPT, ref))
        if verdict is Verdict.UNKNOWN:
            op = await self.backend.note(
                op_id, "late_response", {"evidence": [e.to_json() for e in evidence]}
            )
            self._changed(op.run_id)
            return op
        event = OpEvent.COMMITTED if verdict is Verdict.COMMITTED else OpEvent.REJECTED
        return await self._resolve(
            op_id,
            OutcomeUpdate(
                event, evidence, result=result, has_result=verdict is Verdict.COMMITTED, late=True
            ),
        )

    async def verify(self, op_id: str) -> OperationRecord:
        """Read the destination once for an operation in doubt; record what it proves."""
        op = await self.backend.get_operation(op_id)
        if op.status not in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW):
            return op
        return await self._settler.read_back(op)

    async def _resolve(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        """Record an outcome; agreeing repeats become evidence, contradictions go to review."""
        try:
            op = await self.backend.record(op_id, update)
        except IllegalTransition:
            current = await self.backend.get_operation(op_id)
            if current.status in CONTRADICTS.get(update.event, ()):
                op = await self.backend.record(
                    op_id,
                    dataclasses.replace(
                        update,
                        event=OpEvent.CONFLICT,
                        error=f"{update.event.value} contradicts recorded {current.status.value}",
                    ),
                )
            else:
                op = await self.backend.note(
                    op_id,
                    f"evidence_{update.event.value}",
                    {
                        "evidence": [e.to_json() for e in update.evidence],
                        "late": update.late,
                    },
                    cancel_state=update.cancel_state,
                )
        self._after_change(op)
        return op

    def _recorded(
        self, op_id: str, update: OutcomeUpdate, outcome: Callable[[], OperationRecord]
    ) -> None:
        """A deferred outcome has committed (``Backend.record_deferred``), called on the
        loop outside any task: hand it to the one task that finishes outcomes."""
        self._recording.discard(op_id)
        self._committed.append((op_id, update, outcome))
        self._committed_ready.set()

    async def _finish_outcomes(self, *, task_status: TaskStatus[None]) -> None:
        """What ``_resolve`` does after its write, for deferred outcomes: one task for
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
                    self.spawn(self._resolve, op_id, update)  # agreeing or contradicting
                    continue
                except StoplineError:  # not taken: held, retried behind the boundary
                    self.spawn(self._outbox.record, op_id, update)
                    continue
                self._after_change(op)

    async def _lost(self, ctx: CallContext, cause: Cause, detail: str) -> None:
        """R3: no answer is ``unknown``, never ``not_committed``. R13: when the effect can
        still land after now, the horizon is recorded with it."""
        await self._outbox.record(ctx.op_id, _lost_update(ctx, cause, detail))

    def _after_change(self, op: OperationRecord) -> None:
        self._changed(op.run_id)
        self._after_truth_change(op)
        if op.status is OpStatus.UNKNOWN:
            self._settler.verify_soon(op)
        run = self._local.get(op.run_id)
        if run is None or run.cancel_requested:
            self.spawn(self._settler.advance, op.run_id)
        elif run.pause_requested and not run._inflight:
            self.spawn(self._settle_pause, op.run_id)


def _lost_update(ctx: CallContext, cause: Cause, detail: str) -> OutcomeUpdate:
    """R3: a lost answer, with its horizon when the effect can still land after now (R13)."""
    evidence = [Evidence.local(cause.value, detail)]
    now = time.time()
    horizon = ctx.horizon(now)
    if horizon > now:
        evidence.append(Evidence.local("horizon", f"{horizon:.3f}"))
    return OutcomeUpdate(OpEvent.LOST, evidence, cause=cause)


def open(
    url: str | None = None,
    *,
    verify: VerifyBudget | None = None,
    observers: Sequence[Callable[[Backend], Backend]] = (),
    access: AccessPolicy | None = None,
    tools: Sequence[Tool[Any]] = (),
    durable_outcomes: bool = False,
) -> Ledger:
    """A ledger for ``url`` (default ``$STOPLINE_LEDGER`` or ``sqlite:///stopline.db``).

    Use it as ``async with stopline.open(url) as ledger``. ``tools`` are known
    from the start, so operations a crashed worker left in doubt can be verified.
    By default a call returns once its intent is durable and its outcome is queued:
    the outcome commits with the next write, within a few milliseconds (one fsync
    per call on SQLite). ``durable_outcomes=True`` is the strict mode: a call
    returns only once its outcome is durable too (docs/decisions/0022).
    """
    return Ledger(
        url,
        verify=verify,
        observers=observers,
        access=access,
        tools=tools,
        durable_outcomes=durable_outcomes,
    )
