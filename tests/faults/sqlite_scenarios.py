"""SQLite fault scenarios, run in this process (tmpfs) or in a child (``RLIMIT_FSIZE``).

``python -m tests.faults.sqlite_scenarios SCENARIO PATH`` runs one in a child
process and prints what it saw as JSON; the tests assert on that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

import stopline
from stopline.domain.model import RunRecord
from stopline.domain.vocab import RunEvent
from stopline.errors import IllegalTransition, LedgerUnavailable, UnknownRun
from stopline.ledger.backend import Backend
from stopline.ledger.forwarding import ForwardingBackend
from stopline.ledger.sqlite import SQLiteBackend
from stopline.testing import FakeProvider
from tests.faults.disk import integrity, limit_file_size
from tests.lifecycle.test_tree_cancel import cancel_a_tree, holding_tool
from tests.support.held import Held
from tests.support.writer import HeldWriter

__all__ = [
    "ask_on_a_full_disk",
    "batched_settle_on_a_full_disk",
    "bulk_record_on_a_full_disk",
    "committed_beside_a_held_outcome",
    "fence_on_a_full_disk",
    "fill_mid_run",
    "held_outcome",
    "open_when_full",
]


async def fill_mid_run(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """A run writes, the disk fills, its next calls fail closed, the disk frees, it finishes."""
    provider = FakeProvider("send")
    errors: list[str] = []
    async with stopline.open(f"sqlite:///{path}") as ledger:
        async with ledger.run("job", owner="u", run_id="run_full") as run:
            await run.call(provider.tool, "before", key="before")
            fill()
            for attempt in range(3):  # the writer serves each one: it did not die
                try:
                    await run.call(provider.tool, "during", key=f"during_{attempt}")
                except LedgerUnavailable as exc:
                    errors.append(type(exc).__name__)
            dispatched_during = [r for r in provider.requests if "during" in r]
            readable = (await ledger.receipt("run_full")).run_state.value
            free()
            await run.call(provider.tool, "after", key="after")
        receipt = await ledger.receipt("run_full")
    return {
        "errors": errors,
        "dispatched_during": dispatched_during,
        "readable_during": readable,
        "state": receipt.run_state.value,
        "statuses": sorted(line.status.value for line in receipt.lines),
        "integrity": integrity(path),
    }


async def held_outcome(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """The provider answers while the disk is full: the call returns, the outcome is held,
    the receipt says recording; once the disk has room it lands and the run settles."""
    provider = FakeProvider("send", cancellable=stopline.Cancellable.NEVER)
    responding = provider.hold("responding")
    result: dict[str, Any] = {}
    async with stopline.open(f"sqlite:///{path}", durable_outcomes=True) as ledger:
        async with ledger.run("job", owner="u", run_id="run_held") as run:

            async def call() -> None:
                result["value"] = await run.call(provider.tool, "x", key="x")

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await responding.reached.wait()
                fill()
                responding.release()
            during = await ledger.receipt("run_held")  # reads still work on a full disk
            free()
        final = await ledger.wait_settled("run_held", timeout=30)
    return {
        "returned": result.get("value"),
        "recording": [line.recording for line in during.lines],
        "words": during.lines[0].status_words,
        "settled_during": during.settled,
        "state": final.run_state.value,
        "statuses": [line.status.value for line in final.lines],
        "integrity": integrity(path),
    }


async def ask_on_a_full_disk(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """The disk fills between the fence and the note that records the provider's cancel
    request: ``cancel()`` still returns (it waits for the ask to be sent, or to fail, not
    for the disk), the ask is retried, and once the disk has room the provider is asked
    and the run settles."""
    asked: list[str] = []
    entered = anyio.Event()

    @stopline.tool(cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
    async def upload(ctx: stopline.CallContext) -> None:
        entered.set()
        await anyio.sleep_forever()

    @upload.canceller
    async def _(ctx: stopline.CallContext) -> bool:
        asked.append(ctx.key)
        return True

    filled: list[bool] = []

    def fill_once(run_ids: Any) -> None:  # the fence is durable and delivered: now
        if not filled:
            filled.append(True)
            fill()

    async with stopline.open(f"sqlite:///{path}", tools=[upload]) as ledger:
        ledger.on_cancel(fill_once)

        async def workflow() -> None:
            async with (
                ledger.run("job", owner="u", run_id="run_ask") as run,
                run.phase(stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE),
            ):
                await run.call(upload, key="x")

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await entered.wait()
            with anyio.fail_after(20):  # a hang fails here, not in CI's timeout
                at_cancel = await ledger.cancel("run_ask", by="u")
            asked_during = list(asked)
            with anyio.fail_after(20):
                while "ask" not in ledger.health.steps:
                    await ledger.health.changed()
            failing = ledger.health.steps["ask"].last_error
            free()
        final = await ledger.wait_settled("run_ask", timeout=30)
    return {
        "fenced": at_cancel.run_state.value,
        "asked_during": asked_during,
        "ask_error": failing,
        "asked_after": asked,
        "state": final.run_state.value,
        "provider_cancel": final.lines[0].provider_cancel,
        "integrity": integrity(path),
    }


async def bulk_record_on_a_full_disk(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """The disk fills between a tree's fence and the one transaction that records every
    call it interrupted (R3): that record fails typed as a background step and is
    retried; once the disk has room every call is recorded once, and the tree settles."""
    hold, all_in = holding_tool()
    filled: list[bool] = []

    def fill_once(run_ids: Any) -> None:  # the fence is durable and delivered: now
        if not filled:
            filled.append(True)
            fill()

    async with stopline.open(f"sqlite:///{path}", tools=[hold]) as ledger:
        ledger.on_cancel(fill_once)
        with anyio.fail_after(20):  # a hang fails here, not in CI's timeout
            root = await cancel_a_tree(ledger, hold, all_in)
            while "record_interrupted" not in ledger.health.steps:
                await ledger.health.changed()
        failing = ledger.health.steps["record_interrupted"].last_error
        free()
        final = await ledger.wait_settled(root, timeout=30)
    with sqlite3.connect(path) as conn:
        lost = dict(
            conn.execute("SELECT op_id, count(*) FROM events WHERE kind = 'lost' GROUP BY op_id")
        )
    return {
        "record_error": failing,
        "state": final.run_state.value,
        "statuses": sorted({line.status.value for line in final.lines}),
        "calls": len(final.lines),
        "lost_per_call": sorted(set(lost.values())),
        "lost_calls": len(lost),
        "integrity": integrity(path),
    }


class _FillOnFirstMove(ForwardingBackend):
    """Fills the disk just before the first batched move of runs is written."""

    def __init__(self, inner: Backend, fill: Callable[[], None]) -> None:
        super().__init__(inner)
        self._fill: Callable[[], None] | None = fill

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill()
        return await self.inner.run_events(items, by=by)


async def batched_settle_on_a_full_disk(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """The disk fills just before a cancelled tree's runs are moved together in one
    transaction: the step fails typed for every run in it, each run's advance is
    retried in the background, and once the disk has room every run settles, its
    moves logged once each."""
    hold, all_in = holding_tool()
    observe = functools.partial(_FillOnFirstMove, fill=fill)
    async with stopline.open(f"sqlite:///{path}", tools=[hold], observers=[observe]) as ledger:
        with anyio.fail_after(20):  # a hang fails here, not in CI's timeout
            root = await cancel_a_tree(ledger, hold, all_in)
            while not {"advance", "advance_many"} & ledger.health.steps.keys():
                await ledger.health.changed()
        step = ({"advance", "advance_many"} & ledger.health.steps.keys()).pop()
        failing = ledger.health.steps[step].last_error
        free()
        final = await ledger.wait_settled(root, timeout=30)
        children = [r for r in await ledger.backend.list_runs(limit=100) if r.id != root]
    with sqlite3.connect(path) as conn:
        moves = conn.execute(
            "SELECT run_id, kind, count(*) FROM events WHERE kind IN ('settle', 'settled')"
            " GROUP BY run_id, kind"
        ).fetchall()
    return {
        "step_error": failing,
        "state": final.run_state.value,
        "statuses": sorted({line.status.value for line in final.lines}),
        "children": len(children),
        "children_states": sorted({r.state.value for r in children}),
        "moves_per_run": sorted({(kind, n) for _, kind, n in moves}),
        "moved_runs": len({run_id for run_id, _, _ in moves}),
        "integrity": integrity(path),
    }


async def fence_on_a_full_disk(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """The disk fills before a cancel's fence: the fence is not durable, so the cut that
    rides its commit (ADR 0043) is not made; the cancel fails typed, the call in flight
    goes on, the run is still running. Once the disk frees, the cancel goes through."""
    async with stopline.open(f"sqlite:///{path}") as ledger:
        held = Held(ledger, "run_fence")
        async with held.in_flight():
            fill()
            try:
                await ledger.cancel("run_fence", by="u")
                error = ""
            except LedgerUnavailable as exc:
                error = type(exc).__name__
            interrupted_during = held.interrupted.is_set()
            state_during = (await ledger.receipt("run_fence")).run_state.value
            free()
            await ledger.cancel("run_fence", by="u")
        final = await ledger.wait_settled("run_fence", timeout=30)
    return {
        "error": error,
        "interrupted_during": interrupted_during,
        "state_during": state_during,
        "interrupted_after": held.interrupted.is_set(),
        "state": final.run_state.value,
        "statuses": [line.status.value for line in final.lines],
        "integrity": integrity(path),
    }


async def committed_beside_a_held_outcome(
    path: Path, fill: Callable[[], None], free: Callable[[], None]
) -> dict[str, Any]:
    """A batch of a deferred outcome and a job whose caller waits meets a full disk at its
    commit, and each job runs alone: the outcome still does not fit (held for the next
    batch), the other job does and commits. It must run once and answer its caller.
    The writer ran every job of the batch not held once more, so a job that had
    committed alone ran twice: a gate found its own intent the second time, and its call
    was never made (the soak's run that completed with an operation ``requested``).

    The log's space is reused from its start after a checkpoint, so on the full disk a
    small transaction fits in it and a large one does not."""
    backend = await SQLiteBackend.open(path)
    writer = backend._writer
    ran: list[str] = []
    landed: list[str] = []
    answer: dict[str, str] = {}
    outcome_done = anyio.Event()

    def outcome(conn: sqlite3.Connection) -> str:  # deferred: nobody waits on it
        conn.execute("INSERT INTO blobs VALUES (1, zeroblob(3000000))")
        return "outcome"

    def then(result: Callable[[], str]) -> None:
        landed.append(result())
        outcome_done.set()

    def small(conn: sqlite3.Connection) -> str:
        ran.append("small")
        conn.execute("INSERT INTO blobs VALUES (2, x'00')")
        return "small"

    async def waiting() -> None:
        try:
            answer["small"] = await writer.submit(small)
        except Exception as exc:  # what the caller was told
            answer["small"] = f"{type(exc).__name__}: {exc}"

    try:
        await writer.submit(lambda c: c.execute("CREATE TABLE blobs (id INTEGER PRIMARY KEY, b)"))
        await writer.submit(lambda c: c.execute("INSERT INTO blobs VALUES (0, zeroblob(1000000))"))
        with contextlib.closing(sqlite3.connect(path)) as other:
            other.execute("PRAGMA wal_checkpoint(RESTART)")
        fill()
        held = HeldWriter(writer)
        async with anyio.create_task_group() as tg:
            await held.start(tg)
            writer.enqueue(outcome, then)
            tg.start_soon(waiting)
            await held.queued(2)
            held.release.set()
        held_while_full = not outcome_done.is_set()
        free()
        ids = await writer.submit(lambda c: [r[0] for r in c.execute("SELECT id FROM blobs")])
        with anyio.fail_after(10):
            await outcome_done.wait()
    finally:
        await backend.close()
    return {
        "small": answer.get("small"),
        "ran": ran,
        "held_while_full": held_while_full,
        "outcome": landed,
        "ids": sorted(ids),
        "integrity": integrity(path),
    }


async def open_when_full(path: Path, fill: Callable[[], None]) -> dict[str, str]:
    """Opening a new ledger on a full disk names the full disk."""
    fill()
    try:
        async with stopline.open(f"sqlite:///{path}"):
            return {"error": "", "message": ""}
    except LedgerUnavailable as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def _biggest_file(directory: Path) -> int:
    return max((p.stat().st_size for p in directory.iterdir() if p.is_file()), default=0)


async def _main(scenario: str, path: Path) -> dict[str, Any]:
    fill = lambda: limit_file_size(_biggest_file(path.parent))  # noqa: E731
    free = lambda: limit_file_size(None)  # noqa: E731
    if scenario == "fill_mid_run":
        return await fill_mid_run(path, fill, free)
    if scenario == "held_outcome":
        return await held_outcome(path, fill, free)
    if scenario == "ask_on_a_full_disk":
        return await ask_on_a_full_disk(path, fill, free)
    if scenario == "bulk_record_on_a_full_disk":
        return await bulk_record_on_a_full_disk(path, fill, free)
    if scenario == "fence_on_a_full_disk":
        return await fence_on_a_full_disk(path, fill, free)
    if scenario == "committed_beside_a_held_outcome":
        return await committed_beside_a_held_outcome(path, fill, free)
    if scenario == "batched_settle_on_a_full_disk":
        return await batched_settle_on_a_full_disk(path, fill, free)
    return await open_when_full(path, lambda: limit_file_size(0))


if __name__ == "__main__":
    print(json.dumps(anyio.run(_main, sys.argv[1], Path(sys.argv[2]))))
