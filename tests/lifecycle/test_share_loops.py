"""R6: two shares that together close a loop, made at the same moment, never both land.

Before, on PostgreSQL: ``share(a, with_owner=b)`` and ``share(b, with_owner=a)`` in two
sessions each locked both runs ``FOR SHARE`` (locks that let each other pass), each
looked for a loop in the links committed before it, found none, and both landed: each
run owned the other, and either one's cancel fenced the other. Now links that may close
a loop are made one at a time (ADR 0065): the second one's check sees the first, and is
``InvalidInput`` naming the loop. On SQLite the one writer already makes them one at a
time: a second link cannot even begin while the first is open.

Each session is held open with its link made and not committed; the other link is
attempted meanwhile. Whether the other session waits is read from the server
(``pg_blocking_pids``): the only witness of a lock wait there is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import stopline
from stopline.errors import InvalidInput, LedgerLocked
from stopline.ledger.engine import owners, run_sync
from stopline.ledger.postgres_dialect import PostgresDialect
from stopline.ledger.postgres_txn import Tx
from stopline.ledger.sqlite import SQLiteDb

pytestmark = pytest.mark.timeout(30)

LOOP = r"with_owner.*is owned by run .* \(at some depth\): it cannot own it"


async def _runs(ledger: stopline.Ledger, *run_ids: str) -> None:
    """Runs that have ended on their own: a link is made to a run in any state."""
    for run_id in run_ids:
        async with ledger.run("job", owner="alice", run_id=run_id):
            pass


@asynccontextmanager
async def _session(pg_url: str) -> AsyncIterator[Tx]:
    """A session of its own in the test's schema, as another worker's would be."""
    base, _, schema = pg_url.partition("?schema=")
    conn = await psycopg.AsyncConnection.connect(
        base, autocommit=True, options=f"-c search_path={schema}"
    )
    try:
        yield Tx(conn, "test", PostgresDialect(None))
    finally:
        await conn.close()


def _live_links(rows: list[Any]) -> set[tuple[str, str]]:
    return {(run_id, owner) for run_id, owner in rows}


LIVE = "SELECT run_id, owner_run FROM run_owners WHERE released_at IS NULL"


async def _race_on_postgres(
    pg_url: str, first: tuple[str, str], second: tuple[str, str]
) -> tuple[BaseException | None, set[tuple[str, str]]]:
    """``first`` (child, owner) made in a session held open; ``second`` attempted in
    another meanwhile; once it has landed or waits, the first commits. The second's
    error, if any, and the live links after."""
    outcome: list[BaseException | None] = []
    done = anyio.Event()

    async def link(tx: Tx, child: str, owner: str) -> None:
        try:
            await owners.add_owner(tx, child, owner, False, "alice")
            outcome.append(None)
        except Exception as exc:  # the second link's answer, asserted by the caller
            outcome.append(exc)
        finally:
            done.set()

    async with (
        _session(pg_url) as held,
        _session(pg_url) as other,
        _session(pg_url) as watcher,
        anyio.create_task_group() as tg,
    ):
        async with held.transaction():
            await owners.add_owner(held, *first, False, "alice")  # made, not committed
            tg.start_soon(link, other, *second)
            blocked = "SELECT count(*) FROM pg_stat_activity WHERE ? = ANY(pg_blocking_pids(pid))"
            while not done.is_set():  # until it has landed, or waits on the held session
                if (await watcher.one(blocked, (held.pid,)))[0]:
                    break
        await done.wait()
        links = _live_links(await watcher.all(LIVE))
    return outcome[0], links


async def test_two_shares_closing_a_loop_at_once_one_is_refused_on_postgres(
    pg_url: str,
) -> None:
    async with stopline.open(pg_url) as ledger:
        await _runs(ledger, "a", "b")
    error, links = await _race_on_postgres(pg_url, ("a", "b"), ("b", "a"))
    assert isinstance(error, InvalidInput)
    assert error.what == "with_owner"
    assert "run 'a' is owned by run 'b'" in str(error)
    assert links == {("a", "b")}  # the first link alone: no loop


async def test_a_loop_closed_by_two_links_far_apart_at_once_is_refused_on_postgres(
    pg_url: str,
) -> None:
    """a -> b (b owned by c) and c -> d (d owned by a): the two links touch four
    different runs, and together close a -> b -> c -> d -> a."""
    async with stopline.open(pg_url) as ledger:
        await _runs(ledger, "a", "b", "c", "d")
        await ledger.share("b", with_owner="c", by="alice")
        await ledger.share("d", with_owner="a", by="alice")
    error, links = await _race_on_postgres(pg_url, ("a", "b"), ("c", "d"))
    assert isinstance(error, InvalidInput)
    assert "run 'd' is owned by run 'c'" in str(error)
    assert links == {("b", "c"), ("d", "a"), ("a", "b")}


async def test_two_shares_that_close_no_loop_both_land_on_postgres(pg_url: str) -> None:
    """Made one at a time, not refused: a -> b and c -> b at once both land."""
    async with stopline.open(pg_url) as ledger:
        await _runs(ledger, "a", "b", "c")
    error, links = await _race_on_postgres(pg_url, ("a", "b"), ("c", "b"))
    assert error is None
    assert links == {("a", "b"), ("c", "b")}


@contextmanager
def _link_held_open(path: Path, child: str, owner: str) -> Iterator[Callable[[], object]]:
    """Another process's share of ``child`` with ``owner``: made on SQLite's writer lock
    (``BEGIN IMMEDIATE``), not committed until the returned function is called."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        run_sync(owners.add_owner(SQLiteDb(conn, "held"), child, owner, False, "alice"))
        yield lambda: conn.execute("COMMIT")
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_on_sqlite_a_second_share_cannot_begin_while_the_first_is_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    async with stopline.open(f"sqlite:///{path}?busy_timeout=0.05") as ledger:
        await _runs(ledger, "a", "b")
        with _link_held_open(path, "a", "b") as commit:
            with pytest.raises(LedgerLocked):  # it waits for the writer, and gives up
                await ledger.share("b", with_owner="a", by="alice")
            commit()
        with pytest.raises(InvalidInput, match=LOOP):  # then it sees the first
            await ledger.share("b", with_owner="a", by="alice")
        backend = ledger.backend
        assert [e.kind for e in await backend.events("a")][-1] == "owner_added"
        assert "owner_added" not in [e.kind for e in await backend.events("b")]
