"""What can go wrong with a shared server, as the ledger's own errors.

psycopg's errors are mapped here, at the backend boundary, each naming the
ledger (the URL without its password). Three are PostgreSQL's own:
``CommitInDoubt`` and ``GateInDoubt`` (a lost reply to a commit that could
not be settled) and ``LeaseExpired`` (fencing at the gate). All are
``LedgerError``s.
"""

from __future__ import annotations

import psycopg
import psycopg.errors

from stopline.errors import LedgerCorrupt, LedgerError, LedgerLocked, LedgerUnavailable
from stopline.ledger import redact

__all__ = [
    "CommitInDoubt",
    "GateInDoubt",
    "LeaseExpired",
    "connection_lost",
    "map_error",
    "redact",
    "transient",
]

_UNAVAILABLE = (
    psycopg.OperationalError,
    OSError,
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.InvalidCatalogName,
)


class CommitInDoubt(LedgerError):
    """The connection was lost while a write's commit was on the wire, and it could not be
    settled: the write may or may not be in the ledger. Read before acting on it."""


class GateInDoubt(CommitInDoubt):
    """The gate's intent commit is in doubt and the ledger stayed unreachable.

    Nothing was dispatched (the caller never got ``PASSED``). The intent may be
    recorded as ``requested``: the backend remembers it and, on its next
    successful transaction, records it ``unknown`` (cause ``transport``), never
    ``not_committed``; reconciliation then reads it back (R2, R3).
    """

    def __init__(self, location: str, op_id: str) -> None:
        self.op_id = op_id
        super().__init__(location, f"the intent of operation {op_id!r} may be recorded: in doubt")


class LeaseExpired(LedgerError):
    """Fencing: this worker's lease expired, so it may not record a new intent.

    Raised by the gate, which recorded nothing; the worker renews its lease
    (its next heartbeat) before it dispatches again.
    """

    def __init__(self, worker: str, location: str = "postgresql") -> None:
        self.worker = worker
        super().__init__(location, f"worker {worker!r} holds no live lease: intent refused")


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
    elif isinstance(exc, _UNAVAILABLE):
        err = LedgerUnavailable(location, message)
    else:
        err = LedgerError(location, message)
    err.__cause__ = exc
    return err


def transient(exc: BaseException) -> bool:
    """Connection loss, failover, pool exhaustion, serialization failure: worth a retry."""
    return isinstance(
        exc,
        psycopg.OperationalError
        | psycopg.errors.SerializationFailure
        | psycopg.errors.DeadlockDetected
        | OSError,
    )


def connection_lost(exc: BaseException) -> bool:
    """No answer from the server (or it was shut down under us): a commit may have landed.

    A server's error reply means the statement failed and rolled back.
    """
    state = getattr(exc, "sqlstate", None)
    return state is None or state[:2] == "08" or (state[:2] == "57" and state != "57014")
