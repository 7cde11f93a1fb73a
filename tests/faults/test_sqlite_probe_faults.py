"""Storage faults from the outside probe (2026, F4-F6), each injected on a real component.

- F4: the SQLite cancel watch retried a corrupt ledger for ever ("database disk image is
  malformed; retrying" once a second) and the worker did not show degraded until some
  other step met it. Now the watch stops at it, logged once, and ``health.broken`` says so.
- F5: a ledger made immutable (``chattr +i``) was ``LedgerIOError``, whose advice sends the
  operator to a failing disk; it is ``LedgerReadOnly`` naming the file.
- F6: a tool name no key may hold was accepted and failed at the first call as an
  "invalid key"; it is refused when the tool is made, naming the tool name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.errors import InvalidInput, LedgerCorrupt, LedgerIOError, LedgerReadOnly
from stopline.ledger.sqlite import SQLiteBackend
from stopline.testing import FakeProvider
from tests.faults.test_sqlite_file_gone import calls_across

pytestmark = pytest.mark.timeout(60)


def overwrite_after_page_one(path: Path) -> None:
    """Another process damages the file: every page after the first is garbage."""
    with sqlite3.connect(path) as other:
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(4096)
        f.write(b"\xa5" * (size - 4096))


async def test_the_cancel_watch_stops_at_a_corrupt_ledger_and_the_worker_shows_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("p")
    caplog.set_level(logging.WARNING, logger="stopline.ledger.sqlite")
    async with stopline.open(f"sqlite:///{path}") as ledger:
        backend = ledger.backend
        assert isinstance(backend, SQLiteBackend) and backend.watch is not None
        with pytest.raises(LedgerCorrupt, match="malformed"):
            await calls_across(ledger, provider, lambda: overwrite_after_page_one(path))
        with anyio.fail_after(30):
            while "cancel_watch_ended" not in ledger.health.steps:
                await ledger.health.changed()
        assert isinstance(backend.watch.stopped, LedgerCorrupt)
        assert "malformed" in ledger.health.broken and ledger.health.degraded
        step = ledger.health.steps["cancel_watch_ended"]
        assert step.retries == 0 and step.failing == 0  # stopped there, not retried
        polls = backend.watch.polls
    assert backend.watch.polls == polls
    watch = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cancel watch")]
    assert len(watch) == 1 and "stopped" in watch[0], watch  # logged once, no "retrying"
    assert provider.requests == ["run_a/1"]


@contextlib.contextmanager
def immutable(*paths: str) -> Iterator[None]:
    """``chattr +i`` (as root) for the block. Not the ``-shm``: SQLite maps it, and a
    page it first writes after that is SIGBUS for the whole process."""
    for p in paths:
        subprocess.run(["chattr", "+i", p], check=True)
    try:
        yield
    finally:
        for p in paths:
            subprocess.run(["chattr", "-i", p], check=True)


async def test_an_immutable_ledger_is_read_only_not_a_failing_disk(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("p")
    url = f"sqlite:///{path}?busy_timeout=1"
    async with stopline.open(url) as ledger, ledger.run("job", owner="u", run_id="run_a") as run:
        await run.call(provider.tool, "1", key="1")
        with immutable(str(path), f"{path}-wal"):
            assert not os.access(path, os.W_OK)
            with pytest.raises(LedgerReadOnly, match=r"l\.db cannot be written") as info:
                await run.call(provider.tool, "2", key="2")
        assert "immutable" in str(info.value)
        assert not isinstance(info.value, LedgerIOError)
        await run.call(provider.tool, "3", key="3")  # the fault cleared: it goes on
    assert provider.requests == ["run_a/1", "run_a/3"]


@pytest.mark.parametrize(
    ("name", "problem"),
    [("a\x00b", "contains a NUL character"), ("x" * 2_000_000, "2000000 characters")],
    ids=["nul", "long"],
)
def test_a_tool_name_no_key_may_hold_is_refused_when_the_tool_is_made(
    name: str, problem: str
) -> None:
    async def send(x: str) -> str:
        return x

    with pytest.raises(InvalidInput, match=f"invalid tool: {problem}") as info:
        stopline.tool(name=name)(send)
    assert info.value.what == "tool"  # as the gate named it
