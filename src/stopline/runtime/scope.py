"""``async with ledger.run(...) as run``: the scope of one run in this process.

A cancel of the run ends the block quietly (``RunFenced`` of this run is
absorbed, alone or as every leaf of an exception group); leaving the block
either advances the cancelled run's settling or ends the run. A block inside
the block of a run cancelled with it (a child's, in a task group of its
owner's block) may be interrupted by that enclosing run's cancel rather than
by one of its own (``Lifecycle.deliver_cancel``, asyncio): that cancel goes
on out of the inner block, and the enclosing block, whose cancel it is, ends
quietly.

A block interrupted by the cancel of a run whose block encloses it, a cancel
that did not fence its own run (a shared run another owner still holds), ends
without ending its run when a run holding it by a share can still go on with
it (R6, ADR 0065): the run stays ``running`` for that owner, which may re-enter
it by its id, and is fenced with its last owner. Its interrupted calls keep
their records (``unknown``, read back; their providers are not asked: the run
was not cancelled). Its ``left_to_owners`` event says why it is still running:
which run's cancel cut its block, and the owners it goes on for (the cancel's
``owner_released`` says whose cancel let it go). With no such owner left, it ends
as any block an outside cancellation interrupts (``failed``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import anyio
import sniffio

from stopline.domain.guidance import what_to_do
from stopline.domain.lifecycle import tenant_of
from stopline.domain.limits import check_id, check_new_id
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunState
from stopline.errors import (
    AlreadyAttached,
    InvalidInput,
    LedgerError,
    NoRun,
    RunEnded,
    UnknownRun,
)
from stopline.ledger.backend import RunSpec
from stopline.runtime.boundary import only_cancels_of
from stopline.runtime.replay import replays
from stopline.runtime.run import Run

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.ledger import Ledger

__all__ = ["RunContext", "RunScope", "check_new_run"]

log = logging.getLogger("stopline.runs")


def check_new_run(spec: RunSpec) -> None:
    """The ids a run is created with, as ids being made (``check_new_id``: no
    bidirectional nor C1 control), else ``InvalidInput`` and nothing written; a run
    created before the rule is entered by its id as it is. Its name is a label, as a
    description is (a name in Hebrew may need a mark): shown with its controls escaped
    (ADR 0070, ADR 0078). Every maker of a run goes through it (``RunScope``, a
    LangGraph thread's next run)."""
    check_id("name", spec.name)
    for what, value in (("run_id", spec.id), ("owner", spec.owner), ("tenant", spec.tenant)):
        check_new_id(what, value)


_SETTLING = frozenset({RunState.CANCELLING, RunState.SETTLING})
# the runs whose blocks are open around the code running now, innermost last (a task
# started inside a block sees it: a task inherits its starter's context)
_BLOCKS: contextvars.ContextVar[tuple[Run, ...]] = contextvars.ContextVar(
    "stopline_run_blocks", default=()
)
# a run's public names (its methods, properties and declared attributes): reached on the
# scope that makes it, not entered, each is ``NoRun`` naming the fix (ADR 0089)
_OF_A_RUN = frozenset(n for n in (*dir(Run), *Run.__annotations__) if not n.startswith("_"))


def _task_cancels() -> Callable[[], int] | None:
    """How many cancels the current task has been asked so far, as a function (asyncio's
    ``Task.cancelling``); None where the event loop does not say (trio)."""
    if sniffio.current_async_library() != "asyncio":
        return None
    task = asyncio.current_task()
    return None if task is None else task.cancelling


class RunScope:
    """``async with ledger.run(...) as run``: a cancel of the run ends the block quietly.

    (Named ``RunContext`` before 0.2, which is also Pydantic AI's name for the context
    its tools receive; the old name stays an alias for one release.)"""

    def __init__(self, ledger: Ledger, core: Core, spec: RunSpec, *, attach: bool) -> None:
        self._ledger = ledger
        self._core = core
        self._spec = spec
        self._attach = attach
        self._scope = anyio.CancelScope()
        self._run: Run | None = None
        self._enclosing: tuple[Run, ...] = ()  # the runs whose blocks are open around it
        self._blocks: contextvars.Token[tuple[Run, ...]] | None = None

    if not TYPE_CHECKING:  # typed, a scope has no ``call``: mypy says so, as it should

        def __getattr__(self, name: str) -> NoReturn:
            """A name the scope lacks (never on the entered path: ``run.call`` is the
            run's). One of a run's is ``NoRun`` naming the fix: ``run = ledger.run(...)``
            then ``run.call(...)`` was a bare ``AttributeError``; nothing is called."""
            if name in _OF_A_RUN:
                raise NoRun(
                    f"`{name}` is a run's, and ledger.run(...) gives the scope that makes the"
                    f" run: `async with ledger.run(...) as run:`, then `run.{name}` inside"
                    " the block (nothing was called or written)"
                )
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
            )

    async def __aenter__(self) -> Run:
        backend = self._core.backend
        self._core.at_home("a run's block is entered")
        self._not_attached_here()
        record = None
        if self._attach:
            try:
                record = await backend.get_run(self._spec.id)
            except UnknownRun:
                record = None
        made = record is None
        if record is None:
            parent = self._core.runs.get(self._spec.parent_id or "")
            if parent is not None and parent.replaying:  # new work under an ended child
                raise RunEnded(parent.id, parent.record.state, "new work goes in another child")
            self._new_ids()
            if self._spec.parent_id is not None:
                await self._of_parents_tenant(parent)
            record, made = await self._create()
        replaying = not made and replays(self._spec, record)
        if not made and (record.state.ended or record.state in _SETTLING) and not replaying:
            by_parent = self._spec.parent_id is not None and (
                record.parent_id == self._spec.parent_id
            )
            # and what to do (R14)
            raise RunEnded(record.id, record.state, what_to_do(record, by_parent=by_parent))
        self._not_attached_here()  # another block of this process may have entered it since
        run = self._run = Run(self._ledger, self._core, record, self._scope)
        run.replaying = replaying
        run.block_task_cancels = _task_cancels()
        # registered and entered in one step: ``run.opened`` is the order in which the
        # blocks' scopes opened (what a delivery reads nesting from)
        self._core.register_run(run)
        self._scope.__enter__()
        self._enclosing = _BLOCKS.get()
        self._blocks = _BLOCKS.set((*self._enclosing, run))
        if not replaying and record.state not in (
            RunState.RUNNING,
            RunState.PAUSING,
            RunState.PAUSED,
        ):
            run.cancel_requested = True
        return run

    def _new_ids(self) -> None:
        check_new_run(self._spec)

    def _not_attached_here(self) -> None:
        if self._spec.id in self._core.runs:
            raise AlreadyAttached(self._spec.id)

    async def _create(self) -> tuple[RunRecord, bool]:
        """The run made, else (its ``run_id`` given) the one that stands there now: two
        entries that both found no run create it at once, and the one that loses finds
        the winner's, which it enters as it would have a moment later (a run whose
        write committed but whose answer was lost is found the same way). Whether it
        was made here."""
        try:
            return await self._core.backend.create_run(self._spec), True
        except LedgerError:
            if not self._attach:
                raise
            try:
                return await self._core.backend.get_run(self._spec.id), False
            except UnknownRun:
                pass
            raise

    async def _of_parents_tenant(self, parent: Run | None) -> None:
        """R11: a child run is of its parent's tenant, else ``InvalidInput`` and nothing
        written: one of another tenant was that tenant's to see and act on, and its
        operations were shown in the parent's receipt."""
        spec = self._spec
        assert spec.parent_id is not None
        above = (
            parent.record
            if parent is not None
            else await self._core.backend.get_run(spec.parent_id)
        )
        if tenant_of(above) != spec.tenant:
            raise InvalidInput("tenant", "a child run must be of its parent run's tenant")

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        run = self._run
        assert run is not None and self._blocks is not None
        _BLOCKS.reset(self._blocks)
        ours = only_cancels_of(exc, run.id)
        if ours:
            et, exc, tb = None, None, None
        swallowed = bool(self._scope.__exit__(et, exc, tb))
        # interrupted by its own cancel, or by its enclosing run's (which goes on out)
        by_enclosing = run.covered and isinstance(exc, anyio.get_cancelled_exc_class())
        run.cancelled_caught = ours or self._scope.cancelled_caught or by_enclosing
        del self._core.runs[run.id]
        if not run.replaying:  # a replay ended long ago: nothing to record
            with anyio.CancelScope(shield=True):
                cut_by = None if swallowed else self._cut_by_others(run, exc)
                if cut_by is None or not await self._held(run, cut_by):
                    await self._core.outbox.end_run(run, None if swallowed else exc)
        return ours or swallowed

    def _cut_by_others(self, run: Run, exc: BaseException | None) -> str | None:
        """The run whose cancel interrupted the block, if that is how it ended: a run
        whose block encloses it (the innermost cancelled), a cancel that did not reach
        its own run (not fenced: a shared run it let go)."""
        if not isinstance(exc, anyio.get_cancelled_exc_class()) or run.cancel_requested:
            return None
        return next((o.id for o in reversed(self._enclosing) if o.cancel_requested), None)

    async def _held(self, run: Run, cut_by: str) -> bool:
        """Whether the run stays ``running`` for an owner still holding it: it is not
        fenced nor ended, and a run owning it by a share (a link no cancel let go) is
        running or paused, able to go on with it; its ``left_to_owners`` event, naming
        them and ``cut_by``, is written with that reading (``Backend.leave_to_owners``).
        Where the ledger cannot tell, the block ends its run, as any block an outside
        cancellation interrupts."""
        try:
            holders = await self._core.backend.leave_to_owners(run.id, cut_by=cut_by)
        except Exception as exc:  # the end below is held and retried if it fails too
            log.warning("run %s: its owners could not be read (%s): ended", run.id, exc)
            return False
        if holders:
            log.info(
                "run %s: its block was interrupted by run %s's cancel; the run goes on"
                " for its owners %s",
                run.id,
                cut_by,
                ", ".join(holders),
            )
        return bool(holders)


RunContext = RunScope  # deprecated alias (0.2, removed in 0.3)
