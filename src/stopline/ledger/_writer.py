"""One writer thread per SQLite ledger, with group commit.

Async callers submit a transaction function ``fn(conn) -> T``; the thread
takes every job waiting, runs them in one ``BEGIN IMMEDIATE`` transaction
(each in its own savepoint when there is more than one, so one job's error
rolls back that job alone), commits once (one fsync for the batch), and
only then wakes the callers: a caller never sees a result that is not yet
durable. One thread hop per transaction, as STYLE.md asks, and under
concurrency one fsync for many intents.

Waking works on asyncio (``call_soon_threadsafe``) and trio (the trio token).
"""

from __future__ import annotations

import functools
import queue
import sqlite3
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import anyio
import sniffio

__all__ = ["Writer"]

T = TypeVar("T")
_MAX_BATCH = 256


class _Job(Generic[T]):
    __slots__ = ("_event", "_wake", "error", "fn", "result")

    def __init__(self, fn: Callable[[sqlite3.Connection], T]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        library = sniffio.current_async_library()
        if library == "asyncio":
            import asyncio

            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._event: Any = future
            # wakes are grouped per loop: one call_soon_threadsafe per batch
            self._wake: tuple[Any, Callable[[], None]] = (loop, lambda: _set_future(future))
        else:
            import trio

            event = trio.Event()
            token = trio.lowlevel.current_trio_token()
            self._event = event
            self._wake = (token, event.set)

    async def done(self) -> None:
        if hasattr(self._event, "wait"):
            await self._event.wait()
        else:
            await self._event

    async def result_when_done(self) -> T:
        with anyio.CancelScope(shield=True):
            await self.done()
        return self.outcome()

    def __await__(self) -> Generator[Any, None, T]:
        """A queued job is awaitable for its result (nothing runs until it is awaited)."""
        return self.result_when_done().__await__()

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[no-any-return]


def _set_future(future: Any) -> None:
    if not future.done():
        future.set_result(None)


class Writer:
    """Owns the connection; every statement runs on its thread."""

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        map_error: Callable[[BaseException], BaseException],
        *,
        begin: str = "BEGIN IMMEDIATE",
    ) -> None:
        self._begin = begin  # "BEGIN" (deferred) on a read-only connection
        self._queue: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._map_error = map_error
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._conn: sqlite3.Connection | None = None
        self._connect = connect
        self._thread = threading.Thread(target=self._main, name="stopline-ledger", daemon=True)
        self._closed = False

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    async def submit(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in a transaction; the result is durable when this returns.

        The wait is shielded: a job once queued always runs, and its caller
        learns the outcome even if it is being cancelled meanwhile.
        """
        job = self.enqueue(fn)
        with anyio.CancelScope(shield=True):
            await job.done()
        return job.outcome()

    def enqueue(self, fn: Callable[[sqlite3.Connection], T]) -> _Job[T]:
        """Queue ``fn`` now, in order, without waiting: a job queued later by this process
        (a read, the next gate) runs after it and sees what it wrote."""
        if self._closed:
            raise RuntimeError("the ledger is closed")
        job: _Job[T] = _Job(fn)
        self._queue.put(job)
        return job

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        await anyio.to_thread.run_sync(self._thread.join)

    # -- the thread -------------------------------------------------------
    def _main(self) -> None:
        try:
            self._conn = self._connect()
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        conn = self._conn
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                batch = [first]
                stop = False
                while len(batch) < _MAX_BATCH:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        stop = True
                        break
                    batch.append(job)
                self._run_batch(conn, batch)
                if stop:
                    return
        finally:
            conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Job[Any]]) -> None:
        """One transaction for the batch; if any job fails, replay each job on its own.

        Jobs are functions of the database state, so after a rollback nothing
        they did remains and each can run again alone: the common case pays
        no savepoints, and one job's error never undoes another's work.
        """
        if not self._run_together(conn, batch):
            for job in batch:
                self._run_together(conn, [job])
        _wake_all(batch)

    def _run_together(self, conn: sqlite3.Connection, batch: list[_Job[Any]]) -> bool:
        try:
            conn.execute(self._begin)
        except BaseException as exc:
            self._fail(batch, exc)
            return True
        for job in batch:
            try:
                job.result = job.fn(conn)
                job.error = None
            except BaseException as exc:
                conn.execute("ROLLBACK")
                if len(batch) > 1:
                    return False
                job.error = self._map_error(exc)
                return True
        try:
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._fail(batch, exc)
        return True

    def _fail(self, batch: list[_Job[Any]], exc: BaseException) -> None:
        mapped = self._map_error(exc)
        for job in batch:
            job.error = mapped
            job.result = None


def _wake_all(batch: list[_Job[Any]]) -> None:
    """One thread-safe wake per event loop (or trio token) for the whole batch."""
    by_loop: dict[int, tuple[Any, list[Callable[[], None]]]] = {}
    for job in batch:
        owner, setter = job._wake
        by_loop.setdefault(id(owner), (owner, []))[1].append(setter)
    for owner, setters in by_loop.values():
        run_all = functools.partial(_call_all, setters)
        if hasattr(owner, "call_soon_threadsafe"):
            owner.call_soon_threadsafe(run_all)
        else:
            owner.run_sync_soon(run_all)


def _call_all(setters: list[Callable[[], None]]) -> None:
    for setter in setters:
        setter()
