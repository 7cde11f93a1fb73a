"""The SQLite ledger's files deleted or replaced under a running worker (ADR 0057).

SQLite goes on with the files it opened: before, the worker kept dispatching with no
record another process could read, its receipt said "Completed.", its health was not
degraded, a ``stopline cancel`` from a shell could not reach the run, and everything
was lost at exit. Now the next transaction fails closed with ``LedgerCorrupt`` naming
the file, nothing more is dispatched, the cancel watch stops at it (logged once) and
the worker shows broken; no new file is made at the path.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.errors import LedgerCorrupt
from stopline.ledger.sqlite import SQLiteBackend
from stopline.runtime.boundary import Health
from stopline.testing import FakeProvider

pytestmark = pytest.mark.timeout(60)


async def broken(health: Health, step: str) -> None:
    """Until ``step`` has stopped at the error (bounded by the caller's test timeout)."""
    with anyio.fail_after(30):
        while step not in health.steps:
            await health.changed()


def remove(path: Path, *ends: str) -> None:
    for end in ends:
        os.remove(f"{path}{end}")


async def calls_across(
    ledger: stopline.Ledger, provider: FakeProvider, fault: Callable[[], None]
) -> None:
    """Run ``run_a``: one call, then ``fault()`` (the files go), then a second call."""
    async with ledger.run("job", owner="u", run_id="run_a") as run:
        await run.call(provider.tool, "1", key="1")
        fault()
        await run.call(provider.tool, "2", key="2")


@pytest.mark.parametrize("poll_ms", [50, 0], ids=["watched", "not-watched"])
async def test_a_deleted_ledger_file_fails_the_next_gate_closed(
    tmp_path: Path, poll_ms: int
) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("p")
    async with stopline.open(f"sqlite:///{path}?cancel_poll_ms={poll_ms}") as ledger:
        with pytest.raises(LedgerCorrupt, match=r"l\.db was deleted under this process"):
            await calls_across(ledger, provider, lambda: remove(path, "", "-wal", "-shm"))
        with pytest.raises(LedgerCorrupt, match="restore the ledger from backup"):
            await ledger.receipt("run_a")  # the receipt does not say "Completed." either
        await broken(ledger.health, "record" if poll_ms == 0 else "cancel_watch_ended")
        assert "was deleted" in ledger.health.broken and ledger.health.degraded
    assert provider.requests == ["run_a/1"]  # nothing dispatched once it was gone
    assert os.listdir(tmp_path) == []  # and no new, empty ledger made in its place


async def test_an_idle_worker_notices_its_deleted_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "l.db"
    async with stopline.open(f"sqlite:///{path}") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend) and backend.watch is not None
        remove(path, "", "-wal", "-shm")
        await broken(ledger.health, "cancel_watch_ended")  # no call made: the watch saw it
        assert isinstance(backend.watch.stopped, LedgerCorrupt)
        assert "l.db was deleted" in ledger.health.broken
        step = ledger.health.steps["cancel_watch_ended"]
        assert step.retries == 0 and step.failing == 0
        with pytest.raises(LedgerCorrupt, match="was deleted"):
            await ledger.receipt("anything")
    stops = [r for r in caplog.records if r.getMessage().startswith("cancel watch on")]
    assert len(stops) == 1 and "stopped" in stops[0].getMessage()  # logged once
    assert os.listdir(tmp_path) == []


async def test_a_ledger_file_replaced_under_the_worker_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("p")
    async with stopline.open(f"sqlite:///{path}") as ledger:

        def restore() -> None:  # a copy, moved over it (a backup restored)
            with sqlite3.connect(path) as other:
                other.execute("PRAGMA wal_checkpoint(FULL)")
            shutil.copy(path, tmp_path / "copy.db")
            os.replace(tmp_path / "copy.db", path)

        with pytest.raises(LedgerCorrupt, match=r"l\.db was replaced under this process"):
            await calls_across(ledger, provider, restore)
    assert provider.requests == ["run_a/1"]


async def test_a_deleted_wal_and_shm_fail_closed_and_the_close_keeps_the_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("p")
    async with stopline.open(f"sqlite:///{path}") as ledger:
        with pytest.raises(LedgerCorrupt, match=r"l\.db-wal was deleted under this process"):
            await calls_across(ledger, provider, lambda: remove(path, "-wal", "-shm"))
        await broken(ledger.health, "cancel_watch_ended")
        assert "PRAGMA integrity_check" in ledger.health.broken
    assert provider.requests == ["run_a/1"]
    # no other process opened it meanwhile: closing wrote the log into the file
    with sqlite3.connect(path) as after:
        assert after.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        ops = after.execute("SELECT id FROM operations").fetchall()
    assert ops == [("run_a/1",)]
