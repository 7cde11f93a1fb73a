"""What a gated call writes to SQLite's log, counted page by page (ADR 0035).

The one fsync a call pays grows with the pages its transaction writes; these
tests read the write-ahead log itself, so they count, not time.
"""

from __future__ import annotations

import sqlite3
import struct
from collections import Counter
from pathlib import Path

import stopline
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


def _last_commits(path: Path, commits: int) -> list[list[int]]:
    """The page numbers each of the last ``commits`` transactions wrote to the WAL."""
    wal = (path.parent / (path.name + "-wal")).read_bytes()
    (page_size,) = struct.unpack(">I", wal[8:12])
    salt = wal[16:24]
    done: list[list[int]] = []
    pages: list[int] = []
    for offset in range(32, len(wal) - 24, 24 + page_size):
        page, size_after = struct.unpack(">II", wal[offset : offset + 8])
        if wal[offset + 8 : offset + 16] != salt:
            break  # a frame of an earlier generation of the log
        pages.append(page)
        if size_after:  # the frame that commits its transaction
            done.append(pages)
            pages = []
    return done[-commits:]


async def test_a_sequential_call_writes_only_its_operation_and_its_log(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    provider = FakeProvider("send")
    async with (
        stopline.open(f"sqlite:///{path}") as ledger,
        ledger.run("r", owner="u", run_id="r1") as run,
    ):
        for i in range(40):
            await run.call(provider.tool, i)
        commits = _last_commits(path, 20)  # calls in a row: outcome + next intent each
    with sqlite3.connect(path) as conn:
        owner = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    assert len(commits) == 20
    written = Counter(owner.get(page, "a freed page") for pages in commits for page in pages)
    assert set(written) <= _CALL_PAGES, written
    # AUTOINCREMENT wrote sqlite_sequence in every transaction that logged an event
    assert "sqlite_sequence" not in written
