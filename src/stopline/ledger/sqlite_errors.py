"""SQLite's errors as the ledger's own: by result code, raised ``from`` the original."""

from __future__ import annotations

import errno
import os
import sqlite3

from stopline.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerFull,
    LedgerIOError,
    LedgerLocked,
    LedgerReadOnly,
    LedgerRefused,
    LedgerUnavailable,
)
from stopline.ledger import tables_gone

__all__ = ["OS_ERRORS", "file_gone", "sqlite_error", "unwritable"]

# SQLite's primary result codes (the low byte of an extended one) and what they mean here
_BY_CODE: dict[int, type[LedgerError]] = {
    5: LedgerLocked,  # SQLITE_BUSY
    6: LedgerLocked,  # SQLITE_LOCKED
    8: LedgerReadOnly,  # SQLITE_READONLY
    10: LedgerIOError,  # SQLITE_IOERR
    11: LedgerCorrupt,  # SQLITE_CORRUPT
    13: LedgerFull,  # SQLITE_FULL
    14: LedgerUnavailable,  # SQLITE_CANTOPEN
    18: LedgerRefused,  # SQLITE_TOOBIG
    19: LedgerRefused,  # SQLITE_CONSTRAINT (a trigger's RAISE(ABORT) too)
    20: LedgerRefused,  # SQLITE_MISMATCH
    26: LedgerCorrupt,  # SQLITE_NOTADB
}
OS_ERRORS: dict[int, type[LedgerError]] = {
    errno.ENOSPC: LedgerFull,
    errno.EFBIG: LedgerFull,
    errno.EDQUOT: LedgerFull,
    errno.EROFS: LedgerReadOnly,
    errno.EACCES: LedgerReadOnly,
    errno.EIO: LedgerIOError,
}


def sqlite_error(location: str, exc: sqlite3.Error) -> LedgerError:
    """The typed error for an SQLite error, by its result code (its message as a fallback)."""
    message = str(exc)
    if message.startswith("no such table"):
        return tables_gone(location, message)
    code = getattr(exc, "sqlite_errorcode", None)
    kind = _BY_CODE.get(code & 0xFF) if isinstance(code, int) else None
    if kind is None:
        if "locked" in message:
            kind = LedgerLocked
        elif "not a database" in message or "malformed" in message:
            kind = LedgerCorrupt
        elif "readonly" in message:
            kind = LedgerReadOnly
        elif "disk is full" in message:
            kind = LedgerFull
        elif "disk I/O" in message:
            kind = LedgerIOError
        elif "unable to open" in message:
            kind = LedgerUnavailable
        elif "constraint failed" in message or "too big" in message or "mismatch" in message:
            kind = LedgerRefused
        else:
            kind = LedgerError
    if kind is LedgerLocked:
        message = f"{message} (another process holds it)"
    return kind(location, message)


def file_gone(location: str, path: str, what: str) -> LedgerCorrupt:
    """A file of an open ledger was deleted or replaced under this process (ADR 0057).

    SQLite goes on with the file it opened, which no other process can open any more:
    what this process would write from then on is lost when it exits, and a cancel
    from another process never reaches it. Waiting brings nothing back, so it is
    ``LedgerCorrupt``, as a table gone is: the call that meets it gets this, and a
    background step stops at it (``health.broken``)."""
    if path.endswith(("-wal", "-shm")):
        return LedgerCorrupt(
            location,
            f"{path} was {what} under this process: its writes no longer reach the other"
            " processes on this ledger, nor theirs this one; nothing more is written."
            " Stop this worker before any other process opens the ledger (closing it"
            " writes its log into the file), then run PRAGMA integrity_check",
        )
    return LedgerCorrupt(
        location,
        f"the ledger file {path} was {what} under this process, whose writes would go to"
        " a file no other process can open: nothing more is written, and what that file"
        " holds is lost when this process exits. Stop this worker and restore the ledger"
        " from backup",
    )


def unwritable(path: str) -> str | None:
    """The first of the ledger's files (the database, its ``-wal``, its ``-shm``) that is
    there and cannot be written, else None. SQLite reports a write refused to a file it
    has open (``chattr +i``: EPERM) as a disk I/O error; this tells it from a failing
    disk, whose advice (check the disk, restore from backup) would mislead."""
    for name in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(name) and not os.access(name, os.W_OK):
            return name
    return None
