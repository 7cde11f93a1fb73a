"""The PostgreSQL ledger's retrying transaction: one write's attempts until it commits,
its doubt settles, or ``retry_for`` passes (``PostgresBackend.attempts``).

A failure before any commit was sent rolled back and is retried; a connection lost with
a commit on the wire leaves it in doubt, settled by ``settle`` once the lost session is
gone (``postgres_settle``). asyncio's own ``Task.cancel``, which reaches into the
caller's shield, is a connection lost when it cuts a statement (``cut_as_lost``) and
nothing at all when none was on the wire; either way it is taken and kept in ``held``,
and the write goes on to its end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import psycopg
import psycopg.errors

from stopline.errors import CommitInDoubt, LedgerError, RowHeld
from stopline.ledger.engine import Db
from stopline.ledger.postgres_errors import (
    answered_within,
    connection_lost,
    cut_as_lost,
    transient,
)
from stopline.ledger.postgres_reserved import Lease
from stopline.ledger.postgres_settle import RETRY
from stopline.ledger.postgres_txn import Tx

if TYPE_CHECKING:
    from stopline.ledger.postgres import PostgresBackend

__all__ = ["retried"]

T = TypeVar("T")
_NOT_YET = "the session of a write in doubt is there still: it may land yet"


async def retried(
    backend: PostgresBackend,
    connection: Lease | None,
    body: Callable[[Tx], Awaitable[T]] | Callable[[Db], Awaitable[T]],
    safe: bool,
    settle: Callable[[Tx], Awaitable[Any]] | None,
    in_doubt: Callable[[], LedgerError] | None,
    doubt: bool,
    deadline: float | None,
    held: list[BaseException],
) -> T:
    lease = backend.pool.connection if connection is None else connection
    if deadline is None:
        deadline = time.monotonic() + backend.retry_for
    delay = 0.005
    while True:
        tx: Tx | None = None
        got: list[Any] = []  # the attempt's result, once it has one
        try:
            with answered_within(backend.answer_wait) as answering:
                async with lease() as conn:
                    tx = Tx(conn, backend.location, backend.dialect)
                    async with cut_as_lost(conn, answering, held):
                        if backend.doubts:
                            await backend.settle_gate_doubts(tx)
                        if doubt and settle is not None:
                            if backend.sessions and not await backend.sessions.gone(tx):
                                raise psycopg.OperationalError(_NOT_YET)
                            landed = await settle(tx)
                            if landed is not RETRY:
                                got.append(landed)
                        if not got:
                            doubt = False
                            got.append(await body(tx))
            return got[0]  # type: ignore[no-any-return]
        except anyio.get_cancelled_exc_class() as cancel:  # asyncio's own, no statement
            held.append(cancel)  # on the wire: before the first, or after (it stands)
            if got:
                return got[0]  # type: ignore[no-any-return]
            continue
        except (psycopg.Error, OSError) as exc:
            now_in_doubt = tx is not None and tx.in_doubt and connection_lost(exc)
            if now_in_doubt and not safe and settle is None:
                raise CommitInDoubt(backend.location, f"commit in doubt: {exc}") from exc
            if now_in_doubt and tx is not None:
                backend.sessions.lost(tx)
            doubt = doubt or now_in_doubt
            if connection is not None and isinstance(exc, psycopg.errors.LockNotAvailable):
                # the group's connection: the job is set aside
                raise RowHeld(backend.location, str(exc), doubt=doubt) from exc
            if not transient(exc) or time.monotonic() >= deadline:
                if doubt and (not safe or in_doubt is not None):
                    raise (in_doubt() if in_doubt else CommitInDoubt(
                        backend.location, f"commit in doubt: {exc}"
                    )) from exc  # fmt: skip
                raise backend.map_error(exc) from exc
        try:
            await anyio.sleep(delay)  # back off before the next attempt
        except anyio.get_cancelled_exc_class() as cancel:
            held.append(cancel)
        delay = min(delay * 2, 0.25)
    raise AssertionError("unreachable: the loop returns or raises")
