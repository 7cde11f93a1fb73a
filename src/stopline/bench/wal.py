"""Pages a SQLite transaction writes, read from the write-ahead log itself (ADR 0035).

The fsync a gated call pays covers every page its transaction appended to the
WAL; counting them is load-independent, where timing them on a shared machine
is not. Read while the database is open: closing the last connection
checkpoints the log and removes it.
"""

from __future__ import annotations

import sqlite3
import struct
from collections import Counter
from pathlib import Path

__all__ = ["last_commits", "pages_by_tree"]

_HEADER, _FRAME_HEADER = 32, 24


def last_commits(path: Path, commits: int) -> list[list[int]]:
    """The page numbers each of the last ``commits`` transactions wrote to the WAL of
    the database at ``path`` (fewer if the log holds fewer since its last reset)."""
    wal = path.with_name(path.name + "-wal").read_bytes()
    (page_size,) = struct.unpack(">I", wal[8:12])
    salt = wal[16:24]
    done: list[list[int]] = []
    pages: list[int] = []
    for offset in range(_HEADER, len(wal) - _FRAME_HEADER + 1, _FRAME_HEADER + page_size):
        page, size_after = struct.unpack(">II", wal[offset : offset + 8])
        if wal[offset + 8 : offset + 16] != salt:
            break  # a frame left from an earlier generation of the log
        pages.append(page)
        if size_after:  # the frame that commits its transaction
            done.append(pages)
            pages = []
    return done[-commits:]


def pages_by_tree(path: Path, commits: list[list[int]]) -> Counter[str]:
    """How many of those pages belong to each table or index (``dbstat``)."""
    with sqlite3.connect(path) as conn:
        owner = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    return Counter(owner.get(page, "a freed page") for pages in commits for page in pages)
