"""Every statement of a workload reaches its rows through an index (PostgreSQL plans).

The statements the PostgreSQL backend sends for calls, a tree's cancel with
calls in flight, its settling, receipts and a page of runs are traced at the
driver, then each is explained, with the parameters it was sent with, on the
same ledger grown to 30,000 runs, 200,000 operations and events, 30,000
exclusive ownerships and 100,000 approvals, never analyzed (a new ledger, or a
server with autovacuum off, as this machine's). A statement that scans a table,
takes the state index, or hashes a table it should look up row by row costs
what the ledger holds instead of what the call touches. (The hand-picked forms
of ``test_plans.py`` say why each index; this finds a statement nobody picked.)
"""

from __future__ import annotations

import re
import time
from typing import Any

import psycopg
import pytest

import stopline
from stopline.ledger.postgres import PostgresBackend
from tests.postgres.test_plans import grow, own_by_hundreds
from tests.support.workload import run_workload

_CHILDREN = 12
# the tables that grow with the history (``workers`` holds the live processes, and the
# dead ones until their operations are resolved: a few rows, read whole rightly)
_TABLES = ("runs", "operations", "events", "approvals", "run_owners", "checkpoints")
_EXPLAINED = re.compile(r"(?is)\s*(select|update|insert|delete|with)\b")


def _trace(sent: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Into ``sent``: each statement psycopg is asked to run from now on, by its text,
    with its first parameters."""

    def trace(cls: type[Any], name: str) -> None:
        real = getattr(cls, name)

        def traced(self: Any, query: Any, params: Any = None, *args: Any, **kw: Any) -> Any:
            if name == "executemany":
                params = list(params)  # an iterator is read once: here, then passed on
            if isinstance(query, str):
                sent.setdefault(query, params[0] if name == "executemany" else params)
            return real(self, query, params, *args, **kw)

        monkeypatch.setattr(cls, name, traced)

    trace(psycopg.AsyncConnection, "execute")
    trace(psycopg.AsyncCursor, "execute")
    trace(psycopg.AsyncCursor, "executemany")


async def _workload(url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The plan tests' workload (``tests/support/workload.py``), traced."""
    sent: dict[str, Any] = {}

    async def trace(ledger: stopline.Ledger) -> None:
        _trace(sent, monkeypatch)

    async def untrace(ledger: stopline.Ledger) -> None:
        monkeypatch.undo()

    await run_workload(url, traced=trace, untraced=untrace)
    return sent


def _grow(conn: psycopg.Connection[Any]) -> None:
    now = time.time()
    grow(conn, 30_000, 600_000, status="committed")
    # each operation's row written again, as its outcome is, and not vacuumed yet: the
    # table's pages, which a planner without statistics counts its rows by, double
    conn.execute("UPDATE operations SET updated_at = updated_at + 1")
    conn.execute(
        "INSERT INTO events (at, run_id, op_id, kind, data) SELECT %s, 'run_' || (i %% 30000),"
        " 'op_' || i, 'gate_passed', '{}' FROM generate_series(0, 599999) i",
        (now,),
    )
    own_by_hundreds(conn, 30_000)
    conn.execute(
        "INSERT INTO approvals (id, run_id, scope, approver, status, requested_by,"
        " created_at) SELECT 'ap_' || i, 'run_' || (i %% 30000), 's', 'a', 'denied', 'u', %s"
        " FROM generate_series(0, 99999) i",
        (now,),
    )


_INDEX_STEP = re.compile(r"(Index Scan|Index Only Scan|Bitmap Index Scan)( Backward)? (using|on) ")


def _walks(sql: str, plan: list[str]) -> list[str]:
    """The steps that read a ledger table whole, take the state index (but for runs
    listed by state), start parallel workers or JIT, or walk an index
    with no condition (all of it: every live ownership a tree's join hashed), unless
    the statement stops at a limit (the newest runs, the change mark's window)."""
    tables = "|".join(_TABLES)
    by_state = re.search(r"WHERE state = %s", sql)  # the state index serves those alone
    found = [
        s
        for s in plan
        if re.search(rf"Seq Scan on ({tables})\b", s)
        or ("runs_state" in s and not by_state)
        or re.match(r"\s*(->  )?Gather|JIT:", s)  # a misestimate's workers or compiling
    ]
    for at, step in enumerate(plan):
        if not _INDEX_STEP.search(step) or " LIMIT " in sql:
            continue
        depth = len(step) - len(step.lstrip())
        details = []
        for below in plan[at + 1 :]:
            if "->" in below or len(below) - len(below.lstrip()) <= depth:
                break
            details.append(below)
        if not any("Index Cond" in detail for detail in details):
            found.append(step)
    return found


async def test_no_statement_of_a_workload_walks_a_grown_ledger(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = await _workload(pg_url, monkeypatch)
    base, _, schema = pg_url.partition("?schema=")
    walks: dict[str, list[str]] = {}
    explained = 0
    sessions = PostgresBackend(base, location="plans", schema=schema)  # as the ledger's are
    with psycopg.connect(sessions.conninfo, **sessions.connect_kwargs) as conn:
        _grow(conn)
        for sql, params in sent.items():
            if not _EXPLAINED.match(sql):
                continue
            explained += 1
            plan = [str(line) for (line,) in conn.execute(f"EXPLAIN {sql}", params)]
            if found := _walks(sql, plan):
                walks[sql] = found
    assert explained > 30  # the workload was traced
    assert walks == {}
