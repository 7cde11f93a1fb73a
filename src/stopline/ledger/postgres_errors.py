"""What can go wrong with a shared server, as the ledger's own errors.

psycopg's errors are mapped here, at the backend boundary, each naming the
ledger (the URL without its password). ``CommitInDoubt``, ``GateInDoubt``
and ``LeaseExpired`` live in ``stopline.errors`` with the rest of the tree
and are re-exported here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import anyio
import psycopg
import psycopg.errors
import psycopg_pool

from stopline.errors import (
    CommitInDoubt,
    GateInDoubt,
    LeaseExpired,
    LedgerCorrupt,
    LedgerError,
    LedgerLocked,
    LedgerRefused,
    LedgerUnavailable,
)
from stopline.ledger import redact, tables_gone

__all__ = [
    "ANSWER_FLOOR",
    "CommitInDoubt",
    "GateInDoubt",
    "LeaseExpired",
    "answered_within",
    "connection_lost",
    "cut_as_lost",
    "map_error",
    "redact",
    "transient",
]

# a statement's answer waited for at least this long whatever ``retry_for`` says: a
# short one (the tests', an impatient caller's) is about retrying, not about how long a
# busy server may take to answer a small statement (ADR 0061)
ANSWER_FLOOR = 5.0

# what the server refuses and would refuse again: a constraint (not a unique one, which
# two sessions writing one row at once also meet: a retry reads the row), a value it
# cannot store, one past its limits (class 54, which psycopg files as operational: an
# index row too big, a NUL in text), an operator's or a migration's trigger (P0001)
_REFUSED = (
    psycopg.errors.IntegrityError,
    psycopg.errors.DataError,
    psycopg.errors.ProgramLimitExceeded,
    psycopg.errors.RaiseException,
)

_UNAVAILABLE = (
    psycopg.OperationalError,
    OSError,
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.InvalidCatalogName,
)


def map_error(location: str, exc: BaseException, *, retried_for: float) -> BaseException:
    """A psycopg (or socket) error as the ledger's own; anything else unchanged."""
    if not isinstance(exc, psycopg.Error | OSError):
        return exc
    message = str(exc).strip() or type(exc).__name__
    err: LedgerError
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        err = LedgerLocked(location, f"{message} (retried for {retried_for}s)")
    elif isinstance(exc, psycopg.errors.LockNotAvailable):
        err = LedgerLocked(location, message)
    elif isinstance(exc, psycopg.errors.DataCorrupted | psycopg.errors.IndexCorrupted):
        err = LedgerCorrupt(location, message)
    elif isinstance(exc, psycopg.errors.UndefinedTable):
        err = tables_gone(location, exc.diag.message_primary or message)
    elif isinstance(exc, _REFUSED) and not isinstance(exc, psycopg.errors.UniqueViolation):
        err = LedgerRefused(location, message)
    elif isinstance(exc, _UNAVAILABLE):
        err = LedgerUnavailable(location, message)
    else:
        err = LedgerError(location, message)
    err.__cause__ = exc
    return err


def transient(exc: BaseException) -> bool:
    """Connection loss, failover, pool exhaustion, serialization failure: worth a retry
    (not a statement past the server's limits, which psycopg files as operational, nor
    a pool closed by the backend's close: it never opens again, and a retry waited out
    the whole retry window, 10 s, for nothing)."""
    return isinstance(
        exc,
        psycopg.OperationalError
        | psycopg.errors.SerializationFailure
        | psycopg.errors.DeadlockDetected
        | OSError,
    ) and not isinstance(exc, psycopg.errors.ProgramLimitExceeded | psycopg_pool.PoolClosed)


def connection_lost(exc: BaseException) -> bool:
    """No answer from the server (or it was shut down under us): a commit may have landed.

    A server's error reply means the statement failed and rolled back.
    """
    state = getattr(exc, "sqlstate", None)
    return state is None or state[:2] == "08" or (state[:2] == "57" and state != "57014")


@contextlib.contextmanager
def answered_within(seconds: float) -> Iterator[anyio.CancelScope]:
    """The block's statements answered within ``seconds``, or the connection dropped as lost.

    A server that stops answering without closing (frozen, its host paused, a network
    that drops packets while the socket stays open) held the caller for ever: a
    ledger's writes are shielded, so not even the caller's own timeout got it out,
    and every run of the process queued behind it (ADR 0061). At ``seconds`` the
    block is cancelled: psycopg sends the server a cancel and, interrupted again,
    closes the connection; the block raises ``OperationalError`` with no SQLSTATE,
    which is a connection lost (``connection_lost``): a commit on the wire is in doubt,
    and the attempt is retried on another connection as any loss is.
    """
    with anyio.CancelScope(deadline=anyio.current_time() + seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        raise psycopg.OperationalError(
            f"no answer from the server within {seconds:g} s: connection dropped"
        )


@contextlib.asynccontextmanager
async def cut_as_lost(
    conn: psycopg.AsyncConnection[object],
    answering: anyio.CancelScope,
    held: list[BaseException],
) -> AsyncIterator[None]:
    """A statement on ``conn``, in a shield, cut by asyncio's own ``Task.cancel`` (which
    reaches into a shield: a framework cancelling the task it runs a tool in) is a lost
    connection. psycopg asked the server to cancel it and waited for its end, so it
    landed or not, and which is unknown when it was a commit: the connection is closed
    here, before anyone else may take it (its session ends, so the doubt is settled as
    any lost connection's), ``OperationalError`` raised with no SQLSTATE
    (``connection_lost``), and the cancel kept in ``held``, asked for again once the
    write is done (``ask_again``). ``answering``'s own deadline is no such cancel."""
    try:
        yield
    except anyio.get_cancelled_exc_class() as cancel:
        if answering.cancel_called:
            raise
        held.append(cancel)
        with anyio.CancelScope(shield=True), contextlib.suppress(psycopg.Error, OSError):
            await conn.close()
        raise psycopg.OperationalError(
            "asyncio's own cancel cut the statement: connection dropped"
        ) from cancel
