"""What the explorer does at a held point: cancel, cancel twice, crash the worker ...

An action is a small object with a name and up to two steps: ``at_point``
runs while the workflow is held at the point, ``after_done`` once the
workflow has ended (and before the run is awaited settled). ``unsupported``
says when this runtime lacks what the action needs (the cell prints
``n/a``); ``applies`` says when the action means nothing at a point (a
dropped response after the response was delivered). Both are asked at run
time, so lifecycle actions light up as soon as the ledger grows
``pause``/``resume``/approvals/compensation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from stopline.domain.model import CANCEL_ANSWERS, CancelState
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Cancellable, OpStatus, RunState
from stopline.runtime.context import CallContext
from stopline.runtime.tool import CompensateFn, Verdict
from stopline.testing.barriers import Barrier
from stopline.testing.providers import CancelBehaviour, FakeProvider, in_runs

if TYPE_CHECKING:
    from stopline.runtime.ledger import Ledger
    from stopline.testing._hooks import Hooks

__all__ = [
    "CORE_ACTIONS",
    "DEFAULT_ACTIONS",
    "Action",
    "ActionContext",
    "Cancel",
    "CancelResume",
    "CancelTwice",
    "Compensate",
    "CompensateAgain",
    "CrashLateCommit",
    "CrashWorker",
    "DropConnection",
    "ExpireApproval",
    "LateResponse",
    "PauseResume",
    "Point",
    "RefuseCancel",
]

BY = "explorer:user"
# a provider's answer to a cancel request, in the ledger (None leaves it ASKED)
_ANSWERED = CANCEL_ANSWERS | {CancelState.UNANSWERED}


async def _either(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of ``waits`` returns."""
    async with anyio.create_task_group() as tg:

        async def wait(fn: Callable[[], Awaitable[object]]) -> None:
            await fn()
            tg.cancel_scope.cancel()

        for fn in waits:
            tg.start_soon(wait, fn)


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    """A barrier point a workflow passed: ``accepted/upload``, ``after_gate/notify#2``."""

    id: str
    name: str  # the barrier's own name: "accepted", "after_gate", a user's point
    source: str  # the provider or tool it belongs to ("" for a workflow's own point)
    occurrence: int  # 1 for the first time the workflow passes it
    kind: str = "provider"  # "provider", "runtime" or "workflow"
    # the discovery run's provider: what it declares (cancellable, cancel_fn), for
    # ``applies``; a fault goes into the cell's own provider (``ActionContext.provider``)
    provider: FakeProvider | None = None

    @property
    def reach_name(self) -> str:
        """The name its ``Barriers`` knows it by."""
        return f"{self.name}/{self.source}" if self.kind == "runtime" else self.name


class ActionContext:
    """What an action may touch in one cell."""

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        point: Point,
        providers: dict[str, FakeProvider],
        hooks: Hooks,
        workflow_scope: anyio.CancelScope,
        held: list[Barrier],
        workflow_done: anyio.Event,
    ) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.point = point
        self.providers = providers
        self.hooks = hooks
        self._workflow_scope = workflow_scope
        self._held = held
        self.workflow_done = workflow_done  # set once the workflow's run block has exited
        # every receipt a cancel returned, with the effects the providers had committed then
        self.cancels: list[tuple[Receipt, frozenset[str]]] = []
        self.late: list[str] = []  # operation ids a late response was delivered for
        self.crashed = False
        # the workflow entered again under the same run id, its providers kept (a
        # ``CancelResume``'s; set by the cell), and whether an action did so
        self.reenter: Callable[[], Awaitable[None]] | None = None
        self.resumed = False
        self.settle_timeout: float | None = None  # the cell's wait for its run to settle
        self._undo: list[Callable[[], None]] = []  # ``patch``es to put back, last first

    @property
    def provider(self) -> FakeProvider:
        """This cell's provider at the point (each cell has fresh ones), to inject a fault into."""
        return self.providers[self.point.source]

    def patch(self, obj: object, name: str, value: object) -> None:
        """Set ``obj.name`` to ``value`` for the rest of the cell (``undo`` puts it back)."""
        before = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(partial(setattr, obj, name, before))

    def undo(self) -> None:
        """Put back what ``patch`` set, last first (the cell does, once it has ended)."""
        while self._undo:
            self._undo.pop()()

    def release(self) -> None:
        """Let the workflow go on from the held point."""
        for barrier in self._held:
            barrier.release()

    async def cancel(self, by: str = BY, reason: str = "explorer") -> Receipt:
        """Cancel the run, then wait (on ledger changes, no sleeps) for the answers of
        the providers the runtime asked to cancel, so the cell plays out the same way
        every time: those of the calls in flight in the run and in the child runs the
        cancel fences with it (a child's call let go before its canceller answered
        raced the answer: the same cell committed once and not the next time)."""
        ledger = self.ledger
        runs = [ledger.local_run(run_id) for run_id in sorted(await self.tree())]
        inflight = [ctx for run in runs if run is not None for ctx in run.in_flight]
        receipt = await ledger.cancel(self.run_id, by=by, reason=reason)
        every = [k for p in self.providers.values() for k in p.effects]  # as it returned
        tree = await self.tree()
        self.cancels.append((receipt, frozenset(k for k in every if in_runs(k, tree))))
        for ctx in inflight:
            tool = ctx.tool
            if tool.cancel_fn is None or tool.cancellable is Cancellable.NEVER:
                continue
            if ctx.is_accepted and tool.cancellable is not Cancellable.AFTER_ACCEPTED:
                continue
            while True:
                op = await ledger.backend.get_operation(ctx.op_id)
                if op.cancel_state in _ANSWERED or not op.status.in_flight:
                    break
                if op.cancel_state is CancelState.ASKED:
                    # asked: the answer may be None ("asked; no answer to tell"), which
                    # changes nothing in the ledger; the ask is over once the runtime idles
                    if ledger.idle:
                        break
                    await _either(partial(ledger.wait_for_change, ctx.run_id), ledger.wait_idle)
                else:
                    await ledger.wait_for_change(ctx.run_id)
        return receipt

    async def tree(self) -> set[str]:
        """The ids of the run and of its child runs with an operation: the runs its
        receipt tells (S4)."""
        ops = await self.ledger.backend.operations(self.run_id, descendants=True)
        return {self.run_id, *(op.run_id for op in ops)}

    def crash(self) -> None:
        """Kill the worker: nothing more reaches the ledger, the workflow task is abandoned."""
        self.crashed = True
        self.hooks.crash()
        self._workflow_scope.cancel()
        self.release()


class Action:
    name: ClassVar[str] = ""

    def unsupported(self, ledger: Ledger) -> str | None:
        """Why this runtime cannot do the action, or None."""
        return None

    def applies(self, point: Point) -> str | None:
        """Why the action means nothing at ``point``, or None."""
        return None

    async def at_point(self, ctx: ActionContext) -> None:
        raise NotImplementedError

    async def after_done(self, ctx: ActionContext) -> None:
        return None

    def __repr__(self) -> str:
        return f"<Action {self.name}>"


class Cancel(Action):
    name = "cancel"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()


class CancelTwice(Action):
    name = "cancel_twice"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel(reason="first")
        await ctx.cancel(reason="second")


class LateResponse(Action):
    """Cancel, then deliver each provider's real answer again once nobody waits (R4)."""

    name = "late_response"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()

    async def after_done(self, ctx: ActionContext) -> None:
        tree = await ctx.tree()

        async def deliver(key: str, response: Any) -> None:
            await ctx.ledger.late_response(key, Verdict.COMMITTED, result=response, ref=key)

        for provider in ctx.providers.values():
            for key in list(provider.committed):
                if in_runs(key, tree):
                    await provider.respond_late(key, deliver)
                    ctx.late.append(key)
            refused = {k for k in provider.requests if in_runs(k, tree)}
            for key in sorted(refused - set(provider.committed) - provider.in_progress):
                await ctx.ledger.late_response(key, Verdict.NOT_COMMITTED, ref=key)
                ctx.late.append(key)


_BEFORE_RESPONSE = frozenset({"before_dispatch", "after_gate", "received", "accepted", "committed"})


class DropConnection(Action):
    """The provider commits, then the connection drops before its response."""

    name = "drop_connection"

    def applies(self, point: Point) -> str | None:
        if point.provider is None:
            return "no provider call at this point"
        if point.name not in _BEFORE_RESPONSE:
            return "the response has already left the provider"
        return None

    async def at_point(self, ctx: ActionContext) -> None:
        ctx.provider.drop_response = True


class RefuseCancel(Action):
    """The provider answers the cancel with a refusal and goes on (S10)."""

    name = "refuse_cancel"

    def applies(self, point: Point) -> str | None:
        provider = point.provider
        if provider is None or provider.tool.cancel_fn is None:
            return "the provider cannot cancel: nothing to refuse"
        if point.name == "received":
            return None
        if point.name == "accepted" and provider.tool.cancellable is Cancellable.AFTER_ACCEPTED:
            return None
        return "the provider is not asked to cancel at this point"

    async def at_point(self, ctx: ActionContext) -> None:
        ctx.provider.on_cancel = CancelBehaviour.REFUSE
        await ctx.cancel()


class CrashWorker(Action):
    """Kill the worker at the point; a fresh process reopens the ledger (S17)."""

    name = "crash"

    async def at_point(self, ctx: ActionContext) -> None:
        ctx.crash()


class CrashLateCommit(Action):
    """Kill the worker while its request is at the provider, which carries it out all the
    same, with nobody left to tell; a fresh process reopens the ledger and recovers
    (S17, R3, R13). The ledger never heard the outcome: the call is ``unknown`` until
    a read-back finds the effect, ``committed``; never ``not_committed``."""

    name = "crash_late_commit"

    def applies(self, point: Point) -> str | None:
        if point.kind != "provider" or point.provider is None:
            return "no request at a provider at this point"
        if point.name not in ("received", "accepted"):
            return "the provider holds no request it has yet to commit here"
        return None

    async def at_point(self, ctx: ActionContext) -> None:
        ctx.provider.outlives_caller = True
        ctx.crash()


class PauseResume(Action):
    name = "pause_resume"

    def unsupported(self, ledger: Ledger) -> str | None:
        if hasattr(ledger, "pause") and hasattr(ledger, "resume"):
            return None
        return "this runtime has no ledger.pause/ledger.resume"

    async def at_point(self, ctx: ActionContext) -> None:
        ledger: Any = ctx.ledger
        await ledger.pause(ctx.run_id, by=BY)
        ctx.release()
        # until the run stops at its next boundary, or the workflow ends first
        while not ctx.workflow_done.is_set():
            if (await ctx.ledger.backend.get_run(ctx.run_id)).state is not RunState.PAUSING:
                break
            await ctx.ledger.wait_for_change(ctx.run_id)
        await ledger.resume(ctx.run_id, by=BY)


class CancelResume(Action):
    """Cancel; once the run settled, resume it and enter the workflow again under the
    same run id, as the receipt's recovery line says: what was done is returned from
    the ledger, not done again. A workflow whose calls are not the same on re-entry (a
    key of its own drawn afresh, a call made outside ``run.call``) repeats its effects:
    the check compares each destination with a run never cancelled (R4). A run that
    cannot be resumed (in review) is left as the cancel left it."""

    name = "cancel_resume"

    def unsupported(self, ledger: Ledger) -> str | None:
        if hasattr(ledger, "resume"):
            return None
        return "this runtime has no ledger.resume"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()

    async def after_done(self, ctx: ActionContext) -> None:
        try:
            receipt = await ctx.ledger.wait_settled(ctx.run_id, timeout=ctx.settle_timeout)
        except TimeoutError:
            return  # unsettled: the cell's own wait says so (R2), nothing to resume
        if receipt.run_state is not RunState.CANCELLED or ctx.reenter is None:
            return  # it ended before the cancel, or waits for a reviewer: nothing to resume
        await ctx.ledger.resume(ctx.run_id, by=BY)
        ctx.resumed = True
        await ctx.reenter()


class ExpireApproval(Action):
    """Let the run's pending approvals expire, then cancel (S5)."""

    name = "expire_approval"

    def unsupported(self, ledger: Ledger) -> str | None:
        if hasattr(ledger, "expire_approvals"):
            return None
        return "this runtime has no approvals (ledger.expire_approvals)"

    async def at_point(self, ctx: ActionContext) -> None:
        ledger: Any = ctx.ledger
        await ledger.expire_approvals(ctx.run_id)
        await ctx.cancel()


class Compensate(Action):
    """Cancel, then correct every committed operation that can be corrected."""

    name = "compensate"

    def unsupported(self, ledger: Ledger) -> str | None:
        if hasattr(ledger, "compensate"):
            return None
        return "this runtime does not run compensations (ledger.compensate)"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()

    async def after_done(self, ctx: ActionContext) -> None:
        ledger: Any = ctx.ledger
        for op in await ctx.ledger.backend.operations(ctx.run_id, descendants=True):
            if op.status is OpStatus.COMMITTED and op.can_compensate:
                await ledger.compensate(op.id, by=BY)


class CompensateAgain(Compensate):
    """Cancel and correct, each correction sent twice under its own key, as a retry
    after a lost answer sends it (R5): a compensator that is not idempotent corrects
    twice, which ground truth shows (R3; a tool of your own lists its corrections'
    keys, the compensator's ``ctx.key``, in ``ground_truth``).

    For the cell, each tool the workflow registered has its compensator sent twice;
    the cell puts the tool back as it was when it ends."""

    name = "compensate_again"

    async def at_point(self, ctx: ActionContext) -> None:
        # before the cancel: a tool with ``compensation=always`` corrects on it
        for tool in list(ctx.ledger.core.tools.values()):
            fn = tool.compensate_fn
            if fn is not None and not isinstance(fn, _SentTwice):  # another cell's, at once
                ctx.patch(tool, "compensate_fn", _SentTwice(fn))
        await ctx.cancel()


class _SentTwice:
    """A compensator sent twice, the same context (so the same key) each time."""

    def __init__(self, compensate: CompensateFn) -> None:
        self.compensate = compensate

    async def __call__(self, call: CallContext) -> Any:
        await self.compensate(call)  # its answer lost on the way back
        return await self.compensate(call)  # the retry: the same request, the same key


DEFAULT_ACTIONS: tuple[Action, ...] = (
    Cancel(),
    CancelTwice(),
    LateResponse(),
    DropConnection(),
    RefuseCancel(),
    CrashWorker(),
    CrashLateCommit(),
    PauseResume(),
    CancelResume(),
    ExpireApproval(),
    Compensate(),
    CompensateAgain(),
)

# The actions of the core runtime: no lifecycle or truth API needed.
CORE_ACTIONS: tuple[Action, ...] = DEFAULT_ACTIONS[:7]
