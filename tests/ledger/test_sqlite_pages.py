"""What a gated call and a tree's fence write to SQLite's log, counted page by page
(ADR 0035, ADR 0045).

The one fsync a call pays covers every page its transaction writes; these
tests read the write-ahead log itself, so they count, not time.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.bench.wal import last_commits, pages_by_tree
from stopline.domain.vocab import RunState
from stopline.errors import LedgerUnavailable
from stopline.ledger import open_backend
from stopline.ledger.backend import RunSpec
from stopline.ledger.engine import fence
from stopline.ledger.engine.db import run_sync
from stopline.ledger.sqlite import SQLiteBackend, SQLiteDb
from stopline.testing import FakeProvider

# what one sequential call's transaction (the previous call's outcome, this call's
# intent) may touch: the operation and its indexes, the log and its index, and the
# header page when the file grows
_CALL_PAGES = {
    "operations",
    "sqlite_autoindex_operations_1",
    "ops_run",
    "ops_open",
    "events",
    "events_run",
    "sqlite_schema",
}


async def test_a_sequential_call_writes_only_its_operation_and_its_log(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("send")
    async with (
        stopline.open(f"sqlite:///{path}") as ledger,
        ledger.run("r", owner="u", run_id="r1") as run,
    ):
        for i in range(40):
            await run.call(provider.tool, i)
        commits = last_commits(path, 20)  # calls in a row: outcome + next intent each
        written = pages_by_tree(path, commits)
    assert len(commits) == 20
    assert set(written) <= _CALL_PAGES, written
    # AUTOINCREMENT wrote sqlite_sequence in every transaction that logged an event
    assert "sqlite_sequence" not in written


# A tree whose fence dirties more pages than SQLite's default cache (2 MiB) holds:
# ~1,200 pages of 4 KiB for 10,000 runs (ADR 0045).
_TREE = 10_000


async def _sqlite(url: str, *, read_only: bool = False) -> SQLiteBackend:
    backend = await open_backend(url, read_only=read_only)
    assert isinstance(backend, SQLiteBackend)
    return backend


async def _tree(path: Path, url: str) -> SQLiteBackend:
    backend = await _sqlite(url)
    await backend.create_run(RunSpec("root", "root", "u", "t"))
    async with anyio.create_task_group() as tg:  # concurrent: they share commits
        for n in range(_TREE):
            spec = RunSpec(f"root-{n}", f"c{n}", "u", "t", parent_id="root")
            tg.start_soon(backend.create_run, spec)
    with contextlib.closing(sqlite3.connect(path)) as other:  # the log emptied
        assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    return backend


def _fence_then_log_size(path: Path) -> Callable[[sqlite3.Connection], int]:
    """The tree's cancel in the writer's transaction; the log's size before its commit."""

    def body(conn: sqlite3.Connection) -> int:
        result = run_sync(fence.cancel(SQLiteDb(conn, "test"), "root", "u", ""))
        assert len(result.fenced) == _TREE + 1
        return Path(f"{path}-wal").stat().st_size

    return body


@pytest.mark.parametrize(("option", "spills"), [("", False), ("?cache_mib=2", True)])
async def test_a_big_trees_fence_keeps_its_pages_until_its_commit(
    tmp_path: Path, option: str, spills: bool
) -> None:
    """With the ledger's page cache the fence of a 10,000-run tree writes nothing to the
    log before its commit; with SQLite's own 2 MiB it spills pages there mid-way, and
    reads them back (the premise)."""
    path = tmp_path / "l.db"
    backend = await _tree(path, f"sqlite:///{path}{option}")
    try:
        assert (await backend.transact(_fence_then_log_size(path)) > 0) is spills
        assert (await backend.get_run("root-0")).state is RunState.CANCELLING
    finally:
        await backend.close()


@pytest.mark.parametrize(("option", "kib"), [("", 16 * 1024), ("?cache_mib=64", 64 * 1024)])
async def test_each_connection_has_the_page_cache_asked_for(
    tmp_path: Path, option: str, kib: int
) -> None:
    backend = await _sqlite(f"sqlite:///{tmp_path}/l.db{option}")
    try:
        size = await backend.transact(lambda c: c.execute("PRAGMA cache_size").fetchone()[0])
        assert size == -kib
    finally:
        await backend.close()
    reader = await _sqlite(f"sqlite:///{tmp_path}/l.db{option}", read_only=True)
    try:
        size = await reader.transact(lambda c: c.execute("PRAGMA cache_size").fetchone()[0])
        assert size == -kib
    finally:
        await reader.close()


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "big", "65537"])
async def test_a_bad_cache_size_is_refused_before_the_file_is_made(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "l.db"
    with pytest.raises(LedgerUnavailable, match=f"cache_mib='?{re.escape(value)}'? is not"):
        await open_backend(f"sqlite:///{path}?cache_mib={value}")
    assert not path.exists()
