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
from collections.abc import Iterator
from typing import Any

import anyio
import psycopg
import pytest

import stopline
from stopline.ledger.postgres import PostgresBackend
from stopline.testing import FakeProvider
from tests.lifecycle.test_tree_cancel import cancel_a_tree
from tests.postgres.server import fresh_schema

_CHILDREN = 12
_TABLES = ("runs", "operations", "events", "approvals", "run_owners", "checkpoints", "workers")
_EXPLAINED = re.compile(r"(?is)\s*(select|update|insert|delete|with)\b")


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from fresh_schema()


def _traced(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each statement psycopg is asked to run, by its text, with its first parameters."""
    sent: dict[str, Any] = {}

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
    return sent


async def _workload(url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Calls, a tree cancel with calls in flight, its settling, receipts and a page."""
    provider = FakeProvider("send")
    in_call = anyio.Event()
    entered: list[str] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        entered.append(ctx.op_id)
        if len(entered) == _CHILDREN:
            in_call.set()
        await anyio.sleep_forever()

    async with stopline.open(url, tools=[hold]) as ledger:
        sent = _traced(monkeypatch)
        async with ledger.run("r", owner="u", run_id="r1") as run:
            for i in range(3):
                await run.call(provider.tool, i)
        tree = await cancel_a_tree(ledger, hold, in_call, children=_CHILDREN)
        await ledger.wait_settled(tree, timeout=30)
        await ledger.receipt("r1")
        await ledger.receipt(tree)
        await ledger.receipts([run.id for run in await ledger.reads.runs(limit=200)])
        await ledger.reads.events("r1")
        monkeypatch.undo()
    return sent


def _grow(conn: psycopg.Connection[Any]) -> None:
    now = time.time()
    conn.execute(
        "INSERT INTO runs (id, name, owner, tenant, state, fence, grants, policy,"
        " created_at, updated_at) SELECT 'run_' || i, 'j', 'u', 't', 'running', 0, 15,"
        " 'verify', %s, %s FROM generate_series(0, 29999) i",
        (now, now),
    )
    conn.execute(
        "INSERT INTO operations (id, run_id, tool, description, args_digest, status,"
        " cancellable, can_verify, can_compensate, evidence, created_at, updated_at)"
        " SELECT 'op_' || i, 'run_' || (i %% 30000), 't', 't', 'd', 'committed', 'never',"
        " 1, 0, '[]', %s, %s FROM generate_series(0, 599999) i",
        (now, now),
    )
    # each operation's row written again, as its outcome is, and not vacuumed yet: the
    # table's pages, which a planner without statistics counts its rows by, double
    conn.execute("UPDATE operations SET updated_at = updated_at + 1")
    conn.execute(
        "INSERT INTO events (at, run_id, op_id, kind, data) SELECT %s, 'run_' || (i %% 30000),"
        " 'op_' || i, 'gate_passed', '{}' FROM generate_series(0, 599999) i",
        (now,),
    )
    conn.execute(
        "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
        " SELECT 'run_' || i, 'run_' || (i / 100), 1, %s FROM generate_series(300, 29999) i",
        (now,),
    )
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
