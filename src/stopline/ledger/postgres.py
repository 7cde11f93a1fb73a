"""The shared PostgreSQL ledger: many workers on many hosts, one contract.

``postgresql://user@host:5432/db?schema=NAME`` opens it (psycopg 3, async, a connection
pool; asyncio only, as psycopg's async driver is). Besides libpq's own parameters the URL
takes ``schema`` (created if missing; the ledger's tables live there), ``pool_min``/
``pool_max``, ``retry_for`` (seconds a transaction is retried across connection loss or
failover, default 10) and ``group_commit_ms`` (how long a deferred outcome waits for a
transaction to ride before committing alone, default 2).

Gates and outcomes go through the group commit (``postgres_batch``): many callers'
writes in one transaction, a lone caller's alone, on a connection of its own; by
default a call's outcome is deferred and rides the next transaction (ADR 0034).

Every public method is one of the engine's transaction bodies (``stopline.ledger.engine``)
on a pooled connection (``postgres_txn.Tx``, in PostgreSQL's dialect), run by ``_tx``,
which maps storage errors at this boundary (``postgres_errors``) and decides what a
failure means (asyncio's own cancel cutting a statement is a connection lost, taken
and asked for again once the write is done: ``cut_as_lost``):

- a failure before any commit was sent (no connection, a statement failed, a
  serialization failure or deadlock) rolled back: retried until ``retry_for``;
- a connection lost while a commit was on the wire leaves it *in doubt*. A
  gate settles it by reading back its attempt token (a unique id in its
  ``gate_passed`` event): landed means ``PASSED``, absent means retry. If the
  ledger stays unreachable, ``GateInDoubt`` is raised (nothing was sent) and
  the backend, on its next successful transaction, records that intent
  ``unknown`` if it landed, never ``not_committed`` (R3). ``record`` settles
  by re-reading the status; idempotent writes (cancel, heartbeat, phases)
  simply retry; any other write raises ``CommitInDoubt``.

A cancel notifies ``stopline_cancel[_<schema>]`` with the fenced run ids in
its own transaction; ``watch_cancels`` listens on a dedicated connection,
re-listens after a drop and catches up from ``runs.cancelled_at``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
import psycopg
import psycopg.errors
import sniffio
from psycopg_pool import AsyncConnectionPool

from stopline.domain.lifecycle import CancelResult
from stopline.domain.model import Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.vocab import LogKind, PhaseKind, Policy, RunEvent
from stopline.errors import (
    CancelInDoubt,
    CommitInDoubt,
    GateInDoubt,
    LeaseExpired,
    LedgerError,
    LedgerUnavailable,
)
from stopline.ledger._redeliver import holding
from stopline.ledger.backend import GateResult, OutcomeUpdate, RunSpec
from stopline.ledger.engine import Db, SqlBackend, fence, owners, reads, runs
from stopline.ledger.engine import approvals as ap
from stopline.ledger.engine.gate import gate, gate_params, intent_sql
from stopline.ledger.engine.reads import load_run
from stopline.ledger.engine.record import record, record_params
from stopline.ledger.engine.truth import begin_compensation
from stopline.ledger.postgres_aside import GROUP_LOCK_WAIT
from stopline.ledger.postgres_attempts import retried
from stopline.ledger.postgres_batch import GroupCommit, Job
from stopline.ledger.postgres_dialect import PostgresDialect, gate_forms, outcome_forms
from stopline.ledger.postgres_errors import (
    ANSWER_FLOOR,
    map_error,
    redact,
)
from stopline.ledger.postgres_listen import Listener, OwnCancels
from stopline.ledger.postgres_open import start
from stopline.ledger.postgres_reserved import Lease
from stopline.ledger.postgres_settle import (
    Sessions,
    attempt_token,
    gate_landed,
    logged,
    nothing,
    outcome_landed,
    run_landed,
    run_moved,
    settle_gates,
)
from stopline.ledger.postgres_txn import Tx
from stopline.ledger.postgres_url import parse, session_options

__all__ = ["CommitInDoubt", "GateInDoubt", "LeaseExpired", "PostgresBackend"]

T = TypeVar("T")
_RUNS_KEPT = 65_536  # operations whose run an outcome's group placement may look up


class PostgresBackend(SqlBackend):
    def __init__(
        self,
        conninfo: str,
        *,
        location: str,
        schema: str | None = None,
        pool_min: int = 1,
        pool_max: int = 10,
        retry_for: float = 10.0,
        group_commit_ms: float = 2.0,
        read_only: bool = False,
    ) -> None:
        self.location = location
        self.read_only = read_only  # nothing created or migrated; every transaction read-only
        self.schema = schema
        self.retry_for = retry_for
        # seconds a new connection (the pool's first too) may take: retry_for, at least
        # libpq's shortest, so a short retry_for never fails an open on a slow server
        self.connect_timeout = max(2, math.ceil(retry_for))
        self.answer_wait = max(ANSWER_FLOOR, retry_for)  # a statement's, then lost (ADR 0061)
        self.dialect = PostgresDialect(None)  # its channel: the ledger's own, read at open
        self.conninfo = conninfo
        # a row another session holds (a stuck transaction, an operator's SELECT ... FOR
        # UPDATE) fails the statement waiting for it, as ``LedgerLocked``, after
        # ``retry_for`` (at least 1 s; 0 would be PostgreSQL's "for ever"): it waited for
        # ever, and every run of the process behind it (one group commit)
        lock = max(1.0, retry_for)
        options = functools.partial(session_options, conninfo, schema, read_only)
        self.connect_kwargs: dict[str, Any] = {
            "autocommit": True,
            "options": options(lock),
            "connect_timeout": self.connect_timeout,  # every new one, the pool's too
        }
        # the group commit's own connection waits for a held row briefly: a longer wait
        # sets the job aside (``postgres_aside``), not every run of the process with it
        group = {**self.connect_kwargs, "options": options(min(lock, GROUP_LOCK_WAIT))}
        self._group_kwargs: dict[str, Any] = group
        self._pool = AsyncConnectionPool(
            conninfo,
            min_size=pool_min,
            max_size=pool_max,
            kwargs=self.connect_kwargs,
            open=False,
            timeout=retry_for,
            name="stopline",
        )
        self._doubts: dict[str, str] = {}  # op id -> gate attempt token, commit in doubt
        self.sessions = Sessions()  # those the doubts went out on: gone before settling
        # op id -> run id of the operations this process gated lately: where an outcome
        # may go in a group transaction (``postgres_batch._stretches``); a miss only
        # keeps the outcome in strict queue order
        self._run_of: dict[str, str] = {}  # in insertion order: the oldest goes first
        self.listener = Listener(self)
        self.own_cancels = OwnCancels()  # what the listener need not hand back
        self.group = GroupCommit(self, group_commit_ms / 1000)

    @classmethod
    async def open(cls, url: str, *, read_only: bool = False) -> PostgresBackend:
        where = redact(url)
        if sniffio.current_async_library() != "asyncio":
            raise LedgerUnavailable(
                where, "the PostgreSQL ledger runs on asyncio (psycopg's async driver)"
            )
        conninfo, options = parse(url, where)
        try:
            backend = cls(conninfo, location=where, read_only=read_only, **options)
        except ValueError as exc:
            raise LedgerUnavailable(where, f"bad option: {exc}") from exc
        try:
            await start(backend)  # bounded: nothing waits for ever (ADR 0064)
        except BaseException:
            await backend.close()
            raise
        return backend

    @property
    def pool(self) -> AsyncConnectionPool:
        return self._pool

    async def connect(self) -> psycopg.AsyncConnection[Any]:
        """A new connection configured as the pool's."""
        return await psycopg.AsyncConnection.connect(self.conninfo, **self.connect_kwargs)

    async def connect_group(self) -> psycopg.AsyncConnection[Any]:
        """The group commit's own connection: the pool's, but a held row is waited for
        ``GROUP_LOCK_WAIT`` at most."""
        return await psycopg.AsyncConnection.connect(self.conninfo, **self._group_kwargs)

    @property
    def doubts(self) -> dict[str, str]:
        """Gates whose commit stayed in doubt: op id -> attempt token."""
        return self._doubts

    async def close(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self.group.close()  # the deferred outcomes commit first
        finally:
            await self._pool.close()

    # -- errors and the retrying transaction --------------------------------------
    def map_error(self, exc: BaseException) -> BaseException:
        """A psycopg error as the ledger's own (the pool's and the LISTEN connection's)."""
        return map_error(self.location, exc, retried_for=self.retry_for)

    async def _tx(
        self,
        body: Callable[[Tx], Awaitable[T]] | Callable[[Db], Awaitable[T]],
        *,
        safe: bool = False,
        settle: Callable[[Tx], Awaitable[Any]] | None = None,
        in_doubt: Callable[[], LedgerError] | None = None,
    ) -> T:
        """Run ``body`` on a pooled connection, retrying what is safe to retry, after
        this process's deferred outcomes (so nothing it does later misses one)."""
        if self.group.unsettled:
            await self.group.barrier()
        return await self.attempts(body, safe=safe, settle=settle, in_doubt=in_doubt)

    async def attempts(
        self,
        body: Callable[[Tx], Awaitable[T]] | Callable[[Db], Awaitable[T]],
        *,
        safe: bool = False,
        settle: Callable[[Tx], Awaitable[Any]] | None = None,
        in_doubt: Callable[[], LedgerError] | None = None,
        doubt: bool = False,
        deadline: float | None = None,
        connection: Lease | None = None,
    ) -> T:
        """``body`` on a pooled connection until it commits or ``deadline`` passes.

        ``safe``: the write is idempotent, run it again even if its commit was in
        doubt. ``settle(tx)``: after a doubt, find out whether it landed (its
        result) or not (``RETRY``). ``in_doubt()``: the error raised when the
        doubt cannot be settled in time. ``doubt``: a commit is in doubt already
        (the group transaction it was part of lost its reply). ``connection``:
        where each attempt takes its connection (the pool's by default; the group
        commit's own for its jobs, where a row another session holds is not waited
        for again: ``RowHeld`` sets the job aside). The wait is shielded, like
        SQLite's writer: a started transaction always finishes and its caller
        learns how; asyncio's own cancels, taken meanwhile, are asked for again.
        """
        with holding() as held, anyio.CancelScope(shield=True):
            args = (connection, body, safe, settle, in_doubt, doubt, deadline, held)
            return await retried(self, *args)
        raise AssertionError("unreachable: a shielded scope swallows nothing")

    async def settle_gate_doubts(self, tx: Tx) -> None:
        """Gates whose commit stayed in doubt (``postgres_settle.settle_gates``)."""
        await settle_gates(self._doubts, self.sessions, tx)

    async def _execute(
        self,
        body: Callable[[Db], Coroutine[Any, Any, T]],
        *,
        safe: bool = False,
        outcome: tuple[str, OutcomeUpdate] | None = None,
        prompt: bool = False,  # a cancel has its own transaction here (``cancel``)
        committed: Callable[[T], None] | None = None,  # its commit returns in the caller
    ) -> T:
        settle = None if outcome is None else outcome_landed(*outcome)
        return await self._tx(body, safe=safe, settle=settle)

    # -- the writes whose lost reply is settled by reading back -----------------------
    def _gated(self, spec: OperationSpec) -> str:
        """Remember the operation's run for its outcomes (the latest ``_RUNS_KEPT``)."""
        runs = self._run_of
        runs[spec.id] = spec.run_id
        if len(runs) > _RUNS_KEPT:
            del runs[next(iter(runs))]
        return spec.run_id

    async def gate(self, spec: OperationSpec) -> GateResult:
        token = attempt_token()

        def in_doubt() -> LedgerError:
            self._doubts[spec.id] = token  # settled on the next transaction that connects
            return GateInDoubt(self.location, spec.id)

        async def alone(doubt: bool, deadline: float, connection: Lease | None) -> GateResult:
            return await self.attempts(
                lambda tx: gate(tx, spec, token),
                settle=gate_landed(spec, token),
                in_doubt=in_doubt,
                doubt=doubt,
                deadline=deadline,
                connection=connection,
            )

        forms = None
        if not spec.compensates and not spec.needs_approval:  # the plain gate, grouped
            forms = gate_forms(*intent_sql(self.dialect, False, False))
        params = functools.partial(gate_params, spec, time.time(), token)
        result: GateResult = await self.group.submit(
            Job(spec.id, alone, forms=forms, params=params, run=self._gated(spec))
        )
        return result

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        return await self.group.submit(self._outcome_job(op_id, update))  # type: ignore[no-any-return]

    defers_outcomes = True  # one process's writes apply in order: the group commit's queue
    bound_to_its_loop = True  # its pool, group commit and listener are the opening loop's

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        self.group.defer(self._outcome_job(op_id, update, then))

    def _outcome_job(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None] | None = None,
    ) -> Job:
        async def alone(doubt: bool, deadline: float, connection: Lease | None) -> OperationRecord:
            return await self.attempts(
                lambda tx: record(tx, op_id, update),
                settle=outcome_landed(op_id, update),
                doubt=doubt,
                deadline=deadline,
                connection=connection,
            )

        params = functools.partial(record_params, op_id, update, time.time())
        forms = outcome_forms(update.event)
        run = self._run_of.get(op_id)
        return Job(op_id, alone, forms=forms, params=params, then=then, run=run)

    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        # idempotent (R7): a retry after a doubt finds it done and says so; the
        # notification went out with the first commit
        def in_doubt() -> LedgerError:
            lost = "the connection was lost after it was sent and the ledger stayed unreachable"
            return CancelInDoubt(self.location, run_id, lost)

        async def body(tx: Tx) -> CancelResult:
            result = await fence.cancel(tx, run_id, by, reason)
            # committed: the caller has these runs; their notification, when it comes
            # back to this backend's listener, is not read or handed on again
            self.own_cancels.add(result.fenced, tx.conn.info.backend_pid)
            return result

        # not behind the deferred outcomes (it reads no operation): the fence goes first
        with self.own_cancels.sending():
            return await self.attempts(body, safe=True, in_doubt=in_doubt)

    # -- writes that read no operation: not behind the deferred outcomes ---------------
    # (a child created or a phase entered waits for no one's outcome; what it writes
    # cannot disagree with one: the group commit keeps their order with the gates)
    async def create_run(self, spec: RunSpec) -> RunRecord:
        return await self.attempts(lambda db: runs.create_run(db, spec), settle=run_landed(spec))

    # each logs an event that a second run would log again: a lost reply is settled by
    # reading back whether the event of this very attempt (its token) is in the log
    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool, by: str) -> None:
        token = attempt_token()
        await self.attempts(
            lambda db: owners.add_owner(db, run_id, owner_run, exclusive, by, token),
            settle=logged(run_id, LogKind.OWNER_ADDED, token, nothing),
        )

    async def leave_to_owners(self, run_id: str, *, cut_by: str) -> list[str]:
        token = attempt_token()  # none left to: nothing logged, and run again is a read
        return await self.attempts(
            lambda db: owners.leave_to_owners(db, run_id, cut_by, token),
            settle=logged(
                run_id, LogKind.LEFT_TO_OWNERS, token, lambda tx: owners.left_to(tx, run_id, token)
            ),
        )

    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None:
        token = attempt_token()
        await self._tx(
            lambda db: ap.audit(db, run_id, principal, action, allowed, detail, token),
            settle=logged(run_id, ap.audit_kind(allowed), token, nothing),
        )

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        token = attempt_token()
        return await self.attempts(
            lambda db: runs.set_phase(db, run_id, kind, policy, token),
            settle=logged(run_id, LogKind.PHASE, token, lambda tx: load_run(tx, run_id)),
        )

    async def _move(
        self, run_id: str, event: RunEvent, by: str, reason: str
    ) -> tuple[RunRecord, bool]:
        def body(db: Db) -> Awaitable[tuple[RunRecord, bool]]:
            return runs.run_event(db, run_id, event, by, reason)

        settle = run_moved(run_id, event)
        prepared = None
        if self.group.unsettled:
            prepared = runs.run_event_batch(self.dialect, run_id, event, by, reason)
        if prepared is None or len(prepared[0]) != 1:  # a group's job is one statement
            return await self._tx(body, settle=settle)

        # outcomes deferred (a run's end after its last call): the move rides their
        # transaction, after them, instead of waiting for it and then committing alone
        async def alone(
            doubt: bool, deadline: float, connection: Lease | None
        ) -> tuple[RunRecord, bool]:
            return await self.attempts(
                body, settle=settle, doubt=doubt, deadline=deadline, connection=connection
            )

        moved: tuple[RunRecord, bool] = await self.group.submit(
            Job(run_id, alone, batch=prepared, run=run_id)
        )
        return moved

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        token = attempt_token()
        return await self._tx(
            lambda tx: begin_compensation(tx, spec, evidence, token),
            settle=gate_landed(spec, token),
        )

    # -- many processes --------------------------------------------------------------
    async def fenced_among(self, run_ids: Sequence[str]) -> list[str]:
        """Those of ``run_ids`` fenced now: what the listener delivers of a notification."""
        # not behind this process's deferred outcomes: a read of other runs' fences
        return await self.attempts(lambda db: reads.fenced_among(db, run_ids), safe=True)

    async def watch_cancels(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        holding: Callable[[str], bool] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.listener.run(on_cancel, holding=holding, task_status=task_status)
