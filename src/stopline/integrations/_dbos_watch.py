"""DBOS's cancel of a gated workflow that is waiting, noticed (ADR 0104).

DBOS checks for a cancel before each step and, while a preemptible step runs,
through its watcher. A workflow that waits (on a child's result, in
``DBOS.recv``, in a sleep) meets no check until it runs code again, and the
child workflows its run owns go on sending meanwhile. While gated workflows
run in the process, one read an interval asks DBOS which of them it has
cancelled (one ``list_workflows`` for all of them, as DBOS's own watcher of
preemptible steps does) and fences the run of each that is not inside a gated
step, as DBOS's check would: the runs it owns exclusively are fenced with it
and their workflows cancelled in DBOS. A workflow inside a gated step is left
to DBOS's contract for that step (preempted, or checked as it ends). No
gated workflow running, nothing is read.

DBOS's own calls wait out an outage of its system database: they retry, with
a backoff that grows to a minute, until it answers. The watcher's read is one
attempt instead (ADR 0106): a read that fails is counted in ``ledger.health``
(the step ``watch_dbos_cancels`` failing: the ledger is degraded) and made
again at the next interval, so the first read after the database is back
answers, and the health recovers. A read that neither answers nor fails
within ``READ_WITHIN`` (a lock held on SQLite, a server that does not answer)
is counted the same way and waited for, one read at a time; the watcher stops
without it when its last workflow leaves. A failed read fences nothing.

An outage is one failure, however many reads it fails (ADR 0114): counted and
logged (a warning, by ``ledger.health``) as its first read fails, and logged
again as a read answers, with how long it lasted and how many reads it failed
(or as the watcher stops before that). The reads between say nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import inspect
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from dbos._dbos import _get_dbos_instance
from dbos._sys_db import WorkflowStatusString
from sqlalchemy.exc import StatementError

from stopline.errors import describe
from stopline.integrations._engines import EngineGate
from stopline.runtime.boundary import retryable

__all__ = [
    "READ_WITHIN",
    "WATCH_EVERY",
    "Watcher",
    "outside_workflow",
    "owner_in_dbos",
    "short",
    "why_cancelled",
]

log = logging.getLogger("stopline.integrations.dbos")
R = TypeVar("R")
_FIRST = asyncio.FIRST_COMPLETED
# seconds between two reads of DBOS's status of the process's gated workflows (DBOS's
# own watcher of preemptible steps reads as often)
WATCH_EVERY = 1.0
# seconds a read may go unanswered before it is counted as failed (DBOS reads its status
# in milliseconds; DBOS caps its listings at 30 s, SQLite waits 30 s for a lock)
READ_WITHIN = 5.0
_CANCELLED = WorkflowStatusString.CANCELLED.value
_STEP = "watch_dbos_cancels"  # the watcher's name in ``ledger.health``
_UNANSWERED = "DBOS's system database has not answered a read of its cancels in {:g}s"


@dataclasses.dataclass
class _Outage:
    """DBOS's system database failing the watcher's reads since ``began`` (monotonic)."""

    began: float
    last_error: str
    reads: int = 1  # failed or unanswered since it began


@dataclasses.dataclass
class _Watched:
    run_id: str
    deadline_ms: int | None  # DBOS's timeout of the workflow: its cancel is that
    since: int  # the registration of its latest execution in this process
    executions: int = 1
    in_steps: int = 0  # gated steps running now: DBOS's contract for them stands
    fenced: bool = False  # by this watcher, since its latest execution started


class Watcher:
    """The gated DBOS workflows running in this process under one gate, and the one
    task that reads DBOS's cancels of them while any runs (behind the ledger's error
    boundary: a failed or overdue read is logged, counted in ``ledger.health`` and made
    again at the next interval; it never fails a workflow)."""

    def __init__(
        self, gate: EngineGate, every: float = WATCH_EVERY, read_within: float = READ_WITHIN
    ) -> None:
        self.gate = gate
        self.every = every
        self.read_within = read_within
        self._outage: _Outage | None = None  # reads fail (or go unanswered) now
        self._watched: dict[str, _Watched] = {}
        self._registered = 0
        self._running = False
        self._wake = asyncio.Event()
        self.stopped = asyncio.Event()  # set as the watcher stops, cleared as it starts
        self.stopped.set()

    def add(self, workflow_id: str, run_id: str, deadline_ms: int | None) -> None:
        """An execution of the workflow starts its gated code here."""
        self._registered += 1
        watched = self._watched.get(workflow_id)
        if watched is None:
            self._watched[workflow_id] = _Watched(run_id, deadline_ms, self._registered)
        else:  # another execution beside it (a resume, a recovery): its cancel is new
            watched.executions += 1
            watched.since, watched.fenced = self._registered, False
            watched.deadline_ms = deadline_ms
        if not self._running:
            self._running = True
            self.stopped.clear()
            # an empty context: the watcher is no part of the workflow whose start began
            # it (DBOS would record its reads as that workflow's steps)
            try:
                contextvars.Context().run(self.gate.ledger.spawn, self._watch_dbos_cancels)
            except BaseException:  # the ledger is not open: the next start tries again
                self._running = False
                self.stopped.set()
                raise

    def remove(self, workflow_id: str) -> None:
        """An execution of the workflow ends; the last one stops the watcher."""
        watched = self._watched[workflow_id]
        watched.executions -= 1
        if not watched.executions:
            del self._watched[workflow_id]
        if not self._watched:
            self._wake.set()

    @contextlib.contextmanager
    def in_step(self, workflow_id: str) -> Iterator[None]:
        """A gated step of the workflow runs inside this block."""
        watched = self._watched.get(workflow_id)
        if watched is None:  # not a gated workflow: its step is refused anyway
            yield
            return
        watched.in_steps += 1
        try:
            yield
        finally:
            watched.in_steps -= 1

    async def _watch_dbos_cancels(self) -> None:
        try:
            while self._watched:
                self._wake = asyncio.Event()  # set when the last gated workflow ends
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.every)
                if self._watched:
                    await self._look()
        finally:
            self._answered(stopping=True)  # no read made now fails: a later start reads afresh
            self._running = False
            self.stopped.set()

    async def _look(self) -> None:
        """One read for all the watched workflows; the run of each DBOS cancelled is
        fenced. Only an execution registered before the read began is fenced by it: a
        status read before a resume must not fence the resumed execution."""
        began = self._registered
        ids = [wid for wid, w in self._watched.items() if not w.fenced and not w.in_steps]
        if not ids:
            return
        found = await self._read(ids)
        for workflow_id in found or ():
            watched = self._watched.get(workflow_id)
            if watched is None or watched.fenced or watched.in_steps or watched.since > began:
                continue
            watched.fenced = True
            why = why_cancelled(watched.deadline_ms)
            log.info("%s: %s seen while it waited; its run fenced", workflow_id, why)
            try:
                await self.gate.fence(watched.run_id, why)
            except Exception as exc:  # a fault that may clear: fenced at the next look
                watched.fenced = not retryable(exc)
                self.gate.ledger.health.failed(_STEP, exc, retrying=not watched.fenced)

    async def _read(self, ids: list[str]) -> list[str] | None:
        """Which of ``ids`` DBOS has cancelled; ``None`` when the read failed (counted:
        read again at the next interval) or the last watched workflow left before it
        answered (let go: it ends in its thread, at its driver's own bound)."""
        # an empty context: the read is no part of the workflow whose start began it
        read = asyncio.create_task(
            asyncio.to_thread(_cancelled_among, ids), context=contextvars.Context()
        )
        left = asyncio.create_task(self._wake.wait())  # set when the last one leaves
        try:
            both = {read, left}
            done, _ = await asyncio.wait(both, timeout=self.read_within, return_when=_FIRST)
            overdue = not done
            if overdue:  # counted now, waited for still: a second read would wait too
                self._failed(TimeoutError(_UNANSWERED.format(self.read_within)))
                done, _ = await asyncio.wait(both, return_when=_FIRST)
            if read not in done:
                return None
            try:
                found = read.result()
            except Exception as exc:  # DBOS's database: read again at the next interval
                self._failed(exc, counted=overdue)
                return None
            self._answered()
            return found
        finally:
            left.cancel()
            read.cancel()  # answered: nothing; else the watcher no longer waits for it

    def _failed(self, exc: BaseException, *, counted: bool = False) -> None:
        """A read failed or went unanswered (``counted``: this one, counted as overdue,
        failed since): the first of an outage is counted in the health (its warning says
        so), the others only in the outage (ADR 0114)."""
        if self._outage is not None:
            self._outage.reads += not counted
            self._outage.last_error = _first_line(exc)
            return
        self._outage = _Outage(time.monotonic(), _first_line(exc))
        health = self.gate.ledger.health
        health.failed(_STEP, short(exc), retrying=True)
        health.failing(_STEP, True)

    def _answered(self, *, stopping: bool = False) -> None:
        """A read answered (or the watcher stops): an outage ends, said once."""
        outage, self._outage = self._outage, None
        if outage is None:
            return
        lasted = time.monotonic() - outage.began
        if stopping:
            log.warning(_STOPPED_IN_OUTAGE, lasted, outage.reads, outage.last_error)
        else:
            log.warning(_ANSWERED_AGAIN, lasted, outage.reads, outage.last_error)
        self.gate.ledger.health.failing(_STEP, False)


def short(exc: BaseException) -> BaseException:
    """DBOS's database error as a log or a record tells it: SQLAlchemy's error without
    the statement, parameters and link it appends to its message (``[SQL: ...]``, all of
    a listing's ids; ADR 0118). A copy of the same type, with the original as its cause
    (a traceback still shows it); any other error as it is."""
    if not isinstance(exc, StatementError):
        return exc
    told = copy.copy(exc)
    told.statement, told.params, told.code = None, None, None
    told.__cause__, told.__traceback__ = exc, exc.__traceback__
    return told


def _first_line(exc: BaseException) -> str:
    """The error's first line, without what SQLAlchemy appends to its message."""
    return describe(short(exc)).partition("\n")[0]


_ANSWERED_AGAIN = (
    "DBOS's system database answers the watcher of waiting workflows again: its reads of"
    " DBOS's cancels failed for %.1fs (reads failed: %d; the last: %s); a cancel made"
    " meanwhile is fenced now"
)
_STOPPED_IN_OUTAGE = (
    "the watcher of waiting workflows stops (no gated workflow runs) while DBOS's system"
    " database does not answer: its reads of DBOS's cancels failed for %.1fs (reads"
    " failed: %d; the last: %s)"
)


def why_cancelled(deadline_ms: int | None) -> str:
    """What cancelled the workflow in DBOS: its timeout once its deadline has passed,
    else a cancel (``DBOS.cancel_workflow``)."""
    if deadline_ms is not None and time.time() * 1000 >= deadline_ms:
        return "DBOS workflow timeout"
    return "DBOS.cancel_workflow"


def _cancelled_among(ids: list[str]) -> list[str]:
    """DBOS's listing of the cancelled workflows among ``ids``, in one attempt (in a
    thread). ``DBOS.list_workflows`` retries a connection error or a locked SQLite until
    the database answers, sleeping up to a minute between attempts: the watcher would
    read nothing for that long after the database is back, and its thread would hold up
    the process's exit while the database is down. DBOS's listing without that retry
    (its system database handle, pinned ``dbos==3.4.*``) raises instead."""
    system_db = _get_dbos_instance()._sys_db
    listing = inspect.unwrap(type(system_db).list_workflows)  # under DBOS's ``db_retry``
    found = listing(
        system_db, workflow_ids=ids, status=_CANCELLED, load_input=False, load_output=False
    )
    return [status.workflow_id for status in found]


async def owner_in_dbos(workflow_id: str) -> str | None:
    """DBOS's ownership token of the workflow now (``None``: none, cancelled or done),
    read as the application. DBOS publishes no read of it: its system database's own
    (pinned ``dbos==3.4.*``), which waits out an outage as DBOS's calls do (ADR 0114)."""
    read = _get_dbos_instance()._sys_db.get_workflow_owner
    return await outside_workflow(asyncio.to_thread(read, workflow_id))


async def outside_workflow(call: Coroutine[Any, Any, R]) -> R:
    """Run a DBOS call as the application, not as a step of the workflow whose code
    (or whose ledger task) happens to be the caller: DBOS records calls made inside a
    workflow as its steps, and a cancel recorded so would cancel the caller."""
    return await asyncio.create_task(call, context=contextvars.Context())
