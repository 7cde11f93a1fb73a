"""Lifecycle figures: cancelling a large tree of runs.

``cancel_tree_10k_ms``: a run owning 10,000 child runs, each with a call in
flight (an ``immediate`` phase); from ``cancel()`` to the fence durable for
all of them and every in-flight call interrupted; the note says when the fence
was durable (its commit seen on the loop, through an observer's hook).
Baseline: cancelling 10,000 bare tasks in one task group, in the same run.
Both windows start on a quiet heap (``figures.quiet_heap``).

``pause_ms`` and ``resume_to_call_ms``: an idle run paused (``pause()`` to its
receipt, the pause durable), then a call made, which waits at the gate, and
the run resumed (``resume()`` to that call's tool invoked), a fresh run each
round; p50 of each beside one bare durable transaction measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import anyio
import anyio.lowlevel

import stopline
from stopline.bench.core import bare_txn_samples
from stopline.bench.figures import Figure, quiet_heap
from stopline.domain.lifecycle import CancelResult
from stopline.ledger.forwarding import ForwardingBackend, seeing_the_commit

__all__ = ["measure", "pause_resume_samples"]


@dataclasses.dataclass(frozen=True)
class _Cancelled:
    """From ``cancel()``: the fence durable (its commit seen on the loop), and the
    last in-flight call interrupted."""

    durable: float
    last: float
    collector: float  # seconds the collector ran from the cancel to the last interruption


async def _tree(url: str, children: int) -> _Cancelled:
    entered = 0
    all_in, all_out = anyio.Event(), anyio.Event()
    interrupted: list[float] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        nonlocal entered
        entered += 1
        if entered == children:
            all_in.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            interrupted.append(time.perf_counter())
            if len(interrupted) == children:
                all_out.set()
            raise

    durable: list[float] = []

    class Fence(ForwardingBackend):
        """Stamps the fence's commit as the loop sees it: in the hook the backend calls
        there, before it cuts (ADR 0043), else when the backend's cancel returns."""

        async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
            with seeing_the_commit(lambda _: durable.append(time.perf_counter())):
                result = await self.inner.cancel(run_id, by=by, reason=reason)
            if not durable:
                durable.append(time.perf_counter())
            return result

    async with stopline.open(url, observers=[Fence]) as ledger:
        root_ids: list[str] = []

        async def child(run: stopline.Run, n: int) -> None:
            async with (
                run.child(f"c{n}") as c,
                c.phase(stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE),
            ):
                await c.call(hold)

        async def root() -> None:
            async with ledger.run("root", owner="bench") as run:
                root_ids.append(run.id)
                async with anyio.create_task_group() as tg:
                    for n in range(children):
                        tg.start_soon(child, run, n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(root)
            await all_in.wait()
            with quiet_heap() as heap:
                start = time.perf_counter()
                await ledger.cancel(root_ids[0], by="bench")
                await all_out.wait()
    last = max(interrupted)
    return _Cancelled(durable[0] - start, last - start, heap.collector_s(start, last))


async def _bare(children: int) -> tuple[float, float]:
    """The last of ``children`` bare tasks interrupted, and the collector's time in it."""
    started = 0
    all_in = anyio.Event()
    interrupted: list[float] = []

    async def victim() -> None:
        nonlocal started
        started += 1
        if started == children:
            all_in.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            interrupted.append(time.perf_counter())
            raise

    async with anyio.create_task_group() as tg:
        for _ in range(children):
            tg.start_soon(victim)
        await all_in.wait()
        with quiet_heap() as heap:
            start = time.perf_counter()
            tg.cancel_scope.cancel()
            await anyio.lowlevel.checkpoint()  # the victims run before the heap thaws
    last = max(interrupted)
    return last - start, heap.collector_s(start, last)


async def pause_resume_samples(url: str, n: int) -> tuple[list[float], list[float]]:
    """``n`` rounds, each on a run of its own (a run's receipt reads its operations: one
    run through every round would make a later pause dearer than the first):
    ``pause()`` of the idle run, then a call that waits at its gate, and ``resume()``
    to that call's tool invoked (seconds of each)."""
    called = anyio.Event()

    @stopline.tool
    async def step(ctx: stopline.CallContext) -> None:
        called.set()

    pauses: list[float] = []
    resumes: list[float] = []
    async with stopline.open(url) as ledger:

        async def worker(ready: anyio.Event, go: anyio.Event, run_ids: list[str]) -> None:
            async with ledger.run("pause-bench", owner="bench") as run:
                run_ids.append(run.id)
                ready.set()
                await go.wait()
                await run.call(step, key="step")

        for _ in range(n):
            called, ready, go = anyio.Event(), anyio.Event(), anyio.Event()
            run_ids: list[str] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker, ready, go, run_ids)
                await ready.wait()
                start = time.perf_counter()
                await ledger.pause(run_ids[0], by="bench")
                pauses.append(time.perf_counter() - start)
                go.set()
                await anyio.sleep(0.002)  # outside the window: the call reaches the gate
                start = time.perf_counter()
                await ledger.resume(run_ids[0], by="bench")
                await called.wait()
                resumes.append(time.perf_counter() - start)
    return pauses, resumes


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    del postgres
    children = 1_000 if quick else 10_000
    tree = await _tree(f"sqlite:///{workdir / 'tree.db'}", children)
    bare, bare_collector = await _bare(children)
    rounds = 100 if quick else 300
    pauses, resumes = await pause_resume_samples(f"sqlite:///{workdir / 'pause.db'}", rounds)
    floor = statistics.median(await bare_txn_samples(workdir / "bare-pause.db", rounds))
    return [
        Figure(
            "cancel_tree_10k_ms",
            tree.last * 1e3,
            "ms",
            bare * 1e3,
            "ratio <= 2.5",
            f"{children} owned child runs, each with a call in flight; fence durable for "
            "all in one transaction, then every scope cancelled; baseline: bare task cancel; "
            f"the fence durable at {tree.durable * 1e3:.1f} ms; CPython's "
            f"collector ran {tree.collector * 1e3:.1f} ms of the figure (bare: "
            f"{bare_collector * 1e3:.1f} ms)",
        ),
        Figure(
            "pause_ms",
            statistics.median(pauses) * 1e3,
            "ms",
            floor * 1e3,
            "",
            f"p50 of {rounds}: pause() of an idle run to its receipt (the pause durable, the "
            "receipt read); baseline: one bare durable txn",
        ),
        Figure(
            "resume_to_call_ms",
            statistics.median(resumes) * 1e3,
            "ms",
            floor * 1e3,
            "",
            f"p50 of {rounds}: resume() of a paused run to the call waiting at its gate "
            "passing it (its tool invoked); baseline: one bare durable txn",
        ),
    ]
