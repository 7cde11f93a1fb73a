"""The shared PostgreSQL ledger: many workers on many hosts, one contract.

``postgresql://user@host:5432/db?schema=NAME`` opens it (psycopg 3, async, a
connection pool; asyncio only, as psycopg's async driver is). Besides libpq's
own parameters the URL takes ``schema`` (created if missing; the ledger's
tables live there), ``pool_min``/``pool_max`` and ``retry_for`` (seconds a
transaction is retried across connection loss or failover, default 10).

Every public method is one transaction body (the gate in ``postgres_txn``,
runs and outcomes in ``postgres_runs``, then ``postgres_lifecycle`` and
``postgres_truth``) run by ``_tx``, which maps storage errors at this
boundary (``postgres_errors``) and decides what a failure means:

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

import re
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
import psycopg
import psycopg.errors
import sniffio
from psycopg_pool import AsyncConnectionPool

from stopline.domain.lifecycle import ApprovalRecord, CancelResult, Checkpoint
from stopline.domain.model import EventRecord, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.transitions import OPERATION_TABLE, apply
from stopline.domain.vocab import Cause, OpEvent, OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import (
    CancelInDoubt,
    IllegalTransition,
    LedgerError,
    LedgerUnavailable,
    StoplineError,
)
from stopline.ledger import postgres_lifecycle as lc
from stopline.ledger import postgres_runs as pr
from stopline.ledger import postgres_truth as tt
from stopline.ledger.backend import Backend, GateResult, GateVerdict, OutcomeUpdate, RunSpec
from stopline.ledger.leases import WorkerLease
from stopline.ledger.postgres_errors import (
    CommitInDoubt,
    GateInDoubt,
    LeaseExpired,
    connection_lost,
    map_error,
    redact,
    transient,
)
from stopline.ledger.postgres_listen import Listener
from stopline.ledger.postgres_schema import check, migrate
from stopline.ledger.postgres_txn import Tx, events_of, gate_committed, gate_txn, load_op, load_run
from stopline.ledger.schema import OPEN_STATUSES

__all__ = ["CommitInDoubt", "GateInDoubt", "LeaseExpired", "PostgresBackend"]

T = TypeVar("T")
_OWN_OPTIONS = frozenset({"schema", "pool_min", "pool_max", "retry_for"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")
_RETRY = object()  # a settle function's answer: the write did not land, run it again


class PostgresBackend(Backend):
    def __init__(
        self,
        conninfo: str,
        *,
        location: str,
        schema: str | None = None,
        pool_min: int = 1,
        pool_max: int = 10,
        retry_for: float = 10.0,
        read_only: bool = False,
    ) -> None:
        self.location = location
        self.read_only = read_only  # nothing created or migrated; every transaction read-only
        self.schema = schema
        self.retry_for = retry_for
        self.channel = "stopline_cancel" + (f"_{schema}" if schema else "")
        self._conninfo = conninfo
        self._kwargs: dict[str, Any] = {"autocommit": True}
        options = [f"-c search_path={schema}"] if schema else []
        if read_only:
            options.append("-c default_transaction_read_only=on")
        if options:
            self._kwargs["options"] = " ".join(options)
        self._pool = AsyncConnectionPool(
            conninfo,
            min_size=pool_min,
            max_size=pool_max,
            kwargs=self._kwargs,
            open=False,
            timeout=retry_for,
            name="stopline",
        )
        self._doubts: dict[str, str] = {}  # op id -> gate attempt token, commit in doubt
        self.listener = Listener(self)

    @classmethod
    async def open(cls, url: str, *, read_only: bool = False) -> PostgresBackend:
        if sniffio.current_async_library() != "asyncio":
            raise LedgerUnavailable(
                redact(url), "the PostgreSQL ledger runs on asyncio (psycopg's async driver)"
            )
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qsl(parts.query)
        own = {k: v for k, v in query if k in _OWN_OPTIONS}
        libpq = [(k, v) for k, v in query if k not in _OWN_OPTIONS]
        scheme = "postgresql"
        conninfo = urllib.parse.urlunsplit(
            (scheme, parts.netloc, parts.path, urllib.parse.urlencode(libpq), "")
        )
        schema = own.get("schema")
        if schema is not None and not _IDENT.fullmatch(schema):
            raise LedgerUnavailable(redact(url), f"schema {schema!r} is not a plain identifier")
        try:
            backend = cls(
                conninfo,
                location=redact(url),
                schema=schema,
                pool_min=int(own.get("pool_min", 1)),
                pool_max=int(own.get("pool_max", 10)),
                retry_for=float(own.get("retry_for", 10.0)),
                read_only=read_only,
            )
        except ValueError as exc:
            raise LedgerUnavailable(redact(url), f"bad option: {exc}") from exc
        try:
            await backend._start()
        except BaseException:
            await backend.close()
            raise
        return backend

    async def _start(self) -> None:
        try:
            # the schema must exist before pooled connections put it on their search path
            async with await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, connect_timeout=max(2, int(self.retry_for))
            ) as conn:
                start = check if self.read_only else migrate
                await start(Tx(conn, self.location), self.schema)
            await self._pool.open(wait=True, timeout=self.retry_for)
        except StoplineError:
            raise
        except (psycopg.Error, OSError) as exc:
            raise self._map(exc) from exc

    async def close(self) -> None:
        await self._pool.close()

    # -- errors and the retrying transaction --------------------------------------
    def _map(self, exc: BaseException) -> BaseException:
        return map_error(self.location, exc, retried_for=self.retry_for)

    async def _tx(
        self,
        body: Callable[[Tx], Awaitable[T]],
        *,
        safe: bool = False,
        settle: Callable[[Tx], Awaitable[Any]] | None = None,
        in_doubt: Callable[[], LedgerError] | None = None,
    ) -> T:
        """Run ``body`` on a pooled connection, retrying what is safe to retry.

        ``safe``: the write is idempotent, run it again even if its commit was in
        doubt. ``settle(tx)``: after a doubt, find out whether it landed (its
        result) or not (``_RETRY``). ``in_doubt()``: the error raised when the
        doubt cannot be settled in time. The wait is shielded, like SQLite's
        writer: a started transaction always finishes and its caller learns how.
        """
        with anyio.CancelScope(shield=True):
            deadline = time.monotonic() + self.retry_for
            delay = 0.005
            doubt = False
            while True:
                tx: Tx | None = None
                try:
                    async with self._pool.connection() as conn:
                        tx = Tx(conn, self.location)
                        if self._doubts:
                            await self._settle_gate_doubts(tx)
                        if doubt and settle is not None:
                            landed = await settle(tx)
                            if landed is not _RETRY:
                                return landed  # type: ignore[no-any-return]
                        doubt = False
                        return await body(tx)
                except (psycopg.Error, OSError) as exc:
                    now_in_doubt = tx is not None and tx.in_doubt and connection_lost(exc)
                    if now_in_doubt and not safe and settle is None:
                        raise CommitInDoubt(self.location, f"commit in doubt: {exc}") from exc
                    doubt = doubt or now_in_doubt
                    if not transient(exc) or time.monotonic() >= deadline:
                        if doubt and (not safe or in_doubt is not None):
                            raise (in_doubt() if in_doubt else CommitInDoubt(
                                self.location, f"commit in doubt: {exc}"
                            )) from exc  # fmt: skip
                        raise self._map(exc) from exc
                await anyio.sleep(delay)  # back off before the next attempt
                delay = min(delay * 2, 0.25)
        raise AssertionError("unreachable: a shielded scope swallows nothing")

    async def _settle_gate_doubts(self, tx: Tx) -> None:
        """Gates whose commit stayed in doubt: what landed was never sent, so ``unknown``.

        Single-flight: a transaction takes a doubt out of the map before settling it,
        so two concurrent ones never settle (or forget) the same one twice; a doubt
        whose settling fails goes back for the next transaction."""
        for op_id in list(self._doubts):
            token = self._doubts.pop(op_id, None)
            if token is None:
                continue  # another transaction took it meanwhile
            try:
                if await gate_committed(tx, op_id, token) is not None:
                    op = await load_op(tx, op_id)
                    if op.status is OpStatus.REQUESTED:
                        evidence = [
                            Evidence.local(
                                "gate_in_doubt", "intent commit in doubt; not dispatched"
                            )
                        ]
                        update = OutcomeUpdate(OpEvent.LOST, evidence, cause=Cause.TRANSPORT)
                        await pr.record_txn(tx, op_id, update)
            except BaseException:
                self._doubts.setdefault(op_id, token)
                raise

    async def _atomic(self, body: Callable[[Tx], Awaitable[T]], *, safe: bool = False) -> T:
        async def txn(tx: Tx) -> T:
            async with tx.transaction():
                return await body(tx)

        return await self._tx(txn, safe=safe)

    # -- runs ----------------------------------------------------------------
    async def create_run(self, spec: RunSpec) -> RunRecord:
        return await self._atomic(lambda tx: pr.create_run_txn(tx, spec))

    async def run_event(
        self, run_id: str, event: RunEvent, *, by: str, reason: str = ""
    ) -> tuple[RunRecord, bool]:
        if event is RunEvent.CANCEL:  # one mechanism: the subtree fence
            result = await self.cancel(run_id, by=by, reason=reason)
            return result.run, result.first
        return await self._atomic(lambda tx: pr.run_event_txn(tx, run_id, event, by, reason))

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        return await self._atomic(lambda tx: pr.set_phase_txn(tx, run_id, kind, policy), safe=True)

    async def get_run(self, run_id: str) -> RunRecord:
        return await self._tx(lambda tx: load_run(tx, run_id), safe=True)

    async def list_runs(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return await self._tx(lambda tx: pr.list_runs_txn(tx, state, owner, limit), safe=True)

    # -- operations ----------------------------------------------------------
    async def gate(self, spec: OperationSpec) -> GateResult:
        token = uuid.uuid4().hex

        async def settle(tx: Tx) -> Any:
            fence = await gate_committed(tx, spec.id, token)
            return _RETRY if fence is None else GateResult(GateVerdict.PASSED, fence=fence)

        def in_doubt() -> LedgerError:
            self._doubts[spec.id] = token  # settled on the next transaction that connects
            return GateInDoubt(self.location, spec.id)

        return await self._tx(
            lambda tx: gate_txn(tx, spec, token), settle=settle, in_doubt=in_doubt
        )

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        async def settle(tx: Tx) -> Any:
            op = await load_op(tx, op_id)
            try:
                apply(OPERATION_TABLE, op.status, update.event)
            except IllegalTransition:
                return op  # the status moved on: the write landed
            return _RETRY

        return await self._tx(lambda tx: pr.record_txn(tx, op_id, update), settle=settle)

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        return await self._atomic(lambda tx: pr.note_txn(tx, op_id, kind, data, cancel_state))

    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        return await self._tx(lambda tx: pr.operations_txn(tx, run_id, descendants), safe=True)

    async def get_operation(self, op_id: str) -> OperationRecord:
        return await self._tx(lambda tx: load_op(tx, op_id), safe=True)

    async def events(self, run_id: str) -> list[EventRecord]:
        return await self._tx(lambda tx: events_of(tx, run_id), safe=True)

    async def unresolved(
        self, limit: int = 10_000, statuses: Collection[OpStatus] | None = None
    ) -> list[OperationRecord]:
        if statuses is not None and not frozenset(statuses) <= OPEN_STATUSES:
            bad = sorted(s.value for s in frozenset(statuses) - OPEN_STATUSES)
            raise ValueError(f"not open statuses: {bad}")  # before any connection
        return await self._tx(lambda tx: pr.unresolved_txn(tx, limit, statuses), safe=True)

    # -- lifecycle -----------------------------------------------------------------
    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        # idempotent (R7): a retry after a doubt finds it done and says so; the
        # notification went out with the first commit
        async def txn(tx: Tx) -> CancelResult:
            async with tx.transaction():
                return await lc.cancel_txn(tx, run_id, by, reason, self.channel)

        def in_doubt() -> LedgerError:
            lost = "the connection was lost after it was sent and the ledger stayed unreachable"
            return CancelInDoubt(self.location, run_id, lost)

        return await self._tx(txn, safe=True, in_doubt=in_doubt)

    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool) -> None:
        await self._atomic(lambda tx: lc.add_owner_txn(tx, run_id, owner_run, exclusive), safe=True)

    async def pause(self, run_id: str, *, by: str, reason: str = "") -> list[str]:
        return await self._atomic(lambda tx: lc.pause_txn(tx, run_id, by, reason))

    async def settle_pause(self, run_id: str) -> RunRecord:
        return await self._atomic(lambda tx: lc.settle_pause_txn(tx, run_id), safe=True)

    async def resume(self, run_id: str, *, by: str) -> tuple[RunRecord, list[str]]:
        return await self._atomic(lambda tx: lc.resume_txn(tx, run_id, by))

    async def request_approval(
        self, approval_id: str, run_id: str, scope: str, *, approver: str, requested_by: str
    ) -> ApprovalRecord:
        return await self._atomic(
            lambda tx: lc.request_approval_txn(
                tx, approval_id, run_id, scope, approver, requested_by
            )
        )

    async def decide_approval(
        self, approval_id: str, *, granted: bool, by: str, expires_at: float | None
    ) -> ApprovalRecord:
        return await self._atomic(
            lambda tx: lc.decide_approval_txn(tx, approval_id, granted, by, expires_at)
        )

    async def approvals(self, run_id: str) -> list[ApprovalRecord]:
        return await self._tx(lambda tx: lc.approvals_txn(tx, run_id), safe=True)

    async def get_approval(self, approval_id: str) -> ApprovalRecord:
        return await self._tx(lambda tx: lc.load_approval(tx, approval_id), safe=True)

    async def checkpoint(self, run_id: str, name: str, state: Any) -> Checkpoint:
        return await self._atomic(lambda tx: lc.checkpoint_txn(tx, run_id, name, state))

    async def last_checkpoint(self, run_id: str) -> Checkpoint | None:
        return await self._tx(lambda tx: lc.last_checkpoint_txn(tx, run_id), safe=True)

    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None:
        # one appended line: repeated after a lost reply at worst, never lost
        await self._tx(
            lambda tx: lc.audit_txn(tx, run_id, principal, action, allowed, detail), safe=True
        )

    # -- truth -----------------------------------------------------------------------
    async def heartbeat(self, worker: str, *, host: str, pid: int, lease_until: float) -> None:
        await self._tx(lambda tx: tt.heartbeat_txn(tx, worker, host, pid, lease_until), safe=True)

    async def in_flight_workers(self) -> list[WorkerLease]:
        return await self._tx(tt.in_flight_workers_txn, safe=True)

    async def recover_orphans(
        self, workers: Collection[str], evidence: Sequence[Evidence]
    ) -> list[OperationRecord]:
        # a retry finds nothing left to mark: the first attempt's marks stand
        return await self._tx(lambda tx: tt.recover_orphans_txn(tx, workers, evidence), safe=True)

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        token = uuid.uuid4().hex

        async def settle(tx: Tx) -> Any:
            fence = await gate_committed(tx, spec.id, token)
            return _RETRY if fence is None else GateResult(GateVerdict.PASSED, fence=fence)

        return await self._tx(
            lambda tx: tt.begin_compensation_txn(tx, spec, evidence, token), settle=settle
        )

    async def compensations(self, op_id: str) -> list[OperationRecord]:
        return await self._tx(lambda tx: tt.compensations_txn(tx, op_id), safe=True)

    # -- many processes --------------------------------------------------------------
    async def watch_cancels(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.listener.run(on_cancel, task_status=task_status)
