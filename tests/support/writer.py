"""A SQLite ledger's writer thread held by a job, so that the jobs after it queue."""

from __future__ import annotations

import sqlite3
import threading

import anyio
import anyio.abc
import anyio.lowlevel

from stopline.ledger._writer import Writer


class HeldWriter:
    """``start`` holds ``writer``'s thread in a job until ``release`` is set; ``queued``
    waits until that many jobs wait behind it (a barrier, not a sleep)."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self, conn: sqlite3.Connection) -> None:
        self.entered.set()
        self.release.wait(30)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.writer.submit, self._hold)
        await anyio.to_thread.run_sync(self.entered.wait)

    async def queued(self, n: int) -> None:
        while self.writer._queue.qsize() < n:
            await anyio.lowlevel.checkpoint()
