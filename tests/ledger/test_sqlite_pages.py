"""What a gated call writes to SQLite's log, counted page by page (ADR 0035).

The one fsync a call pays covers every page its transaction writes; these
tests read the write-ahead log itself, so they count, not time.
"""

from __future__ import annotations

from pathlib import Path

import stopline
from stopline.bench.wal import last_commits, pages_by_tree
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
