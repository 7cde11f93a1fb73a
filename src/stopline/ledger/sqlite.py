"""The embedded SQLite ledger: WAL, ``synchronous=FULL``, one writer thread.

Every public method is one of the engine's transaction bodies, run on the
writer thread (``SQLiteDb`` never suspends, so ``run_sync`` drives a body to
its end in the one hop). Two
processes on one file are safe: each transaction starts with
``BEGIN IMMEDIATE`` under a busy timeout, so writers queue instead of racing.
Storage errors are mapped to the ledger's own errors here, at the boundary,
each naming the file and the cause.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc

from stopline.domain.model import OperationRecord
from stopline.errors import (
    LedgerError,
    LedgerIOError,
    LedgerReadOnly,
    LedgerUnavailable,
    SchemaTooNew,
    StoplineError,
)
from stopline.ledger import MAX_WAIT_S
from stopline.ledger._writer import Writer
from stopline.ledger.backend import OutcomeUpdate
from stopline.ledger.engine import Db, Dialect, SqlBackend, run_sync
from stopline.ledger.engine.db import Params
from stopline.ledger.engine.record import record
from stopline.ledger.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    PostgresOnly,
    check_readable,
    refuse_foreign,
)
from stopline.ledger.sqlite_errors import OS_ERRORS, sqlite_error, unwritable
from stopline.ledger.sqlite_watch import POLL_INTERVAL, CancelWatch, LedgerFiles

__all__ = ["SQLiteBackend", "SQLiteDb"]

T = TypeVar("T")

# Each connection's page cache, in MiB (ADR 0045). SQLite's default, 2 MiB, is less
# than a big tree's fence dirties (a 10,000-run tree: 1,222 pages of 4 KiB, ~4.8 MiB):
# past it the transaction spills pages to the log before its commit and reads them
# back. 16 MiB holds a tree of ~30,000 runs; pages are taken as they are used.
CACHE_MIB = 16
MAX_CACHE_MIB = 65_536


class SQLiteBackend(SqlBackend):
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        busy_timeout: float = 10.0,
        group_commit: float = 0.002,
        cancel_poll: float = POLL_INTERVAL,
        read_only: bool = False,
        cache_mib: int = CACHE_MIB,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise LedgerUnavailable(
                f"sqlite:///{path}",
                f"synchronous={synchronous!r} is not FULL, EXTRA or NORMAL (OFF may lose commits)",
            )
        if not 0 <= busy_timeout <= MAX_WAIT_S:  # NaN too
            raise LedgerUnavailable(
                f"sqlite:///{path}", f"busy_timeout={busy_timeout!r} is not 0-{MAX_WAIT_S} seconds"
            )
        if (
            isinstance(cache_mib, bool)
            or not isinstance(cache_mib, int)
            or not (1 <= cache_mib <= MAX_CACHE_MIB)
        ):
            raise LedgerUnavailable(
                f"sqlite:///{path}", f"cache_mib={cache_mib!r} is not 1-{MAX_CACHE_MIB} MiB"
            )
        self.path = Path(path)
        self.location = f"sqlite:///{self.path}"
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        # the page cache of each connection, in KiB (SQLite takes a negative size as KiB)
        self._cache_kib = cache_mib * 1024
        # read-only: opened with mode=ro, nothing switched or migrated, deferred
        # transactions; a file that is not a ledger is refused untouched
        self.read_only = read_only
        begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"
        # an outcome nobody waits for waits up to ``group_commit`` s for the next write
        self._writer = Writer(
            self._connect,
            self._map_error,
            self.location,
            busy_timeout,
            begin=begin,
            linger=group_commit,
        )
        # the files this process writes to: one deleted or replaced under it fails every
        # later transaction closed (ADR 0057); a reader writes nothing and checks nothing
        self.files = None if read_only else LedgerFiles(self.path, self.location)
        # cancels committed by other processes on this file, noticed by polling every
        # ``cancel_poll`` s; 0: not watched, they reach this process at its next gate
        self.watch = (
            CancelWatch(self.path, busy_timeout, cancel_poll, files=self.files)
            if cancel_poll
            else None
        )

    @classmethod
    async def open(cls, path: str | os.PathLike[str], **options: Any) -> SQLiteBackend:
        backend = cls(path, **options)
        await anyio.to_thread.run_sync(backend._writer.start)
        return backend

    # -- connection and errors ---------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if not self.path.parent.exists():
            raise LedgerUnavailable(self.location, f"directory {self.path.parent} does not exist")
        if self.read_only and not self.path.is_file():
            raise LedgerUnavailable(self.location, "no ledger file there")
        if self.files is not None:  # a new connection (a failed rollback's): never a new file
            self.files.confirm()
        target = f"file:{urllib.parse.quote(str(self.path.absolute()))}?mode=ro"
        try:
            conn = sqlite3.connect(
                target if self.read_only else self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self._busy_timeout,
                uri=self.read_only,
            )
        except sqlite3.Error as exc:
            raise self._map_error(exc) from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            conn.execute(f"PRAGMA cache_size = -{self._cache_kib}")
            version, tables = _identity(conn)  # a read: refuse a foreign file before any write
            if self.read_only:
                check_readable(self.location, version, tables)
                return conn
            refuse_foreign(self.location, version, tables)
            self._when_unlocked(lambda: self._set_wal(conn))
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
            self._when_unlocked(lambda: self._migrate(conn))
            if self.files is not None:  # the files this connection opened, -wal and -shm too
                self.files.remember()
        except BaseException as exc:
            conn.close()
            raise self._map_error(exc) from exc
        return conn

    def _when_unlocked(self, step: Callable[[], None]) -> None:
        """Retry a start-up step while another process holds the file, up to the busy timeout.

        Switching to WAL needs an exclusive lock and SQLite answers "locked" at
        once instead of waiting, so two processes creating one file need this.
        This runs on the writer thread, before any caller waits on it.
        """
        deadline = time.monotonic() + self._busy_timeout
        delay = 0.005
        while True:
            try:
                step()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise LedgerUnavailable(self.location, f"cannot use WAL journal (got {mode!r})")

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(self.location, version, SCHEMA_VERSION)
            refuse_foreign(self.location, *_identity(conn))
            for step in MIGRATIONS[version:]:
                if isinstance(step, PostgresOnly):
                    continue  # PostgreSQL's alone: the version is recorded below
                for statement in step.split(";"):
                    if statement.strip():
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a full disk rolls back by itself: keep its error
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def _map_error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, OSError) and exc.errno in OS_ERRORS:
            err: LedgerError = OS_ERRORS[exc.errno](self.location, str(exc))
        elif isinstance(exc, StoplineError) or not isinstance(exc, sqlite3.Error):
            return exc
        else:
            err = sqlite_error(self.location, exc)
            if type(err) is LedgerUnavailable and not os.access(self.path.parent, os.W_OK):
                # SQLite cannot create its journal beside the file: say why
                err = LedgerReadOnly(
                    self.location, f"{exc}: directory {self.path.parent} is read-only"
                )
            elif type(err) is LedgerIOError and (name := unwritable(str(self.path))):
                # a write refused to a file SQLite has open: not the disk failing
                err = LedgerReadOnly(
                    self.location,
                    f"{exc}: {name} cannot be written (read-only, or immutable: lsattr)",
                )
        err.__cause__ = exc
        return err

    async def close(self) -> None:
        await self._writer.close()

    async def watch_cancels(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        holding: Callable[[str], bool] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        del holding  # the watch reads each cancel with its run's state: no check after
        if self.read_only or self.watch is None:  # a reader runs no calls; or not watched
            task_status.started()
            return
        await self.watch.run(on_cancel, task_status=task_status)

    async def cancel_watch_ended(self) -> None:
        if self.read_only or self.watch is None:
            await anyio.sleep_forever()
        else:
            await self.watch.ended()

    def _checked(self, conn: sqlite3.Connection) -> SQLiteDb:
        """The body's view of the connection, once the files are still the ones opened."""
        self._check_files()
        return SQLiteDb(conn, self.location)

    def _check_files(self) -> None:
        if self.files is not None:
            self.files.confirm()  # three stats, ~5 us: before every transaction (ADR 0057)

    async def _execute(
        self,
        body: Callable[[Db], Coroutine[Any, Any, T]],
        *,
        safe: bool = False,
        outcome: tuple[str, OutcomeUpdate] | None = None,
        prompt: bool = False,
        committed: Callable[[T], None] | None = None,
    ) -> T:
        # an outcome, once asked for, is written even if its caller is cancelled meanwhile
        return await self._writer.submit(
            lambda conn: run_sync(body(self._checked(conn))),
            must_run=bool(outcome),
            prompt=prompt,
            first=committed,  # in the writer's wake of the loop, before the caller
        )

    async def transact(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` as one transaction on the writer thread, as the engine's are
        (for tools and the benchmarks' baselines; the contract's writes go through the engine)."""

        def checked(conn: sqlite3.Connection) -> T:
            self._check_files()
            return fn(conn)

        return await self._writer.submit(checked)

    defers_outcomes = True  # one writer thread, first in first out

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        self._writer.enqueue(
            lambda conn: run_sync(record(self._checked(conn), op_id, update)), then
        )


class SQLiteDb(Db):
    """The writer thread's connection, inside the writer's transaction: nothing suspends.

    One cursor for the body's statements (a cursor per statement cost ~4 us each on
    the gate's path); it dies with the body, before the commit, which resets its
    last statement."""

    __slots__ = ("conn", "cursor", "location")
    dialect = Dialect()

    def __init__(self, conn: sqlite3.Connection, location: str) -> None:
        self.conn = conn
        self.cursor = conn.cursor()
        self.location = location

    async def one(self, sql: str, params: Params = ()) -> Any:
        return self.cursor.execute(sql, params).fetchone()

    async def all(self, sql: str, params: Params = ()) -> list[Any]:
        return self.cursor.execute(sql, params).fetchall()

    async def run(self, sql: str, params: Params = ()) -> int:
        return self.cursor.execute(sql, params).rowcount

    async def many(self, sql: str, seq: Sequence[Params]) -> None:
        self.cursor.executemany(sql, seq)


def _identity(conn: sqlite3.Connection) -> tuple[int, int]:
    """The schema version recorded in the file and how many tables it has (a read).

    One statement, one snapshot: read apart, another process creating the same new
    file could commit its schema in between (version 0, tables found: "foreign")."""
    version, tables = conn.execute(
        "SELECT (SELECT user_version FROM pragma_user_version),"
        " (SELECT count(*) FROM sqlite_master WHERE type = 'table')"
    ).fetchone()
    return int(version), int(tables)
