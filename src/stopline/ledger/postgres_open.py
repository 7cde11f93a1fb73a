"""Opening a PostgreSQL ledger: its schema checked or migrated, then its pool, each bounded.

The open's own session (one connection, before the pool: the schema must exist
before pooled connections put it on their search path) connects within
``connect_timeout`` and runs the migration in one transaction. A migration can
rightly take long (an index built on a large ledger) and wait long (for a peer
process migrating the same ledger: an advisory lock), so its statements are not
dropped after ``answer_wait`` as a transaction's are (ADR 0061). Instead, each
``answer_wait`` without an answer, a new session asks the server whether the open's
session is at work (ADR 0064): running a statement, or waiting for a lock held by
a session that is at work too. If so, the open waits another round. If not (the
session idle: its statement never reached the server, or the answer was lost;
waiting for a session idle in its transaction; gone; or the server not answering
the new session either) the open's session is ended, its transaction rolled back
with it (nothing half-migrated), and the open fails with a typed error: nothing
waits for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import psycopg

from stopline.errors import LedgerError, LedgerLocked, LedgerUnavailable, StoplineError
from stopline.ledger.postgres_errors import answered_within
from stopline.ledger.postgres_schema import check, migrate
from stopline.ledger.postgres_txn import Tx

if TYPE_CHECKING:
    from stopline.ledger.postgres import PostgresBackend

__all__ = ["start"]

T = TypeVar("T")
log = logging.getLogger("stopline.ledger.postgres")

# The open's session: its state, whether it has been in it for ``answer_wait`` (a
# session between two statements is idle a moment, its next one on the way), and, if
# it waits for a lock, the first session it waits for that has not been at work for
# that long (none: every one is at work, a peer migrating). A session of another role
# shows no state: it counts as not at work (what it does cannot be told).
_AT_WORK = (
    "SELECT a.state, a.state_change < now() - make_interval(secs => %(wait)s), b.pid, b.state"
    " FROM pg_stat_activity a LEFT JOIN pg_stat_activity b"
    " ON b.pid = ANY (pg_blocking_pids(a.pid)) AND b.state IS DISTINCT FROM 'active'"
    " AND (b.state_change IS NULL OR b.state_change < now() - make_interval(secs => %(wait)s))"
    " WHERE a.pid = %(pid)s LIMIT 1"
)


async def start(backend: PostgresBackend) -> None:
    """The schema checked (read-only) or migrated, then the pool opened."""
    try:
        conn = await _session(backend)
        try:
            tx = Tx(conn, backend.location)
            if backend.read_only:
                await _watched(backend, tx.pid, lambda: check(tx, backend.schema))
            else:
                backend.dialect.channel = await _watched(
                    backend, tx.pid, lambda: migrate(tx, backend.schema)
                )
        finally:  # shielded: a cancelled start must not leak the connection
            with anyio.move_on_after(5, shield=True):
                await conn.close()
        await backend.pool.open(wait=True, timeout=backend.connect_timeout)
    except StoplineError:
        raise
    except (psycopg.Error, OSError) as exc:
        raise backend.map_error(exc) from exc


async def _session(backend: PostgresBackend) -> psycopg.AsyncConnection[Any]:
    """A plain session (no schema on its search path: it may not exist yet)."""
    return await psycopg.AsyncConnection.connect(
        backend.conninfo, autocommit=True, connect_timeout=backend.connect_timeout
    )


async def _watched(backend: PostgresBackend, pid: int, body: Callable[[], Awaitable[T]]) -> T:
    """``body``'s answer, on session ``pid``, while the server says the session is at work;
    its error as it raised it (not in a group)."""
    failed: list[LedgerError] = []
    raised: Exception | None = None
    answered: list[T] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            waited = 0.0
            while True:
                await anyio.sleep(backend.answer_wait)
                waited += backend.answer_wait
                # shielded (and bounded): a body that fails as its session is ended
                # by the probe fails for the reason the probe gives
                with anyio.CancelScope(shield=True):
                    why = await _not_at_work(backend, pid, waited)
                if why is not None:
                    failed.append(why)
                    tg.cancel_scope.cancel()  # the body's statement: its connection closed
                    return

        tg.start_soon(watch)
        try:
            answered.append(await body())
        except Exception as exc:
            raised = exc
        tg.cancel_scope.cancel()  # the watch
    if answered:  # answered, even as the watch gave up on it: what it did stands
        return answered[0]
    if failed:
        raise failed[0]
    if raised is not None:
        raise raised
    raise AssertionError("unreachable: the body answered, raised, or the watch failed it")


async def _not_at_work(backend: PostgresBackend, pid: int, waited: float) -> LedgerError | None:
    """None if the server says session ``pid`` is at work (or waits for one that is);
    else why not, the session ended."""
    where = backend.location
    lost = f"no answer from the server within {waited:g} s"
    try:
        conn = await _session(backend)
    except (psycopg.Error, OSError) as exc:
        return LedgerUnavailable(where, f"{lost}, nor a new session: {str(exc).strip()}")
    try:
        with answered_within(backend.answer_wait):
            params = {"pid": pid, "wait": backend.answer_wait}
            row: Any = await (await conn.execute(_AT_WORK, params)).fetchone()
            if row is None:
                return LedgerUnavailable(where, f"{lost}: its session {pid} is gone")
            if row[2] is None and (row[0] == "active" or not row[1]):
                log.info("opening %s: session %d at work after %g s; waiting", where, pid, waited)
                return None
            # not at work: ended, so nothing it was sent commits after the open failed
            await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    except (psycopg.Error, OSError) as exc:
        return LedgerUnavailable(where, f"{lost}, nor on a new session: {str(exc).strip()}")
    finally:
        with anyio.move_on_after(5, shield=True):
            await conn.close()
    if row[2] is not None:
        return LedgerLocked(
            where,
            f"opening waited {waited:g} s for session {row[2]} ({row[3] or 'of another role'}),"
            f" which holds what the open needs; session {pid} ended",
        )
    return LedgerUnavailable(where, f"{lost}: its session {pid} is {row[0]}; ended")
