"""Writes whose row another session holds: set aside from the group commit, run alone.

The group commit runs one transaction at a time for the whole process. A
write that waits for a row another session holds (a stuck transaction, an
operator's ``SELECT ... FOR UPDATE``, a worker that froze mid-transaction)
held every other run's gates and outcomes behind it for a whole lock
timeout, again at each retry of it, for as long as the row stayed held.

So the group's own connection waits for a row briefly (``GROUP_LOCK_WAIT``):
a job that waits longer raises ``RowHeld`` there and is set aside, into a
line of its run (of its operation, when its run is not known) that runs its
jobs one at a time, in order, on pooled connections, each waiting for the
row as long as any transaction does (``retry_for``) and failing as
``LedgerLocked`` after it. Every later job of that run (or operation) joins
the line instead of the group, queued jobs included, so a run's records keep
their order; the other runs' writes go on in the group meanwhile. A line
whose last job failed for a held row stays (empty) until one of its jobs
commits, so the next write of that run waits there, not in the group.

A deferred outcome set aside is what the group's ``barrier`` no longer waits
for: as an outcome the outbox holds after ``LedgerLocked`` (it becomes one
within a ``retry_for``), its operation reads ``requested`` meanwhile and the
runtime holds it as not durable yet (``Outcomes.in_hand``: "recording"), so
its run cannot settle on it; a transaction of another run does not wait a
lock timeout for it.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stopline.errors import LedgerLocked

if TYPE_CHECKING:
    from stopline.ledger.postgres_batch import Job

__all__ = ["GROUP_LOCK_WAIT", "Aside", "Outcome", "error_of", "value_of"]

GROUP_LOCK_WAIT = 0.5  # seconds the group's connection waits for a row another session holds
Outcome = Callable[[], Any]  # returns the job's result or raises its error


def value_of(value: Any) -> Outcome:
    return lambda: value


def error_of(exc: BaseException) -> Outcome:
    def outcome() -> Any:
        raise exc

    return outcome


class _Line:
    def __init__(self, key: str) -> None:
        self.key = key
        self.jobs: deque[tuple[Job, bool]] = deque()  # (job, its commit in doubt already)
        self.task: asyncio.Task[None] | None = None


class Aside:
    """The lines of one group commit; ``deadline()``: when a job run now must be done."""

    def __init__(self, deadline: Callable[[], float]) -> None:
        self._deadline = deadline
        self._lines: dict[str, _Line] = {}  # run id (operation id when not known) -> line
        self._ops: Counter[str] = Counter()  # operation ids of the jobs in lines
        self._op_line: dict[str, _Line] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def _line_of(self, job: Job) -> _Line | None:
        line = self._lines.get(job.run) if job.run is not None else None
        return line if line is not None else self._op_line.get(job.op_id)

    def holds(self, job: Job) -> bool:
        """Its run (or operation) has a line: it goes there, behind what waits. (On every
        gate and outcome: with no line, the usual case, one truth test.)"""
        return bool(self._lines) and job.alone is not None and self._line_of(job) is not None

    def put(self, job: Job, doubt: bool = False) -> None:
        """Into its run's line (made if there is none), to run after what is in it."""
        line = self._line_of(job)
        if line is None:
            key = job.run if job.run is not None else job.op_id
            line = self._lines[key] = _Line(key)
        line.jobs.append((job, doubt))
        self._ops[job.op_id] += 1
        self._op_line[job.op_id] = line
        if line.task is None:
            line.task = asyncio.get_running_loop().create_task(self._drain(line))
            self.tasks.add(line.task)
            line.task.add_done_callback(self.tasks.discard)

    def take_from(self, queue: deque[Job]) -> None:
        """Queued jobs whose run (or operation) has a line join it, in their order."""
        kept = []
        for job in queue:
            if self.holds(job):
                self.put(job)
            else:
                kept.append(job)
        queue.clear()
        queue.extend(kept)

    async def close(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _drain(self, line: _Line) -> None:
        """The line's jobs, one at a time, each alone on a pooled connection."""
        held = False
        while line.jobs:
            job, doubt = line.jobs[0]
            assert job.alone is not None
            try:
                outcome = value_of(await job.alone(doubt, self._deadline(), None))
                held = False
            except Exception as exc:  # its own typed error (LedgerLocked: held all along)
                outcome = error_of(exc)
                held = isinstance(exc, LedgerLocked)
            line.jobs.popleft()
            self._ops[job.op_id] -= 1
            if not self._ops[job.op_id]:
                del self._ops[job.op_id]
                del self._op_line[job.op_id]
            job.finish(outcome)
        line.task = None
        if not held:  # committed (or failed otherwise): the run's writes go to the group
            del self._lines[line.key]
