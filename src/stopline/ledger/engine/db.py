"""The seam under the engine: one connection inside one transaction, and its dialect.

The engine's transaction bodies are written once, as ``async def body(db)``,
in SQL that both engines speak, with ``?`` (positional) or ``:name``
(named) placeholders. A backend fills in two things:

- ``Db``: run a statement and read rows. On SQLite the methods never suspend
  (the body runs on the writer thread and ``run_sync`` drives it to its end
  in one step); on PostgreSQL they await the server. ``batch`` runs
  statements none of which needs another's result: one round trip on
  PostgreSQL (pipeline mode), where each statement is otherwise one.
- ``Dialect`` (in ``dialect``): the few spellings that differ.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from stopline.ledger.engine.dialect import Dialect

__all__ = ["Db", "Params", "run_sync"]

T = TypeVar("T")
Params = Sequence[Any] | dict[str, Any]


class Db(abc.ABC):
    """One connection, inside (or about to open) one transaction."""

    dialect: Dialect
    location: str

    @abc.abstractmethod
    async def one(self, sql: str, params: Params = ()) -> Any: ...

    @abc.abstractmethod
    async def all(self, sql: str, params: Params = ()) -> list[Any]: ...

    @abc.abstractmethod
    async def run(self, sql: str, params: Params = ()) -> int:
        """Execute; the number of rows changed."""

    @abc.abstractmethod
    async def many(self, sql: str, seq: Sequence[Params]) -> None: ...

    async def batch(
        self, statements: Sequence[tuple[str, Params]], *, commit: bool = False
    ) -> list[list[Any]]:
        """Run ``statements`` in order, none needing another's result; each one's rows
        (``[]`` for one that returns none). In one round trip where the engine can
        (PostgreSQL's pipeline mode); a statement sees what the earlier ones wrote.

        ``commit``: they are the last of the outermost transaction, and its ``COMMIT``
        goes with them (in the same round trip on PostgreSQL); the body reads their
        rows and writes nothing more. Where the transaction is the caller's (SQLite's
        writer), it commits when the body ends, as always."""
        return [await self.all(sql, params) for sql, params in statements]

    async def whole(self, statements: Sequence[tuple[str, Params]]) -> list[list[Any]]:
        """``statements`` as a whole transaction of their own, in one round trip where
        the engine can: each one's rows, as ``batch`` gives them. Only the last may
        write more than a notification: PostgreSQL sends them with no ``BEGIN`` or
        ``COMMIT`` (its pipeline's ``Sync`` commits them), so a client failing before
        the last is sent may leave the earlier ones committed, and its commit in
        doubt. Reads and locks first, then one write that lands whole."""
        async with self.transaction():
            return await self.batch(statements, commit=True)

    async def snapshot(self, statements: Sequence[tuple[str, Params]]) -> list[list[Any]]:
        """The rows of each of ``statements`` (reads), all from one snapshot: in a
        transaction of their own (``transaction(snapshot=True)``), or as part of the
        enclosing one. On PostgreSQL one round trip, its ``BEGIN`` and ``COMMIT`` with
        them."""
        async with self.transaction(snapshot=True):
            return await self.batch(statements)

    async def commit_one(self, sql: str, params: Params = ()) -> Any:
        """One statement that is the whole transaction (it commits by itself)."""
        return await self.one(sql, params)

    @contextlib.asynccontextmanager
    async def transaction(self, *, snapshot: bool = False) -> AsyncIterator[None]:
        """The body's statements as one transaction (a no-op inside one already).

        ``snapshot``: the body only reads, and all its statements read one snapshot,
        where each would otherwise see its own (PostgreSQL's READ COMMITTED). A
        transaction of SQLite's is one snapshot already."""
        yield


def run_sync(body: Coroutine[Any, Any, T]) -> T:
    """Run a transaction body whose ``Db`` never suspends (SQLite's), to its end."""
    try:
        body.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    body.close()
    raise RuntimeError("a SQLite transaction body suspended: it awaited something not its Db")
