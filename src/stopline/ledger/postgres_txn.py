"""One pooled PostgreSQL connection as the engine's ``Db``; it knows when a commit is in doubt.

The engine writes ``?`` and ``:name`` placeholders; psycopg's ``%s`` and
``%(name)s`` are spelled here, once per statement text (cached). The
connection is in autocommit mode: a body is either one statement that
commits by itself (``write1``: the gate's fast path, ``record``) or an
explicit ``BEGIN ... COMMIT`` (``transaction``, re-entrant). The ``BEGIN``
travels with the transaction's first statement and the statements queued
with ``at_commit`` (the cancel's notifications) with its ``COMMIT``
(pipeline mode: one round trip each, not two or more). ``Tx`` marks the
moments a commit is on the wire, so the backend can tell a failure that
rolled back (safe to retry) from one whose commit is in doubt.

Isolation is READ COMMITTED with explicit row locks on ``runs`` (a body that
only reads and asks for one snapshot, ``transaction(snapshot=True)``, is
REPEATABLE READ, READ ONLY: a run and its operations read together agree): the gate
takes its run ``FOR SHARE`` inside its one statement and a cancel takes the
run ``FOR UPDATE`` before it writes its events, so in ``events.seq`` order
every ``gate_passed`` of a run precedes its cancel (R1) exactly as SQLite's
single writer gives it.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
from psycopg.pq import ExecStatus

from stopline.ledger.engine import Db
from stopline.ledger.engine.db import Params
from stopline.ledger.postgres_dialect import PostgresDialect

__all__ = ["Tx", "pg_sql"]

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
# a transaction that only reads, every statement of it from one snapshot (read-only:
# it never waits on, nor fails for, a writer)
_SNAPSHOT = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"


@functools.lru_cache(maxsize=512)
def pg_sql(sql: str) -> str:
    """The engine's placeholders in psycopg's spelling."""
    return _NAMED.sub(r"%(\1)s", sql.replace("%", "%%").replace("?", "%s"))


def _has_rows(cur: psycopg.AsyncCursor[Any]) -> bool:
    result = cur.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


class Tx(Db):
    """One connection for one transaction body; tracks whether a commit is in doubt."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        location: str,
        dialect: PostgresDialect | None = None,
    ) -> None:
        self.conn = conn
        self.location = location
        self.dialect = dialect or PostgresDialect(None)
        self.in_doubt = False  # a statement that commits (or COMMIT itself) is on the wire
        self.pid = conn.pgconn.backend_pid  # its server session (gone with a lost connection)
        self._depth = 0  # open ``transaction`` blocks
        self._begin: str | None = None  # a ``BEGIN`` to send with the next statement
        self._at_commit: list[tuple[str, Params]] = []  # to send with the ``COMMIT``
        self._committed = False  # a batch sent the ``COMMIT`` already

    def _take_begin(self) -> str | None:
        begin, self._begin = self._begin, None
        return begin

    async def _execute(self, sql: str, params: Params) -> psycopg.AsyncCursor[Any]:
        begin = self._take_begin()
        if begin is None:
            return await self.conn.execute(pg_sql(sql), params)
        async with self.conn.pipeline():  # BEGIN and the statement, one round trip
            await self.conn.execute(begin)
            cur = await self.conn.execute(pg_sql(sql), params)
        return cur

    async def at_commit(self, sql: str, params: Params = ()) -> None:
        """Run ``sql`` just before the transaction commits, in the ``COMMIT``'s round trip
        (a statement whose result nobody reads); at once outside a transaction."""
        if self._depth:
            self._at_commit.append((sql, params))
        else:
            await self.run(sql, params)

    async def one(self, sql: str, params: Params = ()) -> Any:
        return await (await self._execute(sql, params)).fetchone()

    async def all(self, sql: str, params: Params = ()) -> list[Any]:
        return await (await self._execute(sql, params)).fetchall()

    async def run(self, sql: str, params: Params = ()) -> int:
        return (await self._execute(sql, params)).rowcount

    async def batch(
        self, statements: Sequence[tuple[str, Params]], *, commit: bool = False
    ) -> list[list[Any]]:
        """The statements (with a pending ``BEGIN``) in one pipeline: one round trip.
        ``commit``: the statements queued for the commit and the ``COMMIT`` go in it too
        (the outermost transaction's last statements; its end sends nothing more)."""
        if commit:
            if self._depth != 1:
                raise RuntimeError("a batch that commits ends the outermost transaction")
            self.in_doubt = True
        async with self.conn.pipeline():
            begin = self._take_begin()
            if begin is not None:
                await self.conn.execute(begin)
            cursors = [await self.conn.execute(pg_sql(sql), p) for sql, p in statements]
            if commit:
                pending, self._at_commit = self._at_commit, []
                for sql, params in pending:
                    await self.conn.execute(pg_sql(sql), params)
                await self.conn.execute("COMMIT")
        if commit:
            self.in_doubt = False
            self._committed = True
        # rows or none by the result's status: ``description`` would build a Column
        # object per column of each result (16 us for a run's row, measured)
        return [await c.fetchall() if _has_rows(c) else [] for c in cursors]

    async def implicit(self, statements: Sequence[tuple[str, Params]]) -> list[list[Any]]:
        """The statements as one transaction of their own without ``BEGIN`` or ``COMMIT``:
        one pipeline, whose ``Sync`` commits them all (an error reply from the server
        rolls them all back). Outside a transaction only. A commit is on the wire from
        the first statement: should the client fail before the last is queued, the
        pipeline's ``Sync`` still commits what was sent, so such a failure (one with
        no error reply) leaves the commit in doubt, like a connection lost."""
        if self._depth:
            raise RuntimeError("an implicit transaction cannot be part of another")
        self.in_doubt = True
        async with self.conn.pipeline():
            cursors = [await self.conn.execute(pg_sql(sql), p) for sql, p in statements]
        self.in_doubt = False
        return [await c.fetchall() if _has_rows(c) else [] for c in cursors]

    async def whole(self, statements: Sequence[tuple[str, Params]]) -> list[list[Any]]:
        if self._depth:  # part of the enclosing transaction
            return await self.batch(statements)
        return await self.implicit(statements)

    async def snapshot(self, statements: Sequence[tuple[str, Params]]) -> list[list[Any]]:
        if self._depth:  # part of the enclosing transaction
            return await self.batch(statements)
        async with self.transaction(snapshot=True):  # its BEGIN and COMMIT in the batch
            return await self.batch(statements, commit=True)

    async def many(self, sql: str, seq: Sequence[Params]) -> None:
        if not seq:
            return
        begin = self._take_begin()
        if begin is not None:
            await self.conn.execute(begin)
        async with self.conn.cursor() as cur:
            await cur.executemany(pg_sql(sql), seq)

    async def commit_one(self, sql: str, params: Params = ()) -> Any:
        if self._depth:
            return await self.one(sql, params)
        return await self.write1(sql, params)

    async def write1(self, sql: str, params: Params = ()) -> Any:
        """One statement that commits by itself; its commit is in doubt while it runs."""
        self.in_doubt = True
        row = await self.one(sql, params)
        self.in_doubt = False
        return row

    @contextlib.asynccontextmanager
    async def transaction(self, *, snapshot: bool = False) -> AsyncIterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._begin = _SNAPSHOT if snapshot else "BEGIN"  # sent with the first statement
        self._depth = 1
        self._committed = False
        try:
            yield
        except BaseException:
            self._depth = 0
            self._at_commit.clear()
            if self._begin or self._committed:  # nothing sent, or committed: no rollback
                self._begin = None
                raise
            with contextlib.suppress(psycopg.Error):  # a broken connection rolled back already
                await self.conn.execute("ROLLBACK")
            raise
        self._depth = 0
        if self._committed:  # by the body's last batch
            return
        pending, self._at_commit = self._at_commit, []
        if self._begin and not pending:  # a body that ran no statement: no transaction
            self._begin = None
            return
        self.in_doubt = True
        if pending:
            async with self.conn.pipeline():
                begin = self._take_begin()
                if begin is not None:
                    await self.conn.execute(begin)
                for sql, params in pending:
                    await self.conn.execute(pg_sql(sql), params)
                await self.conn.execute("COMMIT")
        else:
            await self.conn.execute("COMMIT")
        self.in_doubt = False
