"""The group commit's own connection: no pool checkout on the hot path.

The group commit runs one transaction at a time (its leader's), so it needs one
connection, not a pool. ``Reserved`` holds it: opened on first use with the
pool's options (autocommit, the schema's search path, read-only), and after
each use left as the pool would leave a connection it takes back: a
transaction left open is rolled back; a connection broken or closed (the
server ended it, the network dropped) is let go, and the next use connects
anew. A failure to connect is a ``psycopg.OperationalError``, as the pool's
checkout raises, so the caller's retries treat both alike.

Not for concurrent use: only the group commit's leader holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import anyio
import psycopg
import psycopg_pool
from psycopg.pq import TransactionStatus

__all__ = ["Lease", "Reserved"]

Connection = psycopg.AsyncConnection[Any]
Lease = Callable[[], AbstractAsyncContextManager[Connection]]  # ``pool.connection``'s shape


class Reserved(AbstractAsyncContextManager[Connection]):
    """One connection, leased to one user at a time (``async with reserved.lease()``)."""

    def __init__(self, connect: Callable[[], Awaitable[Connection]]) -> None:
        self.connect = connect  # opens a connection (the tests make it refuse)
        self._conn: Connection | None = None
        self._leased = False
        self._closed = False
        self.connections = 0  # how many times it connected

    @property
    def pid(self) -> int | None:
        """The server process of the connection held now (None: none held)."""
        return None if self._conn is None else self._conn.info.backend_pid

    def lease(self) -> Reserved:
        return self

    async def __aenter__(self) -> Connection:
        assert not self._leased, "the reserved connection has one user at a time"
        if self._closed:  # as the pool's checkout once closed: never retried
            raise psycopg_pool.PoolClosed("the ledger's reserved connection is closed")
        conn = self._conn
        if conn is None or conn.closed:
            self._conn = None
            conn = self._conn = await self.connect()
            self.connections += 1
        self._leased = True
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leased = False
        conn = self._conn
        if conn is None:
            return
        status = conn.pgconn.transaction_status  # libpq's: no round trip
        if status == TransactionStatus.IDLE:
            return  # the usual end: the body committed (or rolled back) and left
        if status == TransactionStatus.UNKNOWN:  # libpq's answer for a bad connection
            await self._drop(conn)
        else:
            try:  # a body that failed mid-transaction (the pool does the same)
                await conn.rollback()
            except (psycopg.Error, OSError):
                await self._drop(conn)

    async def _drop(self, conn: Connection) -> None:
        if self._conn is conn:
            self._conn = None
        with anyio.move_on_after(5, shield=True), contextlib.suppress(psycopg.Error, OSError):
            await conn.close()

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            await self._drop(self._conn)
