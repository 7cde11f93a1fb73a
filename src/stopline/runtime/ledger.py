"""The ledger as the runtime uses it: runs, cancel, settlement, receipts.

``async with stopline.open(url) as ledger`` opens the backend and a task
group for background work that outlives a workflow's own scope: asking
providers to cancel, verifying unknown outcomes, settling cancelled runs.
Closing the ledger stops that work; what it had not finished stays truthful
in the ledger (``unknown``, ``cancel asked``) for the next start to pick up.

``Ledger`` is a facade: its methods delegate to named components sharing one
``Core`` (``runtime/core.py``): ``Lifecycle`` (authority, cancel, pause,
resume, approvals), ``Truth`` (recovery, reconciliation, compensation,
review), ``Outcomes`` (recording what calls proved), the ``Settler`` and the
``Outbox`` (docs/decisions/0031).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio

from stopline.domain.lifecycle import (
    AccessPolicy,
    Action,
    ApprovalRecord,
    OwnerOrTenantAdmin,
    Principal,
)
from stopline.domain.limits import check_id, check_seconds, check_wait
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.receipt import Receipt, build_receipt
from stopline.domain.vocab import OpStatus, Policy, RunState
from stopline.ledger import open_backend, resolve_url
from stopline.ledger.backend import Backend, RunSpec
from stopline.runtime.boundary import Health, typed
from stopline.runtime.compensate import Compensator
from stopline.runtime.core import Core
from stopline.runtime.lifecycle import Lifecycle, Resumed
from stopline.runtime.outbox import Outbox
from stopline.runtime.outcomes import Outcomes
from stopline.runtime.reads import Reads
from stopline.runtime.reconcile import ReconcileSummary
from stopline.runtime.recovery import RecoveryReport
from stopline.runtime.review import ReviewCase, ReviewItem, ReviewVerdict, evidence_settles
from stopline.runtime.run import Run
from stopline.runtime.scope import RunScope
from stopline.runtime.settle import Settler, VerifyBudget
from stopline.runtime.tool import Tool, Verdict
from stopline.runtime.truth import Truth

__all__ = ["Ledger", "RunScope", "VerifyBudget"]

R = TypeVar("R")


_REREAD_POLLS = 20  # wait_settled reads the receipt each 20 polls whatever the mark


class Ledger:
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
        core = self._core = Core(
            resolve_url(url),
            # R11: who may cancel, pause, resume, approve and resolve; the default lets
            # the owner, a tenant admin and an operator act
            access=access or OwnerOrTenantAdmin(),
            verify_budget=verify or VerifyBudget(),
            durable_outcomes=durable_outcomes,
            backend=backend,
            tools=tools,
        )
        # the components, each over the core; those others call are set on it
        core.outcomes = Outcomes(core)
        core.settler = Settler(core)
        core.outbox = Outbox(core)
        core.compensator = Compensator(core)
        self._lifecycle = Lifecycle(core)
        self._truth = Truth(core, self._lifecycle)
        # each observer wraps the backend to see every durable write (stopline.telemetry)
        self._observers = tuple(observers)
        # runs, operations and the log, read under the access policy (R11)
        self.reads = Reads(lambda: self.backend, lambda: self.access)

    # -- what the components share, read (and a few set) through the facade -----------
    @property
    def core(self) -> Core:
        """The runtime's shared state, for stopline's integrations (not a stable API)."""
        return self._core

    @property
    def url(self) -> str:
        return self._core.url

    @property
    def access(self) -> AccessPolicy:
        """R11: who may cancel, pause, resume, approve and resolve."""
        return self._core.access

    @property
    def durable_outcomes(self) -> bool:
        """True: a call returns once its outcome is durable (ADR 0022)."""
        return self._core.durable_outcomes

    @property
    def verify_budget(self) -> VerifyBudget:
        return self._core.verify_budget

    @property
    def cancel_answer_timeout(self) -> float:
        """Seconds the settler waits for a provider's answer to a cancel request."""
        return self._core.cancel_answer_timeout

    @cancel_answer_timeout.setter
    def cancel_answer_timeout(self, seconds: float) -> None:
        self._core.cancel_answer_timeout = check_wait("cancel_answer_timeout", seconds)

    @property
    def worker_id(self) -> str:
        """This process's identity in the ledger (operations record who passed the gate)."""
        return self._core.worker_id

    @property
    def health(self) -> Health:
        """What background work saw, behind its error boundary."""
        return self._core.health

    @property
    def backend(self) -> Backend:
        return self._core.backend

    @property
    def lease(self) -> float:
        """Seconds a worker's lease lasts; renewed at a third of it."""
        return self._truth.workers.lease

    @lease.setter
    def lease(self, seconds: float) -> None:
        self._truth.workers.lease = seconds

    # -- open and close ------------------------------------------------------------
    async def __aenter__(self) -> Ledger:
        core = self._core
        if not core.opened:
            core.use_backend(await open_backend(core.url))
        raw = core.backend  # observers wrap the seam's methods, not the notification hook
        for observe in self._observers:
            core.use_backend(observe(core.backend))
        tg = anyio.create_task_group()
        await tg.__aenter__()
        core.start(tg)
        try:
            # cancels committed by other processes reach this one's in-flight calls
            lifecycle = self._lifecycle
            watch = functools.partial(raw.watch_cancels, holding=lifecycle.holds_call)
            await tg.start(watch, lifecycle.on_remote_cancel)
            core.spawn(raw.cancel_watch_ended)  # a watch stopped for good: health.broken
            await tg.start(core.outcomes.finish)
            await self.recover()  # register this worker; reconcile what dead ones left (R2)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg = self._core.stop()
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                try:
                    await tg.__aexit__(None, None, None)
                except BaseExceptionGroup as group:  # only typed errors leave stopline.open
                    raise typed(group) from group
        finally:
            with anyio.CancelScope(shield=True):
                await self._core.outbox.flush()
                await self._truth.retire()
                await self._core.close()

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start background work that outlives the caller's scope."""
        self._core.spawn(fn, *args)

    # -- tools -------------------------------------------------------------------
    def register_tool(self, tool: Tool[Any]) -> None:
        """Known tools can be verified and cancelled from this process."""
        self._core.register_tool(tool)

    def adopt(self, fn: Callable[..., Awaitable[Any]]) -> Tool[Any]:
        """A plain async function used as a tool: effectful, with no capabilities."""
        return self._core.adopt(fn)

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
        saying what to do (resume it first, resolve its review, or start a new run). With
        the ``run_id`` of a run that is running, it enters that run; two entries (of
        this process's ledger or another's) that find no run of that id and make it at
        once both enter the one made, and a second block of this process gets
        ``AlreadyAttached``.
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
        return RunScope(self, self._core, spec, attach=run_id is not None)

    def local_run(self, run_id: str) -> Run | None:
        """This process's run of that id while its block is open, else None."""
        return self._core.runs.get(run_id)

    async def dispatch(
        self,
        run_id: str,
        tool: Tool[R] | Callable[..., Awaitable[R]],
        *args: Any,
        key: str,
        **kwargs: Any,
    ) -> R:
        """One gated call on an existing run, from outside its workflow.

        For queue consumers and retry timers: a message redelivered after the
        cancel is refused at the gate (``RunFenced``: ack it and drop it), and
        a redelivery of one that already committed returns the recorded result.
        """
        run = Run(self, self._core, await self.backend.get_run(run_id))
        return await run.call(tool, *args, key=key, **kwargs)

    async def cancel(self, run_id: str, *, by: str | Principal, reason: str = "") -> Receipt:
        """Fence the run and what it owns exclusively (durably, first, in one transaction),
        then interrupt local work by phase policy and ask providers that can to cancel.

        Idempotent (R7). Returns once each provider it asks has been asked (the request
        recorded and sent, not answered), with the receipt as it stands then, read in
        one snapshot; ``wait_settled`` gives the final one. Checked against ``access``
        (R11).
        """
        await self._lifecycle.cancel(run_id, by=by, reason=reason)
        return await self.receipt(run_id)

    def on_cancel(self, listener: Callable[[Sequence[str]], None]) -> Callable[[], None]:
        """Call ``listener(run_ids)`` for every cancel this process commits or is notified
        of (the backend's notification), after the fence is durable: how an engine
        integration carries a stopline cancel into its own cancel. May be called twice
        for one cancel (its own return and its notification): make it idempotent.
        Returns a function that removes the listener."""
        return self._lifecycle.on_cancel(listener)

    async def end(self, run_id: str, by: str, error: BaseException | None = None) -> None:
        """A run that ended on its own: ``completed`` (``failed`` with ``error``), unless
        it was cancelled meanwhile, in which case it settles."""
        await self._core.outcomes.end(run_id, by, error)

    async def receipt(self, run_id: str, *, by: str | Principal | None = None) -> Receipt:
        """What happened: this run's operations and those of the runs it owns exclusively.

        With ``by``, a principal of another tenant is told the run does not exist (R11).
        """
        # the backend's read checks the id (one rule, both engines)
        run, ops = await self.reads.run_and_operations(run_id, by=by, descendants=True)
        runs = await self.reads.tree_runs([(run, ops)])
        return build_receipt(run, ops, recording=self._core.outcomes.in_hand(), runs=runs)

    async def receipts(
        self, run_ids: Sequence[str], *, by: str | Principal | None = None
    ) -> dict[str, Receipt]:
        """``receipt`` of many runs (a page of them), read from one snapshot in one round
        trip: those that exist (and ``by`` may see), by id; the others are left out."""
        found, recording = await self.reads.trees(run_ids, by=by), self._core.outcomes.in_hand()
        runs = await self.reads.tree_runs(found.values())
        return {
            r: build_receipt(run, ops, recording=recording, runs=runs)
            for r, (run, ops) in found.items()
        }

    async def runs_with_receipts(
        self,
        *,
        by: str | Principal | None = None,
        state: RunState | str | None = None,
        owner: str | None = None,
        limit: int = 100,
    ) -> list[tuple[RunRecord, Receipt]]:
        """``reads.runs`` (newest first), each with its ``receipt``: the listing, each
        run's row and its receipt read from one snapshot, so no row mixes moments."""
        found = await self.reads.runs_with_trees(by=by, state=state, owner=owner, limit=limit)
        recording, runs = self._core.outcomes.in_hand(), await self.reads.tree_runs(found)
        return [
            (run, build_receipt(run, ops, recording=recording, runs=runs)) for run, ops in found
        ]

    async def wait_settled(self, run_id: str, *, timeout: float | None = None) -> Receipt:
        """Wait until the receipt can no longer change by itself, and return it.

        Read again at once when this process changes the run, else each 0.25 s only if
        something was committed to the ledger since the last read (one read of the
        ledger's change mark for all waiters of the process: many waiters on a quiet
        ledger read nothing more), and each 5 s regardless."""
        with anyio.fail_after(check_seconds("timeout", timeout)):
            polls = 0
            seen: str | None = None  # the ledger's mark before the last receipt read
            while True:
                mark = await self._core.ledger_mark()
                if mark != seen or polls % _REREAD_POLLS == 0:
                    receipt = await self.receipt(run_id)
                    if receipt.settled:
                        return receipt
                    seen = mark
                if await self.wait_for_change(run_id):
                    seen = None  # changed here: read it again whatever the mark says
                polls += 1

    async def wait_for_change(self, run_id: str, *, poll: float = 0.25) -> bool:
        """Until this process changes the run, or ``poll`` s for other processes' changes.
        True if this process changed it."""
        return await self._core.wait_for_change(run_id, poll=poll)

    @property
    def idle(self) -> bool:
        """No background step (verification, settling, correction) is running now."""
        return self._core.settler.busy == 0

    async def wait_idle(self) -> None:
        """Until no background step is running (at once if none is)."""
        await self._core.settler.wait_idle()

    # -- outcomes --------------------------------------------------------------
    async def late_response(
        self, op_id: str, verdict: Verdict, *, result: Any = None, ref: str = "", detail: str = ""
    ) -> OperationRecord:
        """R4: attach a response that came after cancel or timeout; never restarts anything.

        ``verdict`` says what the response proves: ``committed`` (a success),
        ``not_committed`` (the provider's refusal), ``unknown`` (kept only).
        """
        return await self._core.outcomes.late_response(
            op_id, verdict, result=result, ref=ref, detail=detail
        )

    async def verify(self, op_id: str) -> OperationRecord:
        """Read the destination once for an operation in doubt; record what it proves.

        One in review is read only if it went there for want of an answer; one in
        review for a contradiction (or a failed correction) is returned as it is: a
        read-back is part of that dispute, and a reviewer settles it (ADR 0052)."""
        op = await self.backend.get_operation(op_id)
        if op.status is OpStatus.UNKNOWN or await evidence_settles(self._core, op):
            return await self._core.settler.read_back(op)
        return op

    # -- lifecycle: authority, pause and resume, owners, approvals ---------------------
    async def authorize(
        self, who: str | Principal, action: Action, run_id: str
    ) -> tuple[Principal, RunRecord]:
        """Check ``who`` may do ``action`` to the run; a denial is audited, then raised."""
        return await self._lifecycle.authorize(who, action, run_id)

    async def pause(self, run_id: str, *, by: str | Principal, reason: str = "") -> Receipt:
        """Stop dispatch at the next boundary; in-flight work finishes and is recorded."""
        await self._lifecycle.pause(run_id, by=by, reason=reason)
        return await self.receipt(run_id)

    async def resume(self, run_id: str, *, by: str | Principal) -> Resumed:
        """Back to running with ``initiate`` re-granted by a principal allowed to resume.

        A cancelled run resumes only when every operation is resolved; approvals that
        expired meanwhile are marked so and must be asked for again (R10).
        """
        return await self._lifecycle.resume(run_id, by=by)

    async def share(self, run_id: str, *, with_owner: str, by: str | Principal) -> None:
        """Add the run ``with_owner`` as another owner of a shared run (reference-counted),
        if ``by`` may share both runs (``Action.SHARE``), of one tenant (R6, R11)."""
        await self._lifecycle.share(run_id, with_owner=with_owner, by=by)

    async def request_approval(
        self, run_id: str, key: str, *, approver: str, by: str | Principal
    ) -> ApprovalRecord:
        """Ask ``approver`` to approve the operation ``key`` of the run."""
        return await self._lifecycle.request_approval(run_id, key, approver=approver, by=by)

    async def approve(
        self, approval_id: str, *, by: str | Principal, ttl: float | None = None
    ) -> ApprovalRecord:
        """Grant an approval, valid for ``ttl`` seconds (forever when None)."""
        return await self._lifecycle.decide(approval_id, by, granted=True, ttl=ttl)

    async def deny(self, approval_id: str, *, by: str | Principal) -> ApprovalRecord:
        return await self._lifecycle.decide(approval_id, by, granted=False, ttl=None)

    async def why_not_approved(self, run_id: str, op_id: str) -> str:
        return await self._lifecycle.why_not_approved(run_id, op_id)

    # -- truth: recovery, reconciliation, compensation, review ---------------------------
    async def recover(self) -> RecoveryReport:
        """Register this worker, mark what dead workers left in flight ``unknown``,
        queue every unknown operation for verification, and keep the lease alive.

        ``Ledger.__aenter__`` calls it; it reads only the open-operations index.
        """
        return await self._truth.recover()

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
        return await self._truth.reconcile(
            tools=tools,
            budget=budget,
            accepted_after=accepted_after,
            limit=limit,
            on_progress=on_progress,
        )

    async def compensate(
        self, op_id: str, *, by: str | Principal, reason: str = "", wait: bool = True
    ) -> OperationRecord:
        """Correct a committed operation with its tool's compensator (R7: a cancel of
        the run does not stop it). Returns the corrected operation: ``compensated``,
        ``compensating`` (``wait=False``, or the correction's outcome is in doubt), or
        ``needs_review`` (the correction failed)."""
        return await self._truth.compensate(op_id, by=by, reason=reason, wait=wait)

    async def stop_compensation(self, op_id: str, *, by: str | Principal, reason: str = "") -> bool:
        """Interrupt the correction of ``op_id`` running in this process (R7's explicit ask).

        The ask is recorded either way; returns whether a running correction was
        interrupted here. Its outcome becomes ``unknown`` and is verified as usual.
        """
        return await self._truth.stop_compensation(op_id, by=by, reason=reason)

    async def review_items(self, *, limit: int = 1000) -> list[ReviewItem]:
        """Operations waiting for a human (``needs_review``, failed corrections)."""
        return await self._truth.review_items(limit=limit)

    async def inspect_review(self, op_id: str) -> ReviewCase:
        """One item with its run, all its evidence, its events and its corrections."""
        return await self._truth.inspect_review(op_id)

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
        op = await self._truth.resolve_review(op_id, verdict, by=by, note=note)
        return await self.receipt(op.run_id)
