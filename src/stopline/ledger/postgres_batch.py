"""Group commit for the PostgreSQL ledger: many calls' intents and outcomes, one commit.

Gates and outcomes of one process queue here in the order they are asked for.
Whoever finds no transaction running leads one: it takes what is queued and
commits it as one transaction, one round trip (``Tx.implicit``, one pipeline:
one statement per stretch of jobs of one kind, committed by its ``Sync``; a
failure with no error reply from the server, the client's own included, is a
commit in doubt: each job is one statement, so each lands whole or not at
all); the jobs queued meanwhile wait, and the first caller among them leads
the next. A lone caller finds nothing queued and runs its job alone, exactly
as without the queue (one statement, one commit), with no task in between.

Every group transaction, and a lone caller's job, runs on the group's own
connection (``postgres_reserved``): one transaction runs at a time, so the
hot path takes no connection from the pool.

A deferred outcome (``PostgresBackend.record_deferred``, ADR 0034) has nobody
waiting on it: it rides the next transaction, which in a sequential workflow
is the next call's intent; if nothing comes within ``delay`` seconds, a timer
commits it alone. ``barrier`` waits until every outcome deferred so far has
committed: every other transaction of the process waits on it first, so
nothing the process reads or writes later misses one.

Within a transaction each run's records keep their queue order, the records of
many runs in one statement per kind (``_stretches``); a duplicate operation id
ends the batch. When the transaction fails, nothing of it landed unless its
commit was in doubt: each job then runs alone, in order, through the backend's
own retries (a gate settles its doubt by its attempt token, an outcome by its
status), so each caller gets its own answer or typed error, within one
``retry_for`` for the batch. A job that waits for a row another session holds
is set aside (``postgres_aside``): its run's writes go on alone, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import psycopg

from stopline.errors import RowHeld
from stopline.ledger._redeliver import held_to_the_end, holding, redelivery
from stopline.ledger.backend import GateResult, GateVerdict
from stopline.ledger.engine.record import recorded
from stopline.ledger.postgres_aside import Aside, Outcome
from stopline.ledger.postgres_aside import error_of as _error
from stopline.ledger.postgres_aside import value_of as _value
from stopline.ledger.postgres_dialect import Forms, many_rows
from stopline.ledger.postgres_errors import answered_within, connection_lost, cut_as_lost
from stopline.ledger.postgres_reserved import Lease, Reserved
from stopline.ledger.postgres_txn import Tx

if TYPE_CHECKING:
    from stopline.ledger.postgres import PostgresBackend

__all__ = ["MAX_BATCH", "GroupCommit", "Job"]

MAX_BATCH = 256  # jobs per transaction
log = logging.getLogger("stopline.ledger.postgres")
# run the job by itself: (a commit in doubt already, deadline, the connection to run it
# on: the group's, which waits for a held row briefly, or None: a pooled one, which waits
# as long as any transaction)
Alone = Callable[[bool, float, Lease | None], Awaitable[Any]]
# a transaction that is one statement, in a batch: the statement (its commit the group's)
# and its result made of its rows (raising the transaction's own error); one statement,
# so it lands whole or not at all when a group's implicit transaction is cut short
Batch = tuple[list[tuple[str, Any]], Callable[[Sequence[Sequence[Any]]], Any]]


class Job:
    """One write queued: a gate or an outcome (``forms``: its statement for one job and
    for many of its kind), or a transaction that is one statement (``batch``: it, and
    what makes its result of its rows), which rides a group's transaction after what
    was queued before it; ``then`` set: deferred, nobody waits."""

    __slots__ = (
        "alone", "batch", "forms", "lead", "op_id", "outcome", "params", "run", "then", "wake",
    )  # fmt: skip

    def __init__(
        self,
        op_id: str,
        alone: Alone | None,
        *,
        forms: Forms | None = None,
        params: Callable[[], dict[str, Any]] | None = None,
        then: Callable[[Outcome], None] | None = None,
        run: str | None = None,
        batch: Batch | None = None,
    ) -> None:
        self.op_id = op_id
        self.batch = batch  # forms is None: it goes last in a group, its statements its own
        self.run = run  # its operation's run, if known (else it keeps its place among all)
        self.alone = alone  # None: a barrier, nothing to write
        self.forms = forms  # None: never together with others
        self.params = params  # its parameters, made only when it goes with others
        self.then = then
        self.outcome: Outcome | None = None
        self.wake: anyio.Event | None = None  # set when it queues with a caller waiting
        self.lead = False  # handed the next transaction

    def finish(self, outcome: Outcome) -> None:
        if self.outcome is not None:
            return  # finished already (a group that failed after its results were in)
        self.outcome = outcome
        if self.then is not None:
            try:
                self.then(outcome)
            except Exception:  # the caller's callback: never the other jobs' problem
                log.exception("group commit: a deferred outcome's callback failed")
        elif self.wake is not None:
            self.wake.set()


class _Failed(Exception):
    """A group transaction failed; ``in_doubt``: its commit may have landed."""

    def __init__(self, *, in_doubt: bool) -> None:
        super().__init__("group transaction failed")
        self.in_doubt = in_doubt


class GroupCommit:
    def __init__(self, backend: PostgresBackend, delay: float) -> None:
        self._backend = backend
        self._delay = delay
        self._queue: deque[Job] = deque()
        self._leading = False
        self._timer: asyncio.TimerHandle | None = None
        self._flushers: set[asyncio.Task[None]] = set()
        # the leader's connection: one transaction at a time, so no pool checkout
        self.reserved = Reserved(backend.connect_group)
        self.aside = Aside(self._deadline)  # jobs waiting for a row another session holds
        self.unsettled = 0  # deferred outcomes queued or being committed
        self._held: list[BaseException] = []  # the leader's task's cancels (``_lead``)
        self.transactions = 0  # group transactions committed (the tests count them)
        # testing hook: awaited with the server pid of a group transaction's connection
        self.before_batch: Callable[[int], Awaitable[None]] | None = None

    # -- what callers do --------------------------------------------------------------
    async def submit(self, job: Job) -> Any:
        """Queue ``job`` and wait for its transaction (shielded: a started write finishes;
        leading, the transaction shields itself: ``attempts`` alone, ``_together``)."""
        assert job.then is None, "a deferred job is queued by defer(), nobody waits on it"
        if self.aside.holds(job):  # behind its run's write that waits for a held row
            job.wake = anyio.Event()
            self.aside.put(job)
        elif not self._leading and not self._queue:  # a lone caller: its job, alone, now
            if job.alone is None:
                return None  # a barrier with nothing before it
            self._leading = True
            try:
                return await job.alone(False, self._deadline(), self.reserved.lease)
            except RowHeld as held:
                job.wake = anyio.Event()
                self._set_aside(job, held.doubt)
            finally:
                self._hand_over()
        else:
            job.wake = anyio.Event()
            self._queue.append(job)
            if not self._leading:
                self._leading = True
                await self._lead()
        if job.outcome is None:
            try:
                await self._wait(job)
            except anyio.get_cancelled_exc_class() as cancel:
                # a started write finishes: the rest of the wait is held (a scope on every
                # wait cost each gate ~2 us), the cancel reaches the caller at its next
                # await (asyncio's own asked again: it was lost, the caller went on)
                again = redelivery(cancel)
                await held_to_the_end(lambda: self._wait(job))
                again()
        outcome = job.outcome
        assert outcome is not None
        return outcome()

    async def _wait(self, job: Job) -> None:
        """Until ``job``'s transaction commits; lead the next one when handed it."""
        assert job.wake is not None
        while job.outcome is None:
            await job.wake.wait()
            job.wake = anyio.Event()
            if job.lead:  # handed while still queued: its outcome is not in yet
                job.lead = False
                await self._lead()

    def defer(self, job: Job) -> None:
        """Queue an outcome nobody waits for: it rides the next transaction."""
        self.unsettled += 1
        then = job.then
        assert then is not None

        def settled(outcome: Outcome) -> None:
            self.unsettled -= 1
            then(outcome)

        job.then = settled
        if self.aside.holds(job):
            self.aside.put(job)
            return
        self._queue.append(job)
        if not self._leading:
            self._arm()

    async def barrier(self) -> None:
        """Return once every outcome deferred so far has committed (or failed), but
        those set aside for a row another session holds (``postgres_aside``)."""
        if self.unsettled:
            await self.submit(Job("", None))

    async def close(self) -> None:
        """Commit what is queued; stop the timer; let the reserved connection go."""
        try:
            while self.unsettled or self._flushers or self.aside.tasks:
                await self.barrier()
                if self._flushers:
                    await asyncio.gather(*self._flushers, return_exceptions=True)
                await self.aside.close()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        finally:
            await self.reserved.close()

    # -- leading one transaction ------------------------------------------------------
    # One leader at a time: ``_leading`` is set by whoever makes a leader (a caller
    # finding none, the timer) and stays set when the leader hands over to a waiting
    # caller, so no caller arriving in between leads a second transaction beside it.
    async def _lead(self) -> None:
        """Run one transaction of what is queued (``_leading`` set already). asyncio's own
        cancel of the leader's task cut it mid-transaction, and every caller of its group
        waited for ever: it is taken wherever it lands (``holding``, ``cut_as_lost``) and
        asked for again once the transaction and its jobs are done."""
        assert self._leading
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            with holding() as self._held:
                batch = self._take()
                await self._run(batch)
        finally:
            self._hand_over()

    def _take(self) -> list[Job]:
        batch: list[Job] = []
        seen: set[str] = set()
        while self._queue and len(batch) < MAX_BATCH:
            job = self._queue[0]
            if job.batch is not None:  # after everything queued before it; it ends the group
                # only where the group holds no run's lock (no gate): it may wait for its
                # run's, and a group never waits for a run while holding another
                if not any(_is_gate([j]) for j in batch):
                    batch.append(self._queue.popleft())
                break
            if job.alone is not None and job.forms is None:  # one that is never grouped
                if not any(j.alone is not None for j in batch):
                    batch.append(self._queue.popleft())
                break
            if job.alone is not None:
                if job.op_id in seen:
                    break  # one write per operation per transaction: the next takes it
                seen.add(job.op_id)
            batch.append(self._queue.popleft())
        return batch

    def _hand_over(self) -> None:
        """The leader is done: the first waiting caller leads the next transaction
        (``_leading`` stays set for it); if none waits, nobody leads, and deferred
        outcomes wait for the timer."""
        for job in self._queue:
            if job.wake is not None:
                job.lead = True
                job.wake.set()
                return
        self._leading = False
        if self._queue:
            self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._leading or not self._queue:
            return
        self._leading = True
        task = asyncio.get_running_loop().create_task(self._lead())
        self._flushers.add(task)
        task.add_done_callback(self._flushers.discard)

    async def _run(self, batch: list[Job]) -> None:
        work = [j for j in batch if j.alone is not None]
        try:
            if len(work) == 1:
                await self._alone(work[0], doubt=False, deadline=self._deadline())
            elif work:
                with anyio.CancelScope(shield=True):
                    await self._together(work)
        except Exception as exc:  # not a storage error (those are each job's): a bug
            log.exception("group commit: a group transaction failed unexpectedly")
            for job in work:
                job.finish(_error(exc))  # every caller hears of it; none waits forever
        finally:
            for job in batch:
                if job.alone is None:
                    job.finish(_value(None))

    def _deadline(self) -> float:
        return time.monotonic() + self._backend.retry_for

    async def _alone(self, job: Job, *, doubt: bool, deadline: float) -> None:
        assert job.alone is not None
        if self.aside.holds(job):  # an earlier job of its run was set aside
            self.aside.put(job, doubt)
            return
        try:
            job.finish(_value(await job.alone(doubt, deadline, self.reserved.lease)))
        except RowHeld as held:
            self._set_aside(job, held.doubt)
        except Exception as exc:
            job.finish(_error(exc))

    def _set_aside(self, job: Job, doubt: bool) -> None:
        """``job`` waits for a row another session holds: it, and every job of its run
        queued, go to its run's line (``postgres_aside``); the group goes on."""
        self.aside.put(job, doubt)
        self.aside.take_from(self._queue)

    async def _together(self, work: list[Job]) -> None:
        deadline = self._deadline()
        try:
            passed, slow = await self._transaction(work)
        except (_Failed, psycopg.Error, OSError) as exc:
            # rolled back, or (lost on the wire) in doubt: each job alone, in order
            doubt = isinstance(exc, _Failed) and exc.in_doubt
            for job in work:
                await self._alone(job, doubt=doubt, deadline=deadline)
            return
        self.transactions += 1
        for job, outcome in passed:
            job.finish(outcome)
        for job in slow:  # gates refused on the fast path: the slow path, alone
            await self._alone(job, doubt=False, deadline=deadline)

    async def _transaction(self, work: list[Job]) -> tuple[list[tuple[Job, Outcome]], list[Job]]:
        """``work`` as one transaction: (the jobs done with their outcomes, gates that
        must take the slow path)."""
        last = work[-1] if work[-1].batch is not None else None  # it goes last (``_take``)
        if last is not None:
            work = work[:-1]
        stretches = _stretches(work)
        # The one-row gate waits for a run a cancel holds: only while the group holds no
        # other run (its first gate stretch); later ones skip a locked run (SKIP LOCKED,
        # the slow path takes it alone), so a group and a tree cancel never deadlock.
        first_gate = next((s for s in stretches if _is_gate(s)), None)
        one_row = [len(s) == 1 and (s is first_gate or not _is_gate(s)) for s in stretches]
        statements = [_statement(s, one) for s, one in zip(stretches, one_row, strict=True)]
        if last is not None and last.batch is not None:
            statements.extend(last.batch[0])
        results = await self._send(statements)
        done: list[tuple[Job, Outcome]] = []
        slow: list[Job] = []
        if last is not None and last.batch is not None:
            done.append((last, _made(last.batch[1], results[len(stretches) :])))
        for stretch, found, one in zip(stretches, results[: len(stretches)], one_row, strict=True):
            forms = stretch[0].forms
            assert forms is not None
            if forms.gate:
                fences = _fences(stretch, found, one)
                for job in stretch:
                    if job.op_id in fences:
                        result = GateResult(GateVerdict.PASSED, fence=fences[job.op_id])
                        done.append((job, _value(result)))
                    else:
                        slow.append(job)
            else:
                done.extend(
                    (job, _recorded(job, row)) for job, row in zip(stretch, found, strict=True)
                )
        return done, slow

    async def _send(self, statements: list[tuple[str, Any]]) -> list[list[Any]]:
        """The group's statements as one transaction on the reserved connection: each job
        one statement, its Sync the commit, no BEGIN or COMMIT. A server that stops
        answering drops the connection, as lost (ADR 0061), as asyncio's own cancel does
        that cuts a statement (``cut_as_lost``); one elsewhere fails the group (each job
        alone) or, once its results are in, leaves them standing."""
        backend, held = self._backend, self._held
        tx: Tx | None = None
        got: list[list[list[Any]]] = []
        try:
            with answered_within(backend.answer_wait) as answering:
                async with self.reserved.lease() as conn:
                    tx = Tx(conn, backend.location, backend.dialect)
                    async with cut_as_lost(conn, answering, held):
                        if backend.doubts:
                            await backend.settle_gate_doubts(tx)
                        if self.before_batch is not None:
                            await self.before_batch(conn.info.backend_pid)
                        got.append(await tx.implicit(statements))
            return got[0]
        except anyio.get_cancelled_exc_class() as cancel:  # asyncio's own: kept, asked again
            held.append(cancel)
            if got:
                return got[0]
            raise self._failed(tx, False) from cancel
        except (psycopg.Error, OSError) as exc:
            # no error reply from the server: what was sent may have committed
            raise self._failed(tx, tx is not None and tx.in_doubt and connection_lost(exc)) from exc
        except Exception as exc:  # the client failed mid-way: the Sync committed the rest
            raise self._failed(tx, tx is not None and tx.in_doubt) from exc
        raise AssertionError("unreachable: the block returns or raises")  # pragma: no cover

    def _failed(self, tx: Tx | None, in_doubt: bool) -> _Failed:
        if in_doubt and tx is not None:  # its jobs are settled once the session is gone
            self._backend.sessions.lost(tx)
        return _Failed(in_doubt=in_doubt)


def _stretches(work: Sequence[Job]) -> list[list[Job]]:
    """``work`` as stretches of one statement each (one kind, ``forms``), in order.

    A job joins the last stretch of its kind if that stretch comes after every
    earlier job of its run: so each run's records keep their queue order (an
    outcome before the next call's intent, as the log says it), while the calls of
    many runs, whose gates and outcomes interleave in the queue, go in two or three
    statements instead of one each. A job whose run is not known keeps its place
    among all: it and every later job go after everything before it."""
    stretches: list[list[Job]] = []
    last: dict[Forms | None, int] = {}  # the last stretch of each kind
    after: dict[str, int] = {}  # the stretch of each run's latest job
    floor = 0  # no job goes before the stretch of the latest job of no known run
    for job in work:
        at = floor if job.run is None else max(floor, after.get(job.run, 0))
        mine = last.get(job.forms)
        if job.run is None or mine is None or mine < at:
            if job.run is None and mine is not None and mine == len(stretches) - 1:
                index = mine  # the last stretch is of its kind: it ends it
            else:
                stretches.append([])
                index = len(stretches) - 1
            last[job.forms] = index
        else:
            index = mine
        stretches[index].append(job)
        if job.run is None:
            floor = index
        else:
            after[job.run] = index
    return stretches


def _is_gate(stretch: Sequence[Job]) -> bool:
    forms = stretch[0].forms
    return forms is not None and forms.gate


def _statement(stretch: Sequence[Job], one_row: bool) -> tuple[str, Any]:
    """A stretch's statement: the one-row form (cheaper: prepared by psycopg after a
    few uses) or the many-row form."""
    forms = stretch[0].forms
    assert forms is not None
    params = [j.params() for j in stretch if j.params is not None]
    if one_row:
        return forms.one, params[0]
    return forms.many, many_rows(params)


def _fences(stretch: Sequence[Job], found: Sequence[Any], one_row: bool) -> dict[str, int]:
    """The gates of a stretch that passed, with their fences (one row: the fence alone)."""
    if one_row:
        return {stretch[0].op_id: int(found[0][0])} if found else {}
    return {str(op): int(fence) for op, fence in found}


def _made(result: Callable[[Sequence[Sequence[Any]]], Any], found: Sequence[Any]) -> Outcome:
    """A one-batch transaction's outcome, made of its statements' rows."""
    try:
        return _value(result(found))
    except Exception as exc:  # UnknownRun, IllegalTransition: what its body raises
        return _error(exc)


def _recorded(job: Job, row: Sequence[Any]) -> Outcome:
    source, moved, *columns = row
    assert job.forms is not None and job.forms.event is not None
    event = job.forms.event  # not from its parameters: they are made once, to be sent
    try:
        return _value(recorded(job.op_id, event, source, columns if moved else None))
    except Exception as exc:  # UnknownOperation, IllegalTransition: what ``record`` raises
        return _error(exc)
