"""Cancels committed by other processes on one SQLite file, noticed by polling.

SQLite has no notifications between processes. One dedicated read connection
per backend asks ``PRAGMA data_version`` every ``interval`` seconds: the
number changes when any other connection (another process, or this one's
writer) commits to the file, and reading it touches no table. Only then are
the ``cancel`` events appended since the last look read, by ``seq``, and the
run ids of those still fenced (a run resumed meanwhile is not: a late look
must not cancel it again) handed to the runtime, which asks the in-flight calls of those runs
in this process to stop (issue 20: a ``stopline cancel`` from a shell reaches
a worker's calls in flight, not only its next gate).

As with PostgreSQL's LISTEN, this only speeds up the interruption: the gate
reads the fence, so a poll that fails (the file briefly locked or unreadable)
never lets a dispatch through (R1). A failed poll is logged and retried with
backoff; the cancels committed meanwhile are read by ``seq`` on the next good
one. Delivering a run twice is harmless: the runtime skips runs it already
knows are cancelled.

A look reads the cancel events through an index of their own (schema V4), so it
costs what was cancelled since the last look, not what was logged.

Each look also checks that the ledger's files at their paths are still the ones this
process opened (``LedgerFiles``, ADR 0057), and the watch stops at an error no wait
can clear (the files deleted or replaced, the ledger corrupt): logged once, and
``ended`` raises it for the runtime's error boundary (``health.broken``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from stopline.errors import LedgerCorrupt
from stopline.ledger.engine.dialect import Dialect
from stopline.ledger.engine.guards import FENCED
from stopline.ledger.schema import CANCEL_EVENT
from stopline.ledger.sqlite_errors import file_gone, sqlite_error

__all__ = ["POLL_INTERVAL", "CancelWatch", "LedgerFiles"]

POLL_INTERVAL = 0.05  # seconds between two looks at data_version: the cross-process delay
log = logging.getLogger("stopline.ledger.sqlite")
_FENCED = frozenset(state.value for state in FENCED)
# the kind spelled as the partial index ``events_cancels`` is (schema V4), so that the
# planner reads that index: the cancels alone, not every event since the last look
_CANCELS_SINCE = (
    "SELECT e.seq, e.run_id, r.state FROM events e INDEXED BY events_cancels"
    f" JOIN runs r ON r.id = e.run_id WHERE e.seq > ? AND e.kind = '{CANCEL_EVENT}'"
    " ORDER BY e.seq"
)


class CancelWatch:
    """The polling read connection of one SQLite backend."""

    def __init__(
        self,
        path: Path,
        busy_timeout: float,
        interval: float = POLL_INTERVAL,
        *,
        files: LedgerFiles | None = None,
    ) -> None:
        self._path = path
        self._busy_timeout = busy_timeout
        self.interval = interval
        # the files this process opened, checked at each look (None: not checked)
        self._files = files
        self._conn: sqlite3.Connection | None = None
        self._version = -1
        self._seq = 0
        self._limiter = anyio.CapacityLimiter(1)  # one thread at a time owns the connection
        self.polls = 0  # looks at data_version, for tests and stats
        # why it stopped for good (the files gone, the ledger corrupt), else None
        self.stopped: LedgerCorrupt | None = None
        self._ended = anyio.Event()

    async def run(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await self.on_thread(self.baseline)  # the first look: errors here are the caller's
            task_status.started()
            delay = self.interval
            while True:
                await anyio.sleep(delay)
                try:
                    run_ids = await self.on_thread(self.poll)
                except LedgerCorrupt as exc:  # the files gone: nothing to watch any more
                    self._stop(exc)
                    return
                except (sqlite3.Error, OSError) as exc:
                    if isinstance(exc, sqlite3.Error):
                        mapped = sqlite_error(f"sqlite:///{self._path}", exc)
                        if isinstance(mapped, LedgerCorrupt):  # no wait clears it
                            mapped.__cause__ = exc
                            self._stop(mapped)
                            return
                    log.warning("cancel watch on %s: %s; retrying", self._path, exc)
                    delay = min(delay * 2, 1.0)
                    await self.on_thread(self.drop)
                    continue
                delay = self.interval
                if run_ids:
                    on_cancel(run_ids)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_thread(self.drop)

    def _stop(self, why: LedgerCorrupt) -> None:
        """Stop for good at an error no wait can clear: logged once, not retried."""
        self.stopped = why
        log.error("cancel watch on %s: stopped (%s)", self._path, why)
        self._ended.set()

    async def ended(self) -> None:
        """Until the watch stops for good, then raise why (``Backend.cancel_watch_ended``)."""
        await self._ended.wait()
        assert self.stopped is not None
        raise LedgerCorrupt(self.stopped.location, self.stopped.cause) from self.stopped

    @property
    def connection(self) -> sqlite3.Connection | None:
        """The watch's read connection, if open."""
        return self._conn

    async def on_thread(self, fn: Callable[[], object]) -> list[str]:
        """Run ``fn`` on the one thread slot that owns the connection (a look's
        run ids, else ``[]``); ``baseline``, ``poll`` and ``drop`` are its steps."""
        result = await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        return result if isinstance(result, list) else []

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            # mode=rw: a ledger file gone is an error here, never a new empty file
            self._conn = sqlite3.connect(
                f"file:{urllib.parse.quote(str(self._path.absolute()))}?mode=rw",
                isolation_level=None,
                check_same_thread=False,
                timeout=self._busy_timeout,
                uri=True,
            )
            self._version = -1  # data_version is per connection: a new one starts afresh
        return self._conn

    def baseline(self) -> None:
        """Start from now: cancels committed before the first look are not delivered."""
        conn = self._connection()
        self._version = conn.execute("PRAGMA data_version").fetchone()[0]
        self._seq = conn.execute(Dialect.change_mark).fetchone()[0]  # the log's last seq

    def poll(self) -> list[str]:
        """One look: the runs cancelled by commits since the last look, still fenced."""
        conn = self._connection()
        if self._files is not None:  # with a connection open: none of them goes by itself
            self._files.confirm()
        self.polls += 1
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._version:
            return []
        self._version = version
        rows = conn.execute(_CANCELS_SINCE, (self._seq,)).fetchall()
        if rows:
            self._seq = rows[-1][0]
        # a run resumed since its cancel is not fenced any more: its cancel is stale
        return list(dict.fromkeys(str(run_id) for _, run_id, state in rows if state in _FENCED))

    def drop(self) -> None:
        """Close the connection; the next look opens another."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()


_Identity = tuple[int, int] | None  # (device, inode); None: no file at the path


class LedgerFiles:
    """The ledger's files as this process opened them: the database, its ``-wal`` and
    its ``-shm``, by (device, inode), taken once the writer's connection has them open.

    SQLite does not notice a file deleted or replaced at its path (``rm``, a backup
    moved over it): it goes on with the file it opened, which no other process can
    open, so everything written from then on is lost when the process exits, and a
    cancel from another process cannot reach it (a new ``-wal`` or ``-shm`` there splits
    this process's view of the ledger from every other's). While a connection of this
    process is open SQLite removes none of them by itself, so ``confirm``, made with one
    open, takes any difference as that fault and, from then on, refuses every
    transaction with ``LedgerCorrupt`` naming it (ADR 0057)."""

    def __init__(self, path: Path, location: str) -> None:
        self._path = path
        self._location = location
        self._opened: dict[str, _Identity] = {}
        self._gone: tuple[str, str] | None = None  # the first (path, "deleted"...) found

    def remember(self) -> None:
        """Take the identities of the files (the writer's connection has them open)."""
        names = [f"{self._path}{end}" for end in ("", "-wal", "-shm")]
        self._opened = {name: _identity(name) for name in names}

    def confirm(self) -> None:
        """Raise ``LedgerCorrupt`` if a file differs from the one opened (or did once)."""
        if self._gone is None and self._opened:
            for path, opened in self._opened.items():
                try:
                    found = _identity(path)
                except OSError:  # cannot tell (a directory not searchable): its own error
                    continue
                if opened is not None and found != opened and self._gone is None:
                    self._gone = (path, "deleted" if found is None else "replaced")
        if self._gone is not None:
            raise file_gone(self._location, *self._gone)


def _identity(path: str) -> _Identity:
    try:
        found = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return found.st_dev, found.st_ino
