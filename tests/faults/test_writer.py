"""The writer thread cannot die, and every wait on it honours cancellation."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from stopline.errors import LedgerFull
from stopline.ledger._writer import Writer
from stopline.ledger.sqlite import SQLiteBackend
from tests.support.writer import HeldWriter


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[Writer]:
    backend = await SQLiteBackend.open(tmp_path / "ledger.db")
    try:
        yield backend._writer
    finally:
        await backend.close()


def auto_rolled_back(conn: sqlite3.Connection) -> None:
    """What a full disk does mid-statement: SQLite ends the transaction itself."""
    conn.execute("INSERT INTO workers VALUES ('w', 'h', 1, 0, 0, 0)")
    conn.execute("ROLLBACK")
    raise sqlite3.OperationalError("database or disk is full")


def count_workers(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT count(*) FROM workers").fetchone()[0])


async def test_a_failed_rollback_after_sqlites_own_is_one_typed_error(writer: Writer) -> None:
    for _ in range(3):
        with pytest.raises(LedgerFull, match="disk is full") as info:
            await writer.submit(auto_rolled_back)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    assert await writer.submit(count_workers) == 0  # still serving, nothing half-written


async def test_a_cancelled_caller_gives_up_and_its_queued_job_never_runs(writer: Writer) -> None:
    held = HeldWriter(writer)
    ran: list[str] = []

    def second(conn: sqlite3.Connection) -> None:
        ran.append("second")

    async with anyio.create_task_group() as tg:
        await held.start(tg)  # `second` now queues behind the held job
        writer.grace = 0  # a stuck writer: the cancelled caller gives up at once
        with anyio.CancelScope() as scope:
            scope.cancel()
            await writer.submit(second)
        assert scope.cancelled_caught  # the caller was not kept waiting
        held.release.set()
    assert await writer.submit(count_workers) == 0
    assert ran == []  # withdrawn before the thread took it: it never ran


async def test_a_cancelled_caller_learns_the_outcome_within_the_grace(writer: Writer) -> None:
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await writer.submit(count_workers) == 0  # done in the grace: reported
        await anyio.lowlevel.checkpoint()
    assert scope.cancelled_caught  # and the cancel still landed at the next await


async def test_a_job_that_must_run_runs_though_its_caller_is_cancelled(writer: Writer) -> None:
    writer.grace = 0
    ran: list[str] = []

    def outcome(conn: sqlite3.Connection) -> str:
        ran.append("outcome")
        return "written"

    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await writer.submit(outcome, must_run=True) == "written"
    assert ran == ["outcome"]


async def test_a_prompt_job_on_a_full_disk_fails_alone_and_the_outcome_before_it_lands(
    writer: Writer,
) -> None:
    """A cancel's fence runs first with the deferred outcomes queued before it, then the
    jobs whose callers wait (ADR 0042). When the fence meets a full disk, its caller
    gets the typed error alone: the outcome is written in a transaction of its own, as
    any job of a failed batch is, and the waiting job runs after both and sees it."""
    held = HeldWriter(writer)
    landed: list[int] = []
    outcome_done = anyio.Event()

    def outcome(conn: sqlite3.Connection) -> int:  # deferred: its caller went on
        conn.execute("INSERT INTO workers VALUES ('outcome', 'h', 1, 0, 0, 0)")
        return 1

    def then(result: Callable[[], int]) -> None:
        landed.append(result())
        outcome_done.set()

    answers: dict[str, object] = {}

    async def waiting() -> None:
        answers["waiting"] = await writer.submit(count_workers)

    async def fence() -> None:
        with pytest.raises(LedgerFull) as info:
            await writer.submit(auto_rolled_back, prompt=True)
        answers["fence"] = info.value

    async with anyio.create_task_group() as tg:
        await held.start(tg)
        writer.enqueue(outcome, then)
        tg.start_soon(waiting)
        await held.queued(2)
        tg.start_soon(fence)
        await held.queued(3)
        held.release.set()
    await outcome_done.wait()
    assert isinstance(answers["fence"], LedgerFull)
    assert landed == [1]  # the outcome landed, not lost with the fence
    assert answers["waiting"] == 1  # ran after both, and sees the outcome
    assert await writer.submit(count_workers) == 1
