"""SQLite's errors as the ledger's own: by result code, raised ``from`` the original."""

from __future__ import annotations

import errno
import sqlite3

from stopline.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerFull,
    LedgerIOError,
    LedgerLocked,
    LedgerReadOnly,
    LedgerUnavailable,
)
from stopline.ledger import tables_gone

__all__ = ["OS_ERRORS", "sqlite_error"]

# SQLite's primary result codes (the low byte of an extended one) and what they mean here
_BY_CODE: dict[int, type[LedgerError]] = {
    5: LedgerLocked,  # SQLITE_BUSY
    6: LedgerLocked,  # SQLITE_LOCKED
    8: LedgerReadOnly,  # SQLITE_READONLY
    10: LedgerIOError,  # SQLITE_IOERR
    11: LedgerCorrupt,  # SQLITE_CORRUPT
    13: LedgerFull,  # SQLITE_FULL
    14: LedgerUnavailable,  # SQLITE_CANTOPEN
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
        else:
            kind = LedgerError
    if kind is LedgerLocked:
        message = f"{message} (another process holds it)"
    return kind(location, message)
