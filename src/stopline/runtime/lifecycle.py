"""Lifecycle: authority, cancel and its delivery, pause and resume, approvals, owners.

``Lifecycle`` is the component of ``Ledger`` that stops runs and lets them go
on (CONTRACT.md R1, R6, R7, R9, R10, R11). Every governed action is checked
against the access policy (``ledger.access``) and lands in the audit trail:
an allowed one as its own event (which records who), a denied one as a
``denied`` event, then ``NotPermitted``. A committed cancel, this process's
own or another's (the backend's notification), is delivered here to the runs
of this process by their phase policy.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import sniffio

from stopline.domain.guidance import what_to_do
from stopline.domain.lifecycle import (
    Action,
    ApprovalRecord,
    ApprovalStatus,
    CancelResult,
    Checkpoint,
    Principal,
)
from stopline.domain.limits import check_backoff, check_id, check_seconds
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunState
from stopline.errors import (
    ApprovalNeeded,
    IllegalTransition,
    NotPermitted,
    RunEnded,
    UnknownRun,
)
from stopline.ledger.backend import FENCE_COMMITTED
from stopline.runtime import sharing

if TYPE_CHECKING:
    from stopline.runtime.context import CallContext
    from stopline.runtime.core import Core
    from stopline.runtime.run import Run

__all__ = ["ApprovalNeeded", "Lifecycle", "Resumed", "Retry", "outside_task", "told_asyncio"]

T = TypeVar("T")


def told_asyncio(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with sniffio told the loop is asyncio, for a plain callback of the
    loop. There sniffio finds no task to tell by, and under an application's own
    ``asyncio.run`` no anyio runner has set its context variable: anyio could not start
    a task or make a scope (what a delivery's records and asks do)."""
    told = sniffio.current_async_library_cvar.set("asyncio")
    try:
        return fn(*args)
    finally:
        sniffio.current_async_library_cvar.reset(told)


async def outside_task(fn: Callable[[], T]) -> T:
    """``fn()`` (asyncio) in the loop's next turn, as a plain callback, while the caller
    waits shielded; its result or its error comes back to the caller.

    anyio's ``CancelScope.cancel`` appends the repr of the task it runs in to its
    message, and asyncio's task repr formats the task's coroutine and callbacks: ~70 µs
    here, nearly half of what delivering a cancel costs. Outside a task there is none
    to format. The calls a cancel interrupts are woken in that turn, before the caller."""
    box: list[Any] = []
    ready = anyio.Event()

    def run() -> None:
        try:
            box.append(told_asyncio(fn))
        except BaseException as exc:  # handed to the caller, raised there
            box.append(_Raised(exc))
        finally:
            ready.set()

    asyncio.get_running_loop().call_soon(run)
    with anyio.CancelScope(shield=True):
        await ready.wait()
    got = box[0]
    if isinstance(got, _Raised):
        raise got.error
    return got  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, slots=True)
class _Raised:
    error: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """Attempts of one operation, each through the gate under the same id.

    A retry that fires after the fence is refused there (R1); an attempt whose
    predecessor's outcome is unknown is read back first, never re-sent blindly (R5).
    """

    attempts: int = 3
    backoff: float = 0.5
    factor: float = 2.0
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        """Checked when made (``InvalidInput``): a NaN backoff failed between two
        attempts, after the first had passed the gate, and ``attempts=0`` made one."""
        check_backoff(
            self.attempts, backoff=self.backoff, factor=self.factor, max_backoff=self.max_backoff
        )

    def delays(self) -> list[float]:
        out, delay = [], self.backoff
        for _ in range(self.attempts - 1):
            out.append(min(delay, self.max_backoff))
            delay *= self.factor
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    run: RunRecord
    checkpoint: Checkpoint | None  # where the workflow may continue from
    expired_approvals: tuple[str, ...]  # to be asked for again (R10)

    def to_json(self) -> dict[str, Any]:
        checkpoint = self.checkpoint
        return {
            "run_id": self.run.id,
            "run_state": self.run.state.value,
            "checkpoint": None
            if checkpoint is None
            else {
                "seq": checkpoint.seq,
                "name": checkpoint.name,
                "state": checkpoint.state,
                "operations": list(checkpoint.operations),
            },
            "expired_approvals": list(self.expired_approvals),
        }

    def __str__(self) -> str:
        if self.run.state.ended:  # it ended on its own (a pause lets a run complete): a no-op
            return f"Run {self.run.id} has ended ({self.run.state.value}): nothing to resume."
        where = "the start" if self.checkpoint is None else f"checkpoint {self.checkpoint.name!r}"
        expired = (
            f"; ask again for {len(self.expired_approvals)} expired approvals"
            if (self.expired_approvals)
            else ""
        )
        return (
            f"Resumed run {self.run.id}: a workflow still waiting at its gate goes on by "
            f"itself; else re-enter the run with the same run id, from {where} (completed "
            f"actions are returned from the ledger, not repeated){expired}."
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _Cut:
    """What a delivery's first half did (``Lifecycle._cut``), for its second."""

    run_ids: Sequence[str]
    # this process's runs not told before: the calls their providers are asked about
    providers: dict[str, list[CallContext]]
    inflight: dict[str, tuple[CallContext, ...]]  # their calls in flight, before the cut
    cut_runs: set[str]  # the runs interrupted
    interrupted: list[CallContext]  # their calls in flight: recorded by the cancel


class _EarlyCut:
    """A cancel's cut made as its fence commits (``FENCE_COMMITTED``, ADR 0043): on the
    loop, outside any task, before the canceller resumes. The block it is entered for is
    the canceller's wait: it cuts only inside it (``armed``: asyncio), and once (a
    second commit through it, an observer's retry, would replace a cut not yet
    followed; what it fenced is delivered as any cancel's notification is). A block
    that fails after the cut still follows it (records, asks)."""

    __slots__ = ("cut", "error", "follow", "hooked", "open", "take")

    def __init__(
        self,
        take: Callable[[Sequence[str]], _Cut],
        follow: Callable[[_Cut], object],
        *,
        armed: bool = True,
    ) -> None:
        self.take, self.follow = take, follow  # ``Lifecycle._cut``, ``Lifecycle._follow``
        self.open = armed
        self.cut: _Cut | None = None
        self.error: BaseException | None = None
        self.hooked: contextvars.Token[Callable[[CancelResult], None] | None] | None = None

    def __call__(self, result: CancelResult) -> None:
        if not self.open:  # its canceller went on without it: delivered as others are
            return
        self.open = False
        try:
            self.cut = told_asyncio(self.take, result.fenced)
        except BaseException as exc:  # handed to the canceller, raised there
            self.error = exc

    def __enter__(self) -> _EarlyCut:
        self.hooked = FENCE_COMMITTED.set(self if self.open else None)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.open = False
        if self.hooked is not None:
            FENCE_COMMITTED.reset(self.hooked)
        if kind is not None and self.cut is not None:
            self.follow(self.cut)  # what was cut is followed whatever comes after

    def taken(self) -> _Cut | None:
        """The cut made at the commit, if one was; its error raised here."""
        if self.error is not None:
            raise self.error
        return self.cut


class Lifecycle:
    """Authority, cancel, pause, resume and approvals, over the runtime's ``Core``."""

    def __init__(self, core: Core) -> None:
        self._core = core
        # called with the fenced run ids of every cancel this process learns of
        self._cancel_listeners: list[Callable[[Sequence[str]], None]] = []

    # -- authority (R11) ------------------------------------------------------------
    async def authorize(
        self, who: str | Principal, action: Action, run_id: str, *, named: bool = False
    ) -> tuple[Principal, RunRecord]:
        """Check ``who`` may do ``action`` to the run; a denial is audited, then raised.
        ``named``: the record names ``who`` for it (an approval's approver): the policy
        is not asked, but a principal of another tenant is refused all the same."""
        core = self._core
        principal = Principal.of(who)
        check_id("by", principal.id)
        check_id("run_id", run_id)
        local = core.runs.get(run_id)
        # a run of this process: owner and tenant never change, so no read before the fence
        run = local.record if local is not None else await core.backend.get_run(run_id)
        if not core.access.visible(principal, run):
            await core.backend.audit(
                run_id,
                principal=principal.id,
                action=action.value,
                allowed=False,
                detail="other tenant",
            )
            raise UnknownRun(run_id)  # another tenant never learns the run exists
        if not named and not core.access.allows(principal, action, run):
            await core.backend.audit(
                run_id,
                principal=principal.id,
                action=action.value,
                allowed=False,
                detail="denied by policy",
            )
            raise NotPermitted(f"{principal.id} may not {action.value} run {run_id!r}")
        return principal, run

    # -- cancel (R1, R2, R7) -------------------------------------------------------------
    async def cancel(self, run_id: str, *, by: str | Principal, reason: str = "") -> None:
        """Fence the run and what it owns exclusively (durably, first, in one transaction),
        then deliver the cancel to this process's runs. Returns once the providers it
        asks to cancel have been asked (the request recorded and sent, not answered)."""
        core = self._core
        principal, _ = await self.authorize(by, Action.CANCEL, check_id("run_id", run_id))
        asyncio_loop, home = sniffio.current_async_library() == "asyncio", core.at_home_now
        with _EarlyCut(self._cut, self._follow, armed=asyncio_loop and home) as early:
            result = await core.backend.cancel(run_id, by=principal.id, reason=reason)
        if not home:  # delivered in the ledger's own loop, as a notification (ADR 0078)
            return core.at_home_soon(self.on_remote_cancel, list(result.fenced))
        cut = early.taken()
        if cut is None:  # the backend made no cut as it committed
            cut = await self._cut_first(result.fenced, asyncio_loop=asyncio_loop)
        interrupted, asked = self._follow(cut)
        for released in result.released:
            core.changed(released)
        rest = [r for r in result.fenced if r not in interrupted]  # those advance once recorded
        if rest:
            core.spawn(core.settler.advance_many, rest)
        for sent in asked:
            await sent.wait()

    async def _cut_first(self, run_ids: Sequence[str], *, asyncio_loop: bool) -> _Cut:
        """``_cut`` for a cancel committed here: the interrupted calls see their cancel
        before the rest of the delivery (providers asked, records spawned, listeners
        told), one turn of the loop later, waited for shielded, so that the rest always
        follows, even in a run cancelling itself. On asyncio (``asyncio_loop``, as the
        canceller asked sniffio once) the cut runs in that turn outside any task
        (``outside_task``)."""
        if not any(run_id in self._core.runs for run_id in run_ids):
            return self._cut(run_ids)  # nothing of this process to interrupt
        if asyncio_loop:
            return await outside_task(functools.partial(self._cut, run_ids))
        cut = self._cut(run_ids)
        if cut.interrupted:
            await anyio.lowlevel.cancel_shielded_checkpoint()
        return cut

    def deliver_cancel(self, run_ids: Sequence[str]) -> set[str]:
        """Deliver a committed cancel to this process's runs: interrupt by phase policy
        and ask providers that can to cancel what is in flight. Once per run: the
        cancel's own return and its notification may both bring it. Returns the runs
        whose calls it interrupted."""
        return self._deliver(run_ids)[0]

    def _deliver(self, run_ids: Sequence[str]) -> tuple[set[str], list[anyio.Event]]:
        """``deliver_cancel``, and the events of the asks it started (each set once its
        request is recorded and sent)."""
        return self._follow(self._cut(run_ids))

    def _cut(self, run_ids: Sequence[str]) -> _Cut:
        """A delivery's first half: this process's runs among ``run_ids`` not yet told,
        interrupted by policy, and the calls that interrupts marked as recorded by the
        cancel (their own unwinding records nothing: ``_follow`` records them together).
        Nothing here waits or starts anything."""
        core = self._core
        fresh: dict[str, Run] = {}
        for fenced in run_ids:
            run = core.runs.get(fenced)
            if run is not None and not run.cancel_requested:
                fresh[fenced] = run
        inflight = {run_id: run.in_flight for run_id, run in fresh.items()}
        cut_runs = self._interrupt(list(fresh.values()))
        interrupted = [ctx for run_id in fresh if run_id in cut_runs for ctx in inflight[run_id]]
        for ctx in interrupted:
            ctx.lost_recorded = True
        # the calls whose providers are asked, taken as they are now, before any unwinds
        providers = {run_id: run.at_providers() for run_id, run in fresh.items()}
        return _Cut(run_ids, providers, inflight, cut_runs, interrupted)

    def _follow(self, cut: _Cut) -> tuple[set[str], list[anyio.Event]]:
        """A delivery's second half: ask the providers of the runs' calls, record the
        interrupted calls (their runs' steps wait for the record; closing: no step
        follows), and tell whoever waits on the runs or listens for cancels."""
        core = self._core
        asked: list[anyio.Event] = []
        for run_id, at_providers in cut.providers.items():  # in flight, and cut just before
            all_cut = run_id in cut.cut_runs  # those in flight are cut now: every one was
            flying = {c.op_id for c in cut.inflight[run_id]}
            for ctx in at_providers:
                sent = core.settler.ask_provider_cancel(ctx, cut=all_cut or ctx.op_id not in flying)
                if sent is not None:
                    asked.append(sent)
        for fenced in cut.run_ids:
            core.changed(fenced)
        if cut.interrupted:
            held = (ctx.run_id for ctx in cut.interrupted)
            release = core.settler.hold_steps(held) if core.running else None
            core.spawn(core.outcomes.record_interrupted, cut.interrupted, release)
        for listener in self._cancel_listeners:
            listener(cut.run_ids)
        return {ctx.run_id for ctx in cut.interrupted}, asked

    def _interrupt(self, runs: list[Run]) -> set[str]:
        """Interrupt the runs by policy, cancelling as few scopes as anyio lets us prove.

        In the order their blocks opened (``Run.opened``), each run either
        cancels its own scope or is *covered*: a cancel delivered just before, in this
        same step, to a run whose block opened earlier has reached this block's task
        (the task's cancel count went up; nothing else runs in between). Then that
        earlier scope encloses this block: both are open in that task, and of two
        scopes open in one task the one opened later is inside. anyio delivers a scope's
        cancel to everything inside it that is not shielded, as this block's own would,
        so one ``cancel()`` reaches a whole nested tree. Where the loop cannot tell
        (trio) or the count did not move (a shield between, a block in a task group
        outside its owner's, the cancelling task itself), the run cancels its own scope,
        as before. Returns the runs whose work was interrupted."""
        # sorted by their own numbers: the other runs open in this process are not read
        runs = sorted(runs, key=lambda run: run.opened)
        before = {
            run.id: run.block_task_cancels() for run in runs if run.block_task_cancels is not None
        }
        out: set[str] = set()
        for run in runs:
            count, was = run.block_task_cancels, before.get(run.id)
            covered = count is not None and was is not None and count() > was
            if run.deliver_cancel(covered=covered):
                out.add(run.id)
        return out

    def on_remote_cancel(self, run_ids: list[str]) -> None:
        """A cancel committed by any process (the backend's notification; our own too).
        On asyncio, delivered in the loop's next turn, outside the watch's task
        (``outside_task``)."""
        if sniffio.current_async_library() == "asyncio":
            asyncio.get_running_loop().call_soon(told_asyncio, self.deliver_cancel, run_ids)
        else:
            self.deliver_cancel(run_ids)

    def holds_call(self, run_id: str) -> bool:
        """A run of this process with a call whose tool has not answered: a cancel's
        notification naming it needs no check that it is still fenced (ADR 0041)."""
        run = self._core.runs.get(run_id)
        return run is not None and run.awaits_a_tool()

    def on_cancel(self, listener: Callable[[Sequence[str]], None]) -> Callable[[], None]:
        """Call ``listener(run_ids)`` for every cancel this process learns of; returns a
        function that removes it."""
        self._cancel_listeners.append(listener)
        return lambda: self._cancel_listeners.remove(listener)

    # -- pause and resume (R9, R10) ---------------------------------------------------
    async def pause(self, run_id: str, *, by: str | Principal, reason: str = "") -> None:
        """Stop dispatch at the next boundary; in-flight work finishes and is recorded.
        Idempotent: a run already pausing or paused is left as it is."""
        core = self._core
        principal, _ = await self.authorize(by, Action.PAUSE, run_id)
        for paused in await core.backend.pause(run_id, by=principal.id, reason=reason):
            local = core.runs.get(paused)
            if local is not None:
                local.pause_requested = True
            core.changed(paused)

    async def resume(self, run_id: str, *, by: str | Principal) -> Resumed:
        """Back to running with ``initiate`` re-granted by a principal allowed to resume.

        A cancelled run resumes only when every operation is resolved; approvals that
        expired meanwhile are marked so and must be asked for again (R10).
        """
        core = self._core
        principal, current = await self.authorize(by, Action.RESUME, run_id)
        try:
            run, expired = await core.backend.resume(run_id, by=principal.id)
        except IllegalTransition as exc:
            state = (await core.backend.get_run(run_id)).state
            if state is RunState.RUNNING:
                raise
            latest = dataclasses.replace(current, state=state)
            raise RunEnded(run_id, state, what_to_do(latest)) from exc
        # the runs it owns resumed with it: their blocks open here go on too
        for rid, local in list(core.runs.items()):
            stopped = local.pause_requested or local.cancel_requested
            if rid == run_id or (
                stopped and (await core.backend.get_run(rid)).state is RunState.RUNNING
            ):
                local.pause_requested = local.cancel_requested = local.covered = False
                core.changed(rid)
        core.changed(run_id)
        return Resumed(run, await core.backend.last_checkpoint(run_id), tuple(expired))

    # -- ownership (R6) -------------------------------------------------------------
    async def share(self, run_id: str, *, with_owner: str, by: str | Principal) -> None:
        """Add the run ``with_owner`` as another owner of a shared run (reference-counted),
        if ``by`` may share both (R11; ``sharing.share``)."""
        await sharing.share(self._core, self.authorize, run_id, with_owner=with_owner, by=by)

    # -- approvals (S5) ---------------------------------------------------------------
    async def request_approval(
        self, run_id: str, key: str, *, approver: str, by: str | Principal
    ) -> ApprovalRecord:
        """Ask ``approver`` to approve the operation ``key`` of the run, if ``by`` may
        (R11: the approver named needs no other leave to grant it)."""
        principal, _ = await self.authorize(by, Action.REQUEST_APPROVAL, run_id)
        scope, approver = f"{run_id}/{check_id('key', key)}", check_id("approver", approver)
        approval_id = f"approval_{uuid.uuid4().hex[:12]}"
        return await self._core.backend.request_approval(
            approval_id, run_id, scope, approver=approver, requested_by=principal.id
        )

    async def decide(
        self, approval_id: str, who: str | Principal, *, granted: bool, ttl: float | None
    ) -> ApprovalRecord:
        """Grant or deny an approval; a grant is valid for ``ttl`` seconds (None: forever)."""
        core = self._core
        ttl = check_seconds("ttl", ttl)  # a NaN grant could never be used, a str failed
        principal = Principal.of(who)
        approval = await core.backend.get_approval(approval_id)
        named = principal.id == approval.approver  # of the run's tenant all the same
        await self.authorize(principal, Action.APPROVE, approval.run_id, named=named)
        expires_at = None if ttl is None else time.time() + ttl
        decided = await core.backend.decide_approval(
            approval_id, granted=granted, by=principal.id, expires_at=expires_at
        )
        core.changed(approval.run_id)
        return decided

    async def why_not_approved(self, run_id: str, op_id: str) -> str:
        approvals = [a for a in await self._core.backend.approvals(run_id) if a.scope == op_id]
        if not approvals:
            return "no approval was asked for"
        latest = approvals[-1]
        if latest.status is ApprovalStatus.GRANTED:
            return "the approval expired; ask for it again"
        return f"the approval is {latest.status.value}"
