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
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from stopline.ledger.engine.dialect import Dialect
from stopline.ledger.engine.guards import FENCED
from stopline.ledger.schema import CANCEL_EVENT

__all__ = ["POLL_INTERVAL", "CancelWatch"]

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

    def __init__(self, path: Path, busy_timeout: float, interval: float = POLL_INTERVAL) -> None:
        self._path = path
        self._busy_timeout = busy_timeout
        self.interval = interval
        self._conn: sqlite3.Connection | None = None
        self._version = -1
        self._seq = 0
        self._limiter = anyio.CapacityLimiter(1)  # one thread at a time owns the connection
        self.polls = 0  # looks at data_version, for tests and stats

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
                except (sqlite3.Error, OSError) as exc:
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
            self._conn = sqlite3.connect(
                self._path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self._busy_timeout,
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
