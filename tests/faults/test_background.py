"""A storage fault in background work cancels nothing and ends as a typed error, if any."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Cancellable, Policy, Receipt, RunState
from stopline.testing import FakeProvider
from tests.faults.disk import integrity


@contextlib.contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """Another process's write transaction holds the file (a real SQLite lock)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def held_outcome_beside_a_run(
    ledger: stopline.Ledger, path: Path, while_held: Callable[[], Awaitable[None]]
) -> tuple[Receipt, Receipt]:
    """Run ``run_a`` (cancelled, its outcome's write held by another process's lock, a
    background step failing until it is let go: ``while_held`` runs meanwhile) beside
    ``run_b``, which nothing cancels; their receipts once settled."""
    slow = FakeProvider("slow", cancellable=Cancellable.NEVER)
    other = FakeProvider("other")
    responding = slow.hold("responding")
    fault_cleared = anyio.Event()

    async def run_a() -> None:
        async with ledger.run("a", owner="u", run_id="run_a", policy=Policy.AT_BOUNDARY) as a:
            await a.call(slow.tool, "x", key="x")
            a.boundary()

    async def run_b() -> None:
        async with ledger.run("b", owner="u", run_id="run_b") as b:
            await b.call(other.tool, "1", key="1")
            await fault_cleared.wait()  # untouched by the fault and by a's cancel
            await b.call(other.tool, "2", key="2")

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_a)
        tg.start_soon(run_b)
        await responding.reached.wait()
        await ledger.cancel("run_a", by="u")
        with write_locked(path):
            responding.release()  # the outcome cannot be written: it is held
            await while_held()
        fault_cleared.set()
    a = await ledger.wait_settled("run_a", timeout=30)
    b = await ledger.wait_settled("run_b", timeout=30)
    return a, b


@pytest.mark.parametrize("durable_outcomes", [True, False])
async def test_a_fault_in_background_work_cancels_no_run(
    tmp_path: Path, durable_outcomes: bool
) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}?busy_timeout=0.05"
    async with stopline.open(url, durable_outcomes=durable_outcomes) as ledger:

        async def degraded() -> None:
            while not ledger.health.degraded:
                await ledger.health.changed()
            recording = ledger.core.outcomes.in_hand()
            assert "run_a/x" in recording  # in hand, not durable: the receipt says so

        a, b = await held_outcome_beside_a_run(ledger, path, degraded)
        with anyio.fail_after(30):
            while ledger.health.degraded:  # the retried steps finish once the fault clears
                await ledger.health.changed()
        health = ledger.health.to_json()
    assert a.run_state is RunState.CANCELLED  # the held outcome landed; the run settled
    assert [line.status.value for line in a.lines] == ["committed"]
    assert b.run_state is RunState.COMPLETED  # nobody cancelled b, and nothing did
    assert [line.status.value for line in b.lines] == ["committed", "committed"]
    assert health["failures"] >= 1 and not health["degraded"]
    assert integrity(path) == "ok"


async def test_a_failing_background_step_ends_alone_and_open_raises_nothing(
    tmp_path: Path,
) -> None:
    provider = FakeProvider("send")

    async def buggy_step() -> None:
        raise KeyError("a bug in background work")

    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        async with ledger.run("job", owner="u", run_id="run_1") as run:
            ledger.spawn(buggy_step)
            while "buggy_step" not in ledger.health.steps:
                await ledger.health.changed()
            await run.call(provider.tool, "after", key="after")  # the run goes on
        step = ledger.health.steps["buggy_step"]
    assert (step.failures, step.retries, step.failing) == (1, 0, 0)  # a bug is not retried
    assert "KeyError" in step.last_error
    assert provider.effects == ["run_1/after"]
