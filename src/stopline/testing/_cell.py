"""One cell of the explorer: run the workflow, hold it at a point, act, settle, check."""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import Any, Generic, TypeVar, cast

import anyio

from stopline.domain.receipt import Receipt
from stopline.errors import StoplineError, describe
from stopline.runtime.ledger import Ledger, VerifyBudget
from stopline.runtime.opening import open as open_ledger
from stopline.runtime.run import Run
from stopline.testing._errors import ExplorerError
from stopline.testing._hooks import Hooks, WorkerCrashed
from stopline.testing._sources import Sources
from stopline.testing.actions import Action, ActionContext, Point
from stopline.testing.barriers import Barrier
from stopline.testing.checks import Observed, check
from stopline.testing.matrix import Cell, CellStatus
from stopline.testing.providers import in_runs

__all__ = ["CellRunner", "GroundTruth"]

P = TypeVar("P")
OWNER = "explorer:user"
# the cell's providers -> for each of the user's own tools, the keys of every effect
# its destination holds (``explore(..., ground_truth=...)``)
GroundTruth = Callable[[P], Mapping[str, Iterable[str]]]


class _CellError(StoplineError):
    """The cell could not be played (not a rule broken): the note says why."""


class _Driven:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.entries = 0
        self.error: BaseException | None = None


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _not_ours(exc: BaseException) -> bool:
    """An interrupt, an exit, a test runner's outcome (pytest-timeout's ``Failed``, a
    ``pytest.fail``, raised wherever the test is) or a cancellation from outside: it ends
    the exploration."""
    leaves = _leaves(exc)
    if any(isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit) for e in leaves):
        return True
    if any(c.__module__ == "_pytest.outcomes" for e in leaves for c in type(e).__mro__):
        return True
    return all(isinstance(e, anyio.get_cancelled_exc_class()) for e in leaves)


def _why(exc: BaseException) -> str:
    """What went wrong, as a cell's note: each failure the group held, once."""
    leaves = [e for e in _leaves(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
    return "; ".join(dict.fromkeys(_tell(e) for e in leaves)) or describe(exc)


def _tell(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, _CellError) else describe(exc)


class _Holding:
    """The barriers a cell holds the workflow at; once closed, nothing more is held."""

    def __init__(self) -> None:
        self.held: list[Barrier] = []
        self.closed = False

    def close(self) -> None:
        """Let every held call go (an action that failed or an outer cancel included:
        a hold is shielded, so a call left held would keep the exploration for ever)."""
        self.closed = True
        for barrier in self.held:
            barrier.release()


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


def _budget(verify: VerifyBudget) -> float:
    """The longest a read-back budget can take: every wait and every read timing out."""
    return sum(verify.delays()) + verify.attempts * verify.read_timeout


class CellRunner(Generic[P]):
    def __init__(
        self,
        workflow: Callable[[Run, P], Awaitable[None]],
        factory: Callable[[], P],
        *,
        verify: VerifyBudget,
        cell_timeout: float,
        ground_truth: GroundTruth[P] | None = None,
        require_ground_truth: bool = False,
    ) -> None:
        self.workflow = workflow
        self.factory = factory
        self.ground_truth = ground_truth
        self.require_ground_truth = require_ground_truth
        self.verify = verify
        self.cell_timeout = cell_timeout
        # long enough for the whole read-back budget (a verifier that hangs included:
        # each read gives up after ``read_timeout``), within the cell's own timeout
        self.settle_timeout = min(cell_timeout / 2, max(3.0, 2 * _budget(verify)))
        self.name = str(getattr(workflow, "__name__", "workflow"))
        self.last_sources: Sources | None = None
        self.baseline: dict[str, int] = {}  # effects by tool of the discovery run

    async def run_plain(
        self,
        seed: int,
        run_id: str,
        url: str,
        observe: Callable[[Sources], None],
        probe: Callable[[Ledger], None],
    ) -> Cell:
        """The workflow on its own: no hold, no action (the discovery run)."""
        return await self._cell(None, None, seed, run_id, url, observe, probe)

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
        except BaseException as exc:  # the cell could not be played: its result says why
            if _not_ours(exc) or isinstance(exc, ExplorerError):
                raise
            return Cell(where, what, seed, CellStatus.ERROR, run_id, note=_why(exc))
        if point is None:  # a run never cancelled: what a resumed one may do at most
            self.baseline = {tool: len(t.effects) for tool, t in seen.truths().items()}
        violations, needs_recovery = check(seen, require_ground_truth=self.require_ground_truth)
        if point is None and seen.error is not None:
            # the discovery run: a workflow that fails on its own cannot be explored
            return Cell(where, what, seed, CellStatus.ERROR, run_id, note=f"it raised {seen.error}")
        if violations:
            status = CellStatus.FAIL
        elif needs_recovery:
            status = CellStatus.NEEDS_RECOVERY
        else:
            status = CellStatus.PASS
        notes = []
        if seen.error is not None:
            notes.append(f"the workflow raised {seen.error}")
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
            seen.unverified(),
            seen.reviews(),
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
        try:
            providers = self.factory()
        except Exception as exc:
            raise _CellError(f"the providers factory raised {describe(exc)}") from exc
        hooks = Hooks()
        sources = Sources(providers, hooks)
        last = self.last_sources.providers.values() if self.last_sources is not None else ()
        if any(p is q for p in sources.providers.values() for q in last):
            raise ExplorerError(
                "the providers factory returned a provider of the last run again: it must "
                "make fresh ones for each run (providers=lambda: FakeProvider(...))"
            )
        self.last_sources = sources
        arrived = anyio.Event()
        if observe is not None:
            observe(sources)
        holding = _Holding()
        if point is not None:
            self._hold_at(point, sources, arrived, holding)
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
                    try:
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
                                holding.held,
                                driven.done,
                            )
                            ctx.reenter = partial(self._reenter, ledger, run_id, providers, driven)
                            ctx.settle_timeout = self.settle_timeout
                            try:
                                await action.at_point(ctx)
                            finally:
                                ctx.release()
                        await driven.done.wait()
                    finally:
                        holding.close()
                if ctx is None or not ctx.crashed:
                    return await self._observe(ledger, run_id, sources, driven, action, ctx)
        except BaseException as exc:
            if ctx is None or not ctx.crashed or not _only_crash(exc):
                if ctx is not None and ctx.crashed:
                    await hooks.bury()
                raise
        finally:
            if ctx is not None:
                ctx.undo()  # what the action changed for this cell, its ledger closed
        await hooks.bury()  # the dead worker's ledger closed no further than its first write
        return await self._after_crash(url, run_id, sources, driven, ctx)

    def _hold_at(
        self, point: Point, sources: Sources, arrived: anyio.Event, holding: _Holding
    ) -> None:
        barriers = sources.barriers_for(point)
        if barriers is None:
            raise _CellError(f"no barriers for {point.id} in this run's providers")
        target, count = point.reach_name, 0

        def on_reach(name: str, key: str) -> None:
            nonlocal count
            if name == target and not holding.closed:
                count += 1
                if count == point.occurrence:
                    holding.held.append(barriers.hold(name))
                    arrived.set()

        barriers.on_reach = on_reach

    async def _drive(
        self, ledger: Ledger, run_id: str, providers: P, driven: _Driven, scope: anyio.CancelScope
    ) -> None:
        try:
            with scope:
                async with ledger.run(self.name, owner=OWNER, run_id=run_id) as run:
                    driven.entries += 1
                    started = self.workflow(run, providers)
                    if not inspect.isawaitable(started):  # a plain def: "NoneType can't be
                        raise TypeError(  # used in 'await' expression" said nothing more
                            f"the workflow returned {type(started).__name__}, not an "
                            "awaitable: write it as async def workflow(run, providers)"
                        )
                    await started
        except WorkerCrashed:
            pass
        except Exception as exc:  # the workflow's own failure is data: the cell notes it
            driven.error = exc
        except BaseExceptionGroup as group:
            if not _only_crash(group):
                raise
        finally:
            driven.done.set()

    async def _reenter(self, ledger: Ledger, run_id: str, providers: P, driven: _Driven) -> None:
        """The workflow entered again under its run id, its providers kept (a resume)."""
        try:
            async with ledger.run(self.name, owner=OWNER, run_id=run_id) as run:
                await self.workflow(run, providers)
        except Exception as exc:  # the workflow's own failure is data, as on its first entry
            driven.error = exc

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
        return await self._gather(
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
            used = ctx.ledger.core.tools.values() if ctx is not None else ()
            for tool in [*(p.tool for p in sources.providers.values()), *used]:
                fresh.register_tool(tool)  # every tool the workflow used: its own too
            recover: Any = getattr(fresh, "recover", None)
            if recover is not None:
                await _expire_lease(fresh, ctx)
                with anyio.move_on_after(self.settle_timeout):
                    takes_run = bool(inspect.signature(recover).parameters)
                    await (recover(run_id) if takes_run else recover())
                    while not await _ops_resolved(fresh, run_id):
                        await fresh.wait_for_change(run_id)
            return await self._gather(
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

    async def _gather(
        self,
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
        # the run's tree, as its receipt reads it: its child runs' operations are its own
        run, ops = await backend.run_and_operations(run_id, descendants=True)
        tree = tuple(dict.fromkeys([run_id, *(op.run_id for op in ops)]))
        events = [e for r in tree for e in await backend.events(r)]
        truth: dict[str, tuple[str, ...]] = {}
        if self.ground_truth is not None:
            truth = _truth_of(self.ground_truth, cast(P, sources.root), tree)
        return Observed(
            run=run,
            ops=ops,
            events=sorted(events, key=lambda e: e.seq),
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
            truth=truth,
            error=describe(driven.error) if driven.error is not None else None,
            baseline=self.baseline if ctx is not None and ctx.resumed else None,
        )


def _truth_of(
    ground_truth: GroundTruth[P], providers: P, tree: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """The effects of the run's ``tree`` (the run and its child runs) by tool, as
    ``ground_truth(providers)`` tells; a ``_CellError``
    naming it when it raises or tells something that is not tool -> keys."""
    try:
        given = ground_truth(providers)
    except Exception as exc:
        raise _CellError(f"ground_truth(providers) raised {describe(exc)}") from exc
    if not isinstance(given, Mapping):
        raise _CellError(
            f"ground_truth(providers) returned {type(given).__name__}: it must map each "
            "tool name to the keys (ctx.key) of its effects"
        )
    truth = {}
    for tool, keys in given.items():
        # a string is an iterable of characters, not of keys: {"send": box.last_key}
        if isinstance(keys, str | bytes) or not isinstance(keys, Iterable):
            raise _CellError(
                f"ground_truth(providers)[{tool!r}] is {type(keys).__name__}: it must be "
                "the keys (ctx.key) of every effect, in a list"
            )
        keys = tuple(keys)
        odd = [k for k in keys if not isinstance(k, str)]
        if odd:
            raise _CellError(
                f"ground_truth(providers)[{tool!r}] holds {odd[0]!r}: each key is the "
                "effect's ctx.key, a string"
            )
        truth[str(tool)] = tuple(k for k in keys if in_runs(k, tree))
    return truth


async def _ops_resolved(ledger: Ledger, run_id: str) -> bool:
    ops = await ledger.backend.operations(run_id, descendants=True)
    return all(op.status.resolved for op in ops)


async def _expire_lease(fresh: Ledger, ctx: ActionContext | None) -> None:
    """The killed worker's lease runs out (as time would have it): recovery may take over.

    In this process its pid is still alive, so only the lease can say it is gone.
    """
    backend: Any = fresh.backend
    worker = getattr(ctx.ledger, "worker_id", None) if ctx is not None else None
    if worker is None or not hasattr(backend, "heartbeat"):
        return
    await backend.heartbeat(worker, host=socket.gethostname(), pid=os.getpid(), lease_until=0.0)
