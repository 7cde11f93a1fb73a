"""One cell of the explorer: run the workflow, hold it at a point, act, settle, check."""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio

from stopline.domain.receipt import Receipt
from stopline.errors import StoplineError
from stopline.runtime.ledger import Ledger, VerifyBudget
from stopline.runtime.opening import open as open_ledger
from stopline.runtime.run import Run
from stopline.testing._hooks import Hooks, WorkerCrashed
from stopline.testing._sources import Sources
from stopline.testing.actions import Action, ActionContext, Point
from stopline.testing.barriers import Barrier
from stopline.testing.checks import Observed, check
from stopline.testing.matrix import Cell, CellStatus

__all__ = ["CellRunner"]

P = TypeVar("P")
OWNER = "explorer:user"


class _CellError(StoplineError):
    """The cell could not be played (not a rule broken): the note says why."""


class _Driven:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.entries = 0
        self.error: BaseException | None = None


def _only_crash(exc: BaseException) -> bool:
    """A crash, alone or with the cancellations it caused."""
    if isinstance(exc, WorkerCrashed | anyio.get_cancelled_exc_class()):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_crash(e) for e in exc.exceptions)
    return False


async def _first(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


class CellRunner(Generic[P]):
    def __init__(
        self,
        workflow: Callable[[Run, P], Awaitable[None]],
        factory: Callable[[], P],
        *,
        verify: VerifyBudget,
        cell_timeout: float,
    ) -> None:
        self.workflow = workflow
        self.factory = factory
        self.verify = verify
        self.cell_timeout = cell_timeout
        self.settle_timeout = min(3.0, cell_timeout / 2)
        self.name = str(getattr(workflow, "__name__", "workflow"))
        self.last_sources: Sources | None = None

    async def run_plain(
        self,
        url: str,
        observe: Callable[[Sources], None],
        probe: Callable[[Ledger], None],
    ) -> Cell:
        """The workflow on its own: no hold, no action (the discovery run)."""
        return await self._cell(None, None, 0, "x-discover", url, observe, probe)

    async def run_cell(
        self, point: Point, action: Action, seed: int, run_id: str, url: str
    ) -> Cell:
        return await self._cell(point, action, seed, run_id, url, None, None)

    async def _cell(
        self,
        point: Point | None,
        action: Action | None,
        seed: int,
        run_id: str,
        url: str,
        observe: Callable[[Sources], None] | None,
        probe: Callable[[Ledger], None] | None,
    ) -> Cell:
        where = point.id if point is not None else "(start)"
        what = action.name if action is not None else "none"
        try:
            with anyio.fail_after(self.cell_timeout):
                seen = await self._play(point, action, run_id, url, observe, probe)
        except TimeoutError:
            note = f"no end within {self.cell_timeout}s (a barrier never released?)"
            return Cell(where, what, seed, CellStatus.ERROR, run_id, note=note)
        except _CellError as exc:
            return Cell(where, what, seed, CellStatus.ERROR, run_id, note=str(exc))
        violations, needs_recovery = check(seen)
        if violations:
            status = CellStatus.FAIL
        elif needs_recovery:
            status = CellStatus.NEEDS_RECOVERY
        else:
            status = CellStatus.PASS
        notes = []
        if needs_recovery:
            unresolved = [op.id for op in seen.ops if not op.status.resolved]
            notes.append(f"needs recovery (no ledger.recover): {unresolved} unresolved")
        return Cell(
            where,
            what,
            seed,
            status,
            run_id,
            tuple(violations),
            seen.receipt.headline,
            "; ".join(notes),
        )

    async def _play(
        self,
        point: Point | None,
        action: Action | None,
        run_id: str,
        url: str,
        observe: Callable[[Sources], None] | None,
        probe: Callable[[Ledger], None] | None,
    ) -> Observed:
        providers = self.factory()
        hooks = Hooks()
        sources = self.last_sources = Sources(providers, hooks)
        arrived = anyio.Event()
        if observe is not None:
            observe(sources)
        held: list[Barrier] = []
        if point is not None:
            self._hold_at(point, sources, arrived, held)
        driven = _Driven()
        scope = anyio.CancelScope()
        ledger = open_ledger(url, verify=self.verify, observers=[hooks.wrap])
        ctx: ActionContext | None = None
        try:
            async with ledger:
                if probe is not None:
                    probe(ledger)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._drive, ledger, run_id, providers, driven, scope)
                    if point is not None and action is not None:
                        await _first(arrived, driven.done)
                        if not arrived.is_set():
                            raise _CellError(f"the workflow ended without reaching {point.id}")
                        ctx = ActionContext(
                            ledger,
                            run_id,
                            point,
                            sources.providers,
                            hooks,
                            scope,
                            held,
                            driven.done,
                        )
                        try:
                            await action.at_point(ctx)
                        finally:
                            ctx.release()
                    await driven.done.wait()
                if ctx is None or not ctx.crashed:
                    return await self._observe(ledger, run_id, sources, driven, action, ctx)
        except BaseException as exc:
            if ctx is None or not ctx.crashed or not _only_crash(exc):
                raise
        return await self._after_crash(url, run_id, sources, driven, ctx)

    def _hold_at(
        self, point: Point, sources: Sources, arrived: anyio.Event, held: list[Barrier]
    ) -> None:
        barriers = sources.barriers_for(point)
        if barriers is None:
            raise _CellError(f"no barriers for {point.id} in this run's providers")
        target, count = point.reach_name, 0

        def on_reach(name: str, key: str) -> None:
            nonlocal count
            if name == target:
                count += 1
                if count == point.occurrence:
                    held.append(barriers.hold(name))
                    arrived.set()

        barriers.on_reach = on_reach

    async def _drive(
        self, ledger: Ledger, run_id: str, providers: P, driven: _Driven, scope: anyio.CancelScope
    ) -> None:
        try:
            with scope:
                async with ledger.run(self.name, owner=OWNER, run_id=run_id) as run:
                    driven.entries += 1
                    await self.workflow(run, providers)
        except WorkerCrashed:
            pass
        except Exception as exc:  # the workflow's own failure is data: the rules judge it
            driven.error = exc
        except BaseExceptionGroup as group:
            if not _only_crash(group):
                raise
        finally:
            driven.done.set()

    async def _observe(
        self,
        ledger: Ledger,
        run_id: str,
        sources: Sources,
        driven: _Driven,
        action: Action | None,
        ctx: ActionContext | None,
    ) -> Observed:
        if action is not None and ctx is not None:
            await action.after_done(ctx)
        settled = True
        try:
            receipt = await ledger.wait_settled(run_id, timeout=self.settle_timeout)
        except TimeoutError:
            settled, receipt = False, await ledger.receipt(run_id)
        # R7: a cancel once everything is over returns the current receipt, changes nothing
        again = await ledger.cancel(run_id, by=OWNER, reason="again") if settled else None
        return await _gather(
            ledger,
            run_id,
            sources,
            receipt if settled else None,
            settled=settled,
            driven=driven,
            ctx=ctx,
            again=again,
        )

    async def _after_crash(
        self,
        url: str,
        run_id: str,
        sources: Sources,
        driven: _Driven,
        ctx: ActionContext | None,
    ) -> Observed:
        """A new worker opens the same ledger file; recovers if this runtime can."""
        async with open_ledger(url, verify=self.verify) as fresh:
            for provider in sources.providers.values():
                fresh.register_tool(provider.tool)
            recover: Any = getattr(fresh, "recover", None)
            if recover is not None:
                await _expire_lease(fresh, ctx)
                with anyio.move_on_after(self.settle_timeout):
                    takes_run = bool(inspect.signature(recover).parameters)
                    await (recover(run_id) if takes_run else recover())
                    while not await _ops_resolved(fresh, run_id):
                        await fresh.wait_for_change(run_id)
            return await _gather(
                fresh,
                run_id,
                sources,
                None,
                settled=await _ops_resolved(fresh, run_id),
                driven=driven,
                ctx=ctx,
                crashed=True,
                recovered=recover is not None,
            )


async def _ops_resolved(ledger: Ledger, run_id: str) -> bool:
    return all(op.status.resolved for op in await ledger.backend.operations(run_id))


async def _expire_lease(fresh: Ledger, ctx: ActionContext | None) -> None:
    """The killed worker's lease runs out (as time would have it): recovery may take over.

    In this process its pid is still alive, so only the lease can say it is gone.
    """
    backend: Any = fresh.backend
    worker = getattr(ctx.ledger, "worker_id", None) if ctx is not None else None
    if worker is None or not hasattr(backend, "heartbeat"):
        return
    await backend.heartbeat(worker, host=socket.gethostname(), pid=os.getpid(), lease_until=0.0)


async def _gather(
    ledger: Ledger,
    run_id: str,
    sources: Sources,
    settled_receipt: Receipt | None,
    *,
    settled: bool,
    driven: _Driven,
    ctx: ActionContext | None,
    again: Receipt | None = None,
    crashed: bool = False,
    recovered: bool = False,
) -> Observed:
    backend = ledger.backend
    return Observed(
        run=await backend.get_run(run_id),
        ops=await backend.operations(run_id),
        events=await backend.events(run_id),
        receipt=await ledger.receipt(run_id),
        settled_receipt=settled_receipt,
        settled=settled,
        providers=sources.providers,
        cancels=tuple(ctx.cancels) if ctx is not None else (),
        cancel_after_settled=again,
        late=tuple(ctx.late) if ctx is not None else (),
        entries=driven.entries,
        crashed=crashed,
        recovered=recovered,
    )
