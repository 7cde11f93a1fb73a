"""Every statement of a workload reaches its rows through an index (SQLite plans).

A ledger grows for ever; a statement that walks a table, or an index wider than
what it asks for, costs what the ledger holds instead of what the call touches.
SQLite plans without statistics, so its choices are checked here: the calls,
cancel, settling and receipts of a small workload are traced and each statement
is explained.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import stopline
from stopline.ledger.sqlite import SQLiteBackend
from tests.support.workload import run_workload

_TABLES = ("runs", "operations", "events", "approvals", "run_owners", "checkpoints", "workers")


async def _workload(path: Path) -> list[str]:
    """The plan tests' workload (``tests/support/workload.py``), traced."""
    statements: list[str] = []

    async def trace(ledger: stopline.Ledger, on: bool) -> None:
        assert isinstance(ledger.backend, SQLiteBackend)
        callback = statements.append if on else None
        await ledger.backend.transact(lambda conn: conn.set_trace_callback(callback))

    await run_workload(
        f"sqlite:///{path}",
        traced=lambda ledger: trace(ledger, True),
        untraced=lambda ledger: trace(ledger, False),
    )
    return statements


async def test_no_statement_walks_a_table_or_a_wider_index(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    statements = await _workload(path)
    walks: list[tuple[str, str]] = []
    explained = 0
    with sqlite3.connect(path) as conn:
        for sql in statements:
            if not re.match(r"(?i)\s*(select|update|insert|delete|with)\b", sql):
                continue
            explained += 1
            for *_, step in conn.execute(f"EXPLAIN QUERY PLAN {sql}"):
                table = re.match(r"SCAN (\w+)", step)
                # the newest runs: the index of start times, walked only to the limit
                newest = step == "SCAN runs USING INDEX runs_created" and " LIMIT " in sql
                if table and table[1] in _TABLES and not newest:
                    walks.append((step, sql))
                # the state index serves listing runs by state, nothing else
                if "runs_state" in step and not re.search(r"WHERE state = '\w+'", sql):
                    walks.append((step, sql))
    assert explained > 50  # the workload was traced
    assert walks == []
