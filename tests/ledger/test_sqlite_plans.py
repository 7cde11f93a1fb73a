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

import anyio

import stopline
from stopline.ledger.sqlite import SQLiteBackend
from stopline.testing import FakeProvider
from tests.lifecycle.test_tree_cancel import cancel_a_tree

_CHILDREN = 12  # enough ids that, unguided, SQLite prefers the state index to them
_TABLES = ("runs", "operations", "events", "approvals", "run_owners", "checkpoints", "workers")


async def _workload(path: Path) -> list[str]:
    """Calls, a tree cancel with calls in flight, its settling and two receipts."""
    statements: list[str] = []
    provider = FakeProvider("send")
    in_call = anyio.Event()
    entered: list[str] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        entered.append(ctx.op_id)
        if len(entered) == _CHILDREN:
            in_call.set()
        await anyio.sleep_forever()

    async with stopline.open(f"sqlite:///{path}", tools=[hold]) as ledger:
        assert isinstance(ledger.backend, SQLiteBackend)
        await ledger.backend.transact(lambda conn: conn.set_trace_callback(statements.append))
        async with ledger.run("r", owner="u", run_id="r1") as run:
            for i in range(3):
                await run.call(provider.tool, i)

        tree = await cancel_a_tree(ledger, hold, in_call, children=_CHILDREN)
        await ledger.wait_settled(tree, timeout=30)
        await ledger.receipt("r1")
        await ledger.receipt(tree)
        # a page of runs: every run newest first, then their receipts at once
        page = await ledger.reads.runs(limit=200)
        await ledger.receipts([run.id for run in page])
        await ledger.backend.transact(lambda conn: conn.set_trace_callback(None))
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
