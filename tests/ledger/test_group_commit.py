"""ADR 0022: an outcome nobody waits on rides the next commit, or commits within the bound."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio

import stopline
from stopline.domain.vocab import RunState
from stopline.ledger import open_backend
from stopline.ledger.backend import RunSpec
from stopline.ledger.sqlite import SQLiteBackend
from stopline.testing import FakeProvider
from tests.support.writer import HeldWriter


async def _backend(path: Path, group_commit_ms: int) -> SQLiteBackend:
    backend = await open_backend(f"sqlite:///{path}?group_commit_ms={group_commit_ms}")
    assert isinstance(backend, SQLiteBackend)
    return backend


async def test_a_deferred_write_rides_the_next_commit(tmp_path: Path) -> None:
    # a window far longer than the test: only the next job can end it
    backend = await _backend(tmp_path / "l.db", 60_000)
    commits: list[str] = []
    done = anyio.Event()
    try:
        await backend.transact(lambda conn: conn.set_trace_callback(_commits_into(commits)))
        before = len(commits)

        def deferred(conn: sqlite3.Connection) -> int:
            return conn.execute("SELECT 1").fetchone()[0]  # type: ignore[no-any-return]

        got: list[int] = []

        def then(outcome: Callable[[], int]) -> None:
            got.append(outcome())
            done.set()

        backend._writer.enqueue(deferred, then)
        await backend.transact(lambda conn: None)  # someone waits on this one
        await done.wait()
        assert got == [1]
        assert len(commits) - before == 1  # both in one transaction: one fsync
    finally:
        await backend.close()


async def test_a_lone_deferred_write_commits_within_the_bound(tmp_path: Path) -> None:
    backend = await _backend(tmp_path / "l.db", 5)
    done = anyio.Event()
    try:
        backend._writer.enqueue(lambda conn: None, lambda outcome: done.set())
        with anyio.fail_after(10):  # no other job comes: the bound ends the wait
            await done.wait()
    finally:
        await backend.close()


async def test_outcomes_are_durable_after_close_and_in_order(tmp_path: Path) -> None:
    """A sequential workflow's outcomes all land, each after its own intent (the default)."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    provider = FakeProvider("send")
    async with stopline.open(url) as ledger, ledger.run("r", owner="u", run_id="r1") as run:
        for i in range(20):
            await run.call(provider.tool, i)
    with sqlite3.connect(tmp_path / "l.db") as conn:
        statuses = {s for (s,) in conn.execute("SELECT status FROM operations")}
        kinds = [k for (k,) in conn.execute("SELECT kind FROM events WHERE op_id IS NOT NULL")]
    assert statuses == {"committed"}
    assert kinds == ["gate_passed", "accepted", "committed"] * 20


def _commits_into(commits: list[str]) -> Callable[[str], None]:
    def trace(statement: str) -> None:
        if statement.strip().upper() == "COMMIT":
            commits.append(statement)

    return trace


def _state(conn: sqlite3.Connection) -> str:
    return str(conn.execute("SELECT state FROM runs").fetchone()[0])


async def test_a_cancels_fence_commits_without_the_jobs_queued_after_it(tmp_path: Path) -> None:
    """A cancel interrupts nothing until its fence is durable: work queued after it
    commits in the next transaction, so it never delays the fence's commit."""
    path = tmp_path / "l.db"
    backend = await _backend(path, 2)
    writer = HeldWriter(backend._writer)
    seen: list[str] = []

    def later(conn: sqlite3.Connection) -> None:  # queued after the cancel
        with contextlib.closing(sqlite3.connect(path)) as reader:
            seen.append(_state(reader))

    try:
        await backend.create_run(RunSpec("r1", "r", "u", "t"))
        async with anyio.create_task_group() as tg:
            await writer.start(tg)
            tg.start_soon(functools.partial(backend.cancel, "r1", by="u"))
            await writer.queued(1)
            tg.start_soon(backend.transact, later)
            await writer.queued(2)
            writer.release.set()
        fenced = (await backend.get_run("r1")).state
    finally:
        writer.release.set()
        await backend.close()
    assert fenced is not RunState.RUNNING
    assert seen == [fenced.value]  # committed before the later job ran


async def test_a_cancels_fence_commits_before_the_waiting_jobs_queued_ahead_of_it(
    tmp_path: Path,
) -> None:
    """In a busy process the fence queues behind the other runs' calls: it commits
    before those whose callers still wait (concurrent with it, either order is one
    the ledger allows), never before a deferred outcome, which everything the process
    does later must see."""
    backend = await _backend(tmp_path / "l.db", 60_000)
    writer = HeldWriter(backend._writer)
    seen: dict[str, str] = {}
    recorded = anyio.Event()

    def saw(name: str) -> Callable[[sqlite3.Connection], None]:
        def look(conn: sqlite3.Connection) -> None:
            seen[name] = _state(conn)

        return look

    try:
        await backend.create_run(RunSpec("r1", "r", "u", "t"))
        async with anyio.create_task_group() as tg:
            await writer.start(tg)
            backend._writer.enqueue(saw("deferred"), lambda outcome: recorded.set())
            tg.start_soon(backend.transact, saw("waiting"))
            await writer.queued(2)
            tg.start_soon(functools.partial(backend.cancel, "r1", by="u"))
            await writer.queued(3)
            writer.release.set()
            await recorded.wait()
    finally:
        writer.release.set()
        await backend.close()
    assert seen == {"deferred": "running", "waiting": "cancelling"}
