"""One writer thread per SQLite ledger, with group commit.

Async callers submit a transaction function ``fn(conn) -> T``; the thread
takes every job waiting, runs them in one ``BEGIN IMMEDIATE`` transaction
(each in its own savepoint when there is more than one, so one job's error
rolls back that job alone), commits once (one fsync for the batch), and
only then wakes the callers: a caller never sees a result that is not yet
durable. One thread hop per transaction, as STYLE.md asks, and under
concurrency one fsync for many intents. A *prompt* job (a cancel's fence, which
interrupts nothing until it is durable) ends the batch it joins: what was queued
after it commits in the next one, so its caller never waits for later work. It
also commits before the jobs queued ahead of it whose callers still wait (never
before a deferred one): in a busy process those are the other runs' calls.

Waking works on asyncio (``call_soon_threadsafe``) and trio (the trio token).

The thread cannot die of a storage error (ADR 0010): every error ends the
transaction it hit with a typed error for those callers, a rollback SQLite
already did itself is not done twice, a connection left inside a failed
transaction is replaced, and the thread keeps serving. Should it stop anyway,
every waiting and later caller gets a typed error instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import anyio
import sniffio

from stopline.errors import LedgerIOError
from stopline.ledger._redeliver import REARMED, held_to_the_end, redelivery, surface_rearmed

__all__ = ["Writer"]

log = logging.getLogger("stopline.ledger.sqlite")

T = TypeVar("T")
_MAX_BATCH = 256
_QUEUED, _RUNNING, _WITHDRAWN = 0, 1, 2


class _Job(Generic[T]):
    __slots__ = (
        "_event", "_finished", "_lock", "_loop", "_state", "_waiter", "_wake", "deferred",
        "error", "fn", "held", "prompt", "result",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[[sqlite3.Connection], T],
        then: Callable[[Callable[[], T]], None] | None = None,
        prompt: bool = False,
        first: Callable[[T], None] | None = None,
    ) -> None:
        self.fn = fn
        self.prompt = prompt  # its batch takes nothing queued after it
        # nobody waits on it: it may wait a little for company before committing
        self.deferred = then is not None
        # a deferred job whose batch failed to commit: kept for the next batch, not lost
        self.held = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._state = _QUEUED
        self._lock = threading.Lock()
        self._event: Any = None  # trio: the event its caller waits on
        # asyncio: set on the loop once the thread is done with it; a waiter future per
        # wait, so a cancelled wait (which cancels its future) never reads as finished
        self._finished = False
        self._waiter: Any = None
        self._loop: Any = None
        owner: Any
        done: Callable[[], None]
        if sniffio.current_async_library() == "asyncio":
            import asyncio

            owner = self._loop = asyncio.get_running_loop()
            # wakes are grouped per loop: one call_soon_threadsafe per batch
            done = self._set_finished if then is None else functools.partial(then, self.outcome)
        else:
            import trio

            owner = trio.lowlevel.current_trio_token()
            if then is not None:
                done = functools.partial(then, self.outcome)
            else:
                self._event = trio.Event()
                done = self._event.set
        if first is not None:  # on the caller's loop, before the caller is woken
            done = functools.partial(self._committed_first, first, done)
        self._wake: tuple[Any, Callable[[], None]] = (owner, done)

    def _committed_first(self, first: Callable[[T], None], wake: Callable[[], None]) -> None:
        """On the loop, before the caller is woken: ``first(result)`` if it committed."""
        try:
            if self.error is None:
                first(self.result)
        except Exception:  # the caller's hook: never a reason not to wake the caller
            log.exception("writer: a job's committed hook failed")
        finally:
            wake()

    def _set_finished(self) -> None:
        """On the loop: the thread is done with it; wake the wait, if one is on."""
        self._finished = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def finished(self) -> bool:
        """The thread is done with it and its caller has been woken."""
        return self._finished if self._event is None else bool(self._event.is_set())

    async def done(self) -> None:
        if self._event is not None:
            await self._event.wait()
            return
        while not self._finished:
            self._waiter = self._loop.create_future()
            await self._waiter

    async def result_when_done(self) -> T:
        """Its outcome once the thread is done with it, whoever cancels the wait (an
        outcome that must not be cut: asyncio's own cancel is asked for again after)."""
        await held_to_the_end(self.done)
        return self.outcome()

    def __await__(self) -> Generator[Any, None, T]:
        """A queued job is awaitable for its result (nothing runs until it is awaited)."""
        return self.result_when_done().__await__()

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[no-any-return]

    def withdraw(self) -> bool:
        """The caller gave up: a job the thread has not taken yet never runs."""
        with self._lock:
            if self._state == _QUEUED:
                self._state = _WITHDRAWN
            return self._state == _WITHDRAWN

    def claim(self) -> bool:
        """The thread takes the job, unless its caller withdrew it first."""
        with self._lock:
            if self._state == _QUEUED:
                self._state = _RUNNING
            return self._state == _RUNNING


class Writer:
    """Owns the connection; every statement runs on its thread."""

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        map_error: Callable[[BaseException], BaseException],
        location: str = "sqlite",
        grace: float = 10.0,
        *,
        begin: str = "BEGIN IMMEDIATE",
        linger: float = 0.002,
    ) -> None:
        self._begin = begin  # "BEGIN" (deferred) on a read-only connection
        # how long a batch of deferred jobs alone waits for the next job to share its commit
        self._linger = linger
        self._queue: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._map_error = map_error
        self._location = location
        self.grace = grace  # how long a cancelled caller still waits for its job
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._conn: sqlite3.Connection | None = None
        self._connect = connect
        self._thread = threading.Thread(target=self._main, name="stopline-ledger", daemon=True)
        self._closed = False
        self._stopped: BaseException | None = None  # why the thread ended, if it did
        self._broken = False  # a rollback failed: the next batch starts on a new connection
        # deferred jobs (outcomes) whose batch could not commit (a full disk, an I/O
        # error): they ride the next batch, first, so an outcome is never dropped
        self._held: list[_Job[Any]] = []

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    async def submit(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        must_run: bool = False,
        prompt: bool = False,
        first: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn`` in a transaction; the result is durable when this returns.

        A cancel or a deadline reaches the wait, with a grace: a caller whose
        scope is cancelled still learns the outcome of a job that finishes
        within ``grace`` seconds (one transaction normally takes milliseconds,
        so work recorded in a cancelled scope is not lost or left unreported).
        Past the grace it gives up: a job the thread has not taken yet is
        withdrawn and never runs. ``must_run`` (an outcome that must not be
        lost) is waited for to the end; the thread cannot die, so that ends.
        ``prompt``: its batch ends with it (the jobs queued after it, in the next).
        ``first(result)``: called on the caller's loop once it has committed, before
        the caller is woken (its errors are logged; the caller is woken all the same).
        """
        if REARMED and not must_run:
            await surface_rearmed()
        job = self.enqueue(fn, prompt=prompt, first=first)
        if must_run:
            return await job.result_when_done()
        try:
            await job.done()
        except anyio.get_cancelled_exc_class() as cancel:
            again = redelivery(cancel)
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.grace):
                await job.done()
            if not job.finished:
                job.withdraw()  # never runs if the thread has not taken it yet
                raise
            again()  # the caller learns the outcome; its cancel still reaches it
        return job.outcome()

    def enqueue(
        self,
        fn: Callable[[sqlite3.Connection], T],
        then: Callable[[Callable[[], T]], None] | None = None,
        *,
        prompt: bool = False,
        first: Callable[[T], None] | None = None,
    ) -> _Job[T]:
        """Queue ``fn`` now, in order: a job queued later by this process (a read, the
        next gate) runs after it and sees what it wrote. One exception, ``prompt``:
        it may commit before jobs queued earlier whose callers still wait (never
        before a deferred one; ``_prompt_first``).

        With ``then``, nobody waits: after the commit, ``then(outcome)`` runs on the
        caller's event loop (``outcome()`` returns the result or raises). A batch of
        only such jobs waits up to ``linger`` seconds for another job and commits with
        it (group commit: a sequential workflow's outcome rides its next intent's fsync).
        """
        if self._closed:
            raise RuntimeError("the ledger is closed")
        if self._stopped is not None:
            raise self._stopped
        job: _Job[T] = _Job(fn, then, prompt, first)
        self._queue.put(job)
        if self._stopped is not None:  # stopped meanwhile: nobody will take it
            self._drain(self._stopped)
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
        stopped: BaseException = RuntimeError("the ledger is closed")
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                batch, self._held = self._held, []
                for job in batch:
                    job.held = False
                if first.claim():
                    batch.append(first)
                stop = self._take_waiting(batch)
                if not stop and batch and all(job.deferred for job in batch):
                    stop = self._linger_for_company(batch)
                for part in _prompt_first(batch):
                    self._serve(part)
                if stop:
                    return
        except BaseException as exc:  # not a storage error (those end one batch): a bug
            stopped = exc
            raise
        finally:
            self._stop(stopped)

    def _take_waiting(self, batch: list[_Job[Any]]) -> bool:
        """Add every job already waiting (up to the batch limit, or up to a prompt job:
        nothing queued after it delays its commit); True if told to stop."""
        while len(batch) < _MAX_BATCH and not (batch and batch[-1].prompt):
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            if job.claim():
                batch.append(job)
        return False

    def _linger_for_company(self, batch: list[_Job[Any]]) -> bool:
        """Only deferred jobs: wait up to ``linger`` for a job someone waits on.

        The wait is bounded from the first deferred job, so an outcome is durable
        within a few milliseconds even when no other write comes.
        """
        deadline = time.monotonic() + self._linger
        while len(batch) < _MAX_BATCH:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                job = self._queue.get(timeout=remaining)
            except queue.Empty:
                return False
            if job is None:
                return True
            if job.claim():
                batch.append(job)
            if self._take_waiting(batch):
                return True
            if not all(j.deferred for j in batch):
                return False
        return False

    def _serve(self, batch: list[_Job[Any]]) -> None:
        """Run one batch and wake its callers, whatever happens: the thread goes on."""
        try:
            self._run(self._connection(), batch)
        except Exception as exc:  # no connection, or an error no mapping foresaw
            self._fail(batch, exc)
        _wake_all([job for job in batch if not job.held])

    def _run(self, conn: sqlite3.Connection, batch: list[_Job[Any]]) -> None:
        """The batch in one transaction; if a job or the commit fails, each job alone (a
        read, or a write that fits on a full disk, is not failed by another's). A job runs
        alone at most once: one that committed is never run again, and a deferred one that
        still cannot commit is held for the next batch (``_fail``)."""
        if not self._run_together(conn, batch):
            for job in batch:
                self._run_together(conn, [job])

    def _connection(self) -> sqlite3.Connection:
        """The connection, replaced if a failed rollback left it inside a transaction."""
        assert self._conn is not None
        if self._broken:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = self._connect()
            self._broken = False
        return self._conn

    def _rollback(self, conn: sqlite3.Connection) -> None:
        """Roll back what SQLite has not rolled back itself (a full disk or an I/O error
        ends the transaction inside SQLite; rolling back again is an error)."""
        if not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            self._broken = conn.in_transaction

    def _stop(self, why: BaseException) -> None:
        """The thread ends: no caller, present or future, waits for it."""
        if not isinstance(why, RuntimeError):
            cause = f"the writer thread stopped ({type(why).__name__}: {why}); reopen the ledger"
            why = LedgerIOError(self._location, cause)
        self._stopped = why
        for job in self._held:
            job.error, job.held = why, False
        _wake_all(self._held)
        self._drain(why)
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()

    def _drain(self, why: BaseException) -> None:
        left: list[_Job[Any]] = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.claim():
                job.error = why
                left.append(job)
        _wake_all(left)

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
                self._rollback(conn)
                if len(batch) > 1:
                    return False
                job.error = self._map_error(exc)
                return True
        try:
            conn.execute("COMMIT")
        except BaseException as exc:
            self._rollback(conn)
            if len(batch) > 1:
                return False  # each alone: a read, or a write that fits, is not failed by it
            self._fail(batch, exc)
        return True

    def _fail(self, batch: list[_Job[Any]], exc: BaseException) -> None:
        """The batch as a whole did not commit: its callers learn why; deferred jobs,
        whose callers are not waiting, are held for the next batch instead."""
        mapped = self._map_error(exc)
        for job in batch:
            job.result = None
            if job.deferred and self._stopped is None:
                if not job.held:
                    job.held = True
                    self._held.append(job)
            else:
                job.error = mapped


def _prompt_first(batch: list[_Job[Any]]) -> list[list[_Job[Any]]]:
    """The transactions to run a batch in, in order. A batch ending in a prompt job runs
    it first, with the deferred jobs queued before it (outcomes whose callers went on:
    everything the process does later must see them), then the jobs whose callers still
    wait. Those were queued concurrently with it (a caller waiting on its job cannot
    have queued the prompt one), so either order is one the ledger allows, as it does
    between PostgreSQL's connections."""
    if not batch or not batch[-1].prompt:
        return [batch] if batch else []
    waiting = [job for job in batch[:-1] if not job.deferred]
    if not waiting:
        return [batch]
    return [[job for job in batch if job.deferred or job is batch[-1]], waiting]


def _wake_all(batch: list[_Job[Any]]) -> None:
    """One thread-safe wake per event loop (or trio token) for the whole batch."""
    by_loop: dict[int, tuple[Any, list[Callable[[], None]]]] = {}
    for job in batch:
        owner, setter = job._wake
        by_loop.setdefault(id(owner), (owner, []))[1].append(setter)
    for owner, setters in by_loop.values():
        run_all = functools.partial(_call_all, setters)
        # a loop that closed meanwhile has nobody left to wake
        with contextlib.suppress(RuntimeError):
            if hasattr(owner, "call_soon_threadsafe"):
                owner.call_soon_threadsafe(run_all)
            else:
                owner.run_sync_soon(run_all)


def _call_all(setters: list[Callable[[], None]]) -> None:
    for setter in setters:
        setter()
