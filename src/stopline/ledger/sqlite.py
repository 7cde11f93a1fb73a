"""The embedded SQLite ledger: WAL, ``synchronous=FULL``, one writer thread.

Every public method is one transaction, written as ``_x_txn(conn, ...)``
running on the writer thread, with the async method a thin wrapper. Two
processes on one file are safe: each transaction starts with
``BEGIN IMMEDIATE`` under a busy timeout, so writers queue instead of racing.
Storage errors are mapped to the ledger's own errors here, at the boundary,
each naming the file and the cause.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stopline.domain.lifecycle import ApprovalRecord, CancelResult, Checkpoint
from stopline.domain.model import EventRecord, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.transitions import OPERATION_TABLE, RUN_TABLE, apply
from stopline.domain.vocab import Grant, OpEvent, OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import (
    IllegalTransition,
    LedgerError,
    LedgerReadOnly,
    LedgerUnavailable,
    SchemaTooNew,
    StoplineError,
    UnknownOperation,
    UnknownRun,
)
from stopline.ledger import rows
from stopline.ledger import sqlite_lifecycle as lc
from stopline.ledger import sqlite_truth as tt
from stopline.ledger._writer import Writer
from stopline.ledger.backend import Backend, GateResult, GateVerdict, OutcomeUpdate, RunSpec
from stopline.ledger.leases import WorkerLease
from stopline.ledger.schema import (
    DEFAULT_UNRESOLVED,
    MIGRATIONS,
    OPEN_STATUSES,
    OPEN_STATUSES_SQL,
    SCHEMA_VERSION,
    check_readable,
    refuse_foreign,
)
from stopline.ledger.sqlite_errors import OS_ERRORS, sqlite_error

__all__ = ["SQLiteBackend"]

T = TypeVar("T")

_GATE_SQL = f"""
INSERT OR IGNORE INTO operations ({rows.OP_COLUMNS})
SELECT ?, id, ?, ?, ?, 'requested', ?, ?, ?, 'none', 1, NULL, 0, NULL, NULL, ?, ?, ?, ?, ?
FROM runs WHERE id = ? AND state = 'running' AND (grants & {int(Grant.INITIATE)}) != 0
"""
# A compensation passes under the `compensate` grant, which cancel keeps (R7, S8).
_GATE_COMPENSATION_SQL = f"""
INSERT OR IGNORE INTO operations ({rows.OP_COLUMNS})
SELECT ?, id, ?, ?, ?, 'requested', ?, ?, ?, 'none', 1, NULL, 0, NULL, NULL, ?, ?, ?, ?, ?
FROM runs WHERE id = ? AND state NOT IN ('pausing', 'paused')
    AND (grants & {int(Grant.COMPENSATE)}) != 0
"""
# An operation that needs approval passes only with a granted, unexpired one (S5).
_GATE_APPROVED_SQL = (
    _GATE_SQL.strip()
    + """
    AND EXISTS (SELECT 1 FROM approvals a WHERE a.run_id = runs.id AND a.scope = ?
        AND a.status = 'granted' AND (a.expires_at IS NULL OR a.expires_at > ?))"""
)
_GATE_EVENT_SQL = """
INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data)
SELECT ?, id, ?, 'gate_passed', 'not_started', 'requested', '{"fence":' || fence || '}'
FROM runs WHERE id = ?
"""
_GATE_EVIDENCE = rows.dump_evidence([Evidence.local("gate", "intent recorded before dispatch")])
# What a gate may dispatch again under the same id: it provably never happened
# (not_committed), or the fence stopped it and the run was since resumed (prevented).
_RETRYABLE = frozenset({OpStatus.NOT_COMMITTED, OpStatus.PREVENTED})
_FENCED_STATES = frozenset(
    {RunState.CANCELLING, RunState.SETTLING, RunState.CANCELLED, RunState.NEEDS_REVIEW}
)


class SQLiteBackend(Backend):
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        busy_timeout: float = 10.0,
        group_commit: float = 0.002,
        read_only: bool = False,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise LedgerUnavailable(f"sqlite:///{path}", f"synchronous={synchronous} is unsafe")
        self.path = Path(path)
        self.location = f"sqlite:///{self.path}"
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
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

    @classmethod
    async def open(cls, path: str | os.PathLike[str], **options: Any) -> SQLiteBackend:
        import anyio

        backend = cls(path, **options)
        await anyio.to_thread.run_sync(backend._writer.start)
        return backend

    # -- connection and errors ---------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if not self.path.parent.exists():
            raise LedgerUnavailable(self.location, f"directory {self.path.parent} does not exist")
        if self.read_only and not self.path.is_file():
            raise LedgerUnavailable(self.location, "no ledger file there")
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
            version, tables = _identity(conn)  # a read: refuse a foreign file before any write
            if self.read_only:
                check_readable(self.location, version, tables)
                return conn
            refuse_foreign(self.location, version, tables)
            self._when_unlocked(lambda: self._set_wal(conn))
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
            self._when_unlocked(lambda: self._migrate(conn))
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
        err.__cause__ = exc
        return err

    async def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._writer.submit(fn)

    async def close(self) -> None:
        await self._writer.close()

    # -- runs ----------------------------------------------------------------
    async def create_run(self, spec: RunSpec) -> RunRecord:
        def txn(conn: sqlite3.Connection) -> RunRecord:
            now = time.time()
            state = RunState.RUNNING
            grants = spec.grants
            if spec.parent_id is not None:
                parent = _run(conn, spec.parent_id)
                if not parent.grants & Grant.INITIATE:
                    grants &= ~Grant.INITIATE  # born fenced
                    state = RunState.CANCELLING
            conn.execute(
                f"INSERT INTO runs ({rows.RUN_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, 0, ?, NULL, ?, ?, ?, NULL, NULL, NULL)",
                (
                    spec.id,
                    spec.name,
                    spec.owner,
                    spec.tenant,
                    spec.parent_id,
                    state.value,
                    int(grants),
                    spec.policy.value,
                    now,
                    now,
                ),
            )
            if spec.parent_id is not None:
                conn.execute(
                    "INSERT INTO run_owners (run_id, owner_run, exclusive, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (spec.id, spec.parent_id, int(not spec.shared), now),
                )
            _event(
                conn,
                now,
                spec.id,
                None,
                "run_created",
                None,
                state.value,
                {"owner": spec.owner, "tenant": spec.tenant, "parent": spec.parent_id},
            )
            return _run(conn, spec.id)

        return await self._tx(txn)

    async def run_event(
        self,
        run_id: str,
        event: RunEvent,
        *,
        by: str,
        reason: str = "",
    ) -> tuple[RunRecord, bool]:
        def txn(conn: sqlite3.Connection) -> tuple[RunRecord, bool]:
            run = _run(conn, run_id)
            now = time.time()
            if event is RunEvent.CANCEL:  # one mechanism: the subtree fence
                result = lc.cancel_txn(conn, run_id, by, reason)
                return result.run, result.first
            target = apply(RUN_TABLE, run.state, event)
            conn.execute(
                "UPDATE runs SET state = ?, updated_at = ? WHERE id = ? AND state = ?",
                (target.value, now, run_id, run.state.value),
            )
            _event(
                conn,
                now,
                run_id,
                None,
                event.value,
                run.state.value,
                target.value,
                {"by": by, "reason": reason},
            )
            return _run(conn, run_id), True

        return await self._tx(txn)

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        def txn(conn: sqlite3.Connection) -> RunRecord:
            now = time.time()
            changed = conn.execute(
                "UPDATE runs SET phase = ?, policy = ?, updated_at = ? WHERE id = ?",
                (kind.value, policy.value, now, run_id),
            ).rowcount
            if not changed:
                raise UnknownRun(run_id)
            _event(
                conn,
                now,
                run_id,
                None,
                "phase",
                None,
                None,
                {"phase": kind.value, "policy": policy.value},
            )
            return _run(conn, run_id)

        return await self._tx(txn)

    async def get_run(self, run_id: str) -> RunRecord:
        return await self._tx(lambda conn: _run(conn, run_id))

    async def list_runs(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        sql, params = rows.list_runs_query(state, owner, limit, "?")

        def txn(conn: sqlite3.Connection) -> list[RunRecord]:
            return [rows.run_from_row(r) for r in conn.execute(sql, params)]

        return await self._tx(txn)

    # -- operations ----------------------------------------------------------
    async def gate(self, spec: OperationSpec) -> GateResult:
        return await self._tx(lambda conn: _gate_txn(conn, spec))

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        # an outcome, once asked for, is written even if its caller is cancelled meanwhile
        return await self._writer.submit(
            lambda conn: _record_txn(conn, op_id, update), must_run=True
        )

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        def txn(conn: sqlite3.Connection) -> list[OperationRecord | IllegalTransition]:
            out: list[OperationRecord | IllegalTransition] = []
            now = time.time()  # one instant: the records of one transaction
            for op_id, update in items:
                try:  # an illegal transition is refused before anything is written
                    out.append(_record_txn(conn, op_id, update, now))
                except IllegalTransition as exc:
                    out.append(exc)
            return out

        return await self._tx(txn)

    defers_outcomes = True  # one writer thread, first in first out

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        self._writer.enqueue(lambda conn: _record_txn(conn, op_id, update), then)

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        def txn(conn: sqlite3.Connection) -> OperationRecord:
            op = _op(conn, op_id)
            now = time.time()
            if cancel_state is not None:
                conn.execute(
                    "UPDATE operations SET cancel_state = ?, updated_at = ? WHERE id = ?",
                    (cancel_state, now, op_id),
                )
            _event(conn, now, op.run_id, op_id, kind, op.status.value, op.status.value, data)
            return _op(conn, op_id)

        return await self._tx(txn)

    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        def txn(conn: sqlite3.Connection) -> list[OperationRecord]:
            _run(conn, run_id)
            if not descendants:
                sql = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE run_id = ? ORDER BY rowid"
                return [rows.op_from_row(r) for r in conn.execute(sql, (run_id,))]
            sql = (
                "WITH RECURSIVE tree(id) AS (SELECT ? UNION"
                " SELECT o.run_id FROM run_owners o JOIN tree ON o.owner_run = tree.id"
                # exclusive ownership is never released; saying so lets the partial index serve
                " WHERE o.exclusive = 1 AND o.released_at IS NULL)"
                f" SELECT {rows.OP_COLUMNS} FROM operations"
                " WHERE run_id IN (SELECT id FROM tree) ORDER BY created_at, rowid"
            )
            return [rows.op_from_row(r) for r in conn.execute(sql, (run_id,))]

        return await self._tx(txn)

    async def get_operation(self, op_id: str) -> OperationRecord:
        return await self._tx(lambda conn: _op(conn, op_id))

    async def events(self, run_id: str) -> list[EventRecord]:
        def txn(conn: sqlite3.Connection) -> list[EventRecord]:
            _run(conn, run_id)
            sql = "SELECT * FROM events WHERE run_id = ? ORDER BY seq"
            return [rows.event_from_row(r) for r in conn.execute(sql, (run_id,))]

        return await self._tx(txn)

    async def unresolved(
        self, limit: int = 10_000, statuses: Collection[OpStatus] | None = None
    ) -> list[OperationRecord]:
        wanted = _wanted_open_statuses(statuses)
        marks = ", ".join("?" * len(wanted))
        # the index's own condition must appear verbatim for SQLite to use it
        sql = (
            f"SELECT {rows.OP_COLUMNS} FROM operations INDEXED BY ops_open "
            f"WHERE status IN ({OPEN_STATUSES_SQL}) AND status IN ({marks}) LIMIT ?"
        )
        return await self._tx(
            lambda conn: [rows.op_from_row(r) for r in conn.execute(sql, (*wanted, limit))]
        )

    # -- lifecycle (ownership, pause, approvals, checkpoints) ---------------------
    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        return await self._tx(lambda conn: lc.cancel_txn(conn, run_id, by, reason))

    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool) -> None:
        await self._tx(lambda conn: lc.add_owner_txn(conn, run_id, owner_run, exclusive))

    async def pause(self, run_id: str, *, by: str, reason: str = "") -> list[str]:
        return await self._tx(lambda conn: lc.pause_txn(conn, run_id, by, reason))

    async def settle_pause(self, run_id: str) -> RunRecord:
        return await self._tx(lambda conn: lc.settle_pause_txn(conn, run_id))

    async def resume(self, run_id: str, *, by: str) -> tuple[RunRecord, list[str]]:
        return await self._tx(lambda conn: lc.resume_txn(conn, run_id, by))

    async def request_approval(
        self, approval_id: str, run_id: str, scope: str, *, approver: str, requested_by: str
    ) -> ApprovalRecord:
        return await self._tx(
            lambda conn: lc.request_approval_txn(
                conn, approval_id, run_id, scope, approver, requested_by
            )
        )

    async def decide_approval(
        self, approval_id: str, *, granted: bool, by: str, expires_at: float | None
    ) -> ApprovalRecord:
        return await self._tx(
            lambda conn: lc.decide_approval_txn(conn, approval_id, granted, by, expires_at)
        )

    async def approvals(self, run_id: str) -> list[ApprovalRecord]:
        return await self._tx(lambda conn: lc.approvals_txn(conn, run_id))

    async def get_approval(self, approval_id: str) -> ApprovalRecord:
        return await self._tx(lambda conn: lc.load_approval(conn, approval_id))

    async def checkpoint(self, run_id: str, name: str, state: Any) -> Checkpoint:
        return await self._tx(lambda conn: lc.checkpoint_txn(conn, run_id, name, state))

    async def last_checkpoint(self, run_id: str) -> Checkpoint | None:
        return await self._tx(lambda conn: lc.last_checkpoint_txn(conn, run_id))

    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None:
        await self._tx(lambda conn: lc.audit_txn(conn, run_id, principal, action, allowed, detail))

    # -- truth (reconciliation, compensation, review, recovery) -------------------
    async def heartbeat(self, worker: str, *, host: str, pid: int, lease_until: float) -> None:
        await self._tx(lambda conn: tt.heartbeat_txn(conn, worker, host, pid, lease_until))

    async def in_flight_workers(self) -> list[WorkerLease]:
        return await self._tx(tt.in_flight_workers_txn)

    async def recover_orphans(
        self, workers: Collection[str], evidence: Sequence[Evidence]
    ) -> list[OperationRecord]:
        return await self._tx(lambda conn: tt.recover_orphans_txn(conn, workers, evidence))

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        return await self._tx(lambda conn: tt.begin_compensation_txn(conn, spec, evidence))

    async def compensations(self, op_id: str) -> list[OperationRecord]:
        return await self._tx(lambda conn: tt.compensations_txn(conn, op_id))


def _wanted_open_statuses(statuses: Collection[OpStatus] | None) -> list[str]:
    chosen = DEFAULT_UNRESOLVED if statuses is None else frozenset(statuses)
    if not chosen <= OPEN_STATUSES:
        raise ValueError(f"not open statuses: {sorted(s.value for s in chosen - OPEN_STATUSES)}")
    return sorted(s.value for s in chosen)


# -- transaction bodies (run on the writer thread) ----------------------------
def _identity(conn: sqlite3.Connection) -> tuple[int, int]:
    """The schema version recorded in the file and how many tables it has (a read)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
    return int(version), int(tables)


def _run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    row = conn.execute(f"SELECT {rows.RUN_COLUMNS} FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise UnknownRun(run_id)
    return rows.run_from_row(row)


def _op(conn: sqlite3.Connection, op_id: str) -> OperationRecord:
    sql = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = ?"
    row = conn.execute(sql, (op_id,)).fetchone()
    if row is None:
        raise UnknownOperation(op_id)
    return rows.op_from_row(row)


def _event(
    conn: sqlite3.Connection,
    at: float,
    run_id: str,
    op_id: str | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    data: dict[str, Any],
) -> None:
    conn.execute(
        "INSERT INTO events (at, run_id, op_id, kind, from_state, to_state, data) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (at, run_id, op_id, kind, from_state, to_state, rows.dump_data(data)),
    )


def _gate_txn(conn: sqlite3.Connection, spec: OperationSpec) -> GateResult:
    now = time.time()
    params: tuple[Any, ...] = (
        spec.id,
        spec.tool,
        spec.description,
        spec.args_digest,
        spec.cancellable.value,
        int(spec.can_verify),
        int(spec.can_compensate),
        _GATE_EVIDENCE,
        now,
        now,
        spec.compensates,
        spec.worker,
        spec.run_id,
    )
    if spec.compensates:
        sql = _GATE_COMPENSATION_SQL
    elif spec.needs_approval:
        sql, params = _GATE_APPROVED_SQL, (*params, spec.id, now)
    else:
        sql = _GATE_SQL
    if conn.execute(sql, params).rowcount == 1:
        conn.execute(_GATE_EVENT_SQL, (now, spec.id, spec.run_id))
        return GateResult(GateVerdict.PASSED)
    return _gate_slow_path(conn, spec, now)


def _gate_slow_path(conn: sqlite3.Connection, spec: OperationSpec, now: float) -> GateResult:
    """The id exists, the run is missing, or the run may not initiate."""
    from stopline.errors import IdempotencyConflict

    run = _run(conn, spec.run_id)
    sql = f"SELECT {rows.OP_COLUMNS} FROM operations WHERE id = ?"
    row = conn.execute(sql, (spec.id,)).fetchone()
    may_initiate = run.state is RunState.RUNNING and bool(run.grants & Grant.INITIATE)
    if row is not None:
        existing = rows.op_from_row(row)
        if existing.args_digest != spec.args_digest or existing.run_id != spec.run_id:
            raise IdempotencyConflict(spec.id)
        if existing.status in _RETRYABLE and may_initiate:
            # a retry with the same key: the earlier attempt provably did not commit
            target = apply(OPERATION_TABLE, existing.status, OpEvent.GATE_PASSED)
            conn.execute(
                "UPDATE operations SET status = ?, attempts = attempts + 1, cancel_state = 'none',"
                " updated_at = ?, worker = ? WHERE id = ? AND status = ?",  # this attempt's worker
                (target.value, now, spec.worker, spec.id, existing.status.value),
            )
            _event(
                conn,
                now,
                spec.run_id,
                spec.id,
                OpEvent.GATE_PASSED.value,
                existing.status.value,
                target.value,
                {"fence": run.fence, "retry": True},
            )
            return GateResult(GateVerdict.PASSED, fence=run.fence)
        if existing.status is OpStatus.NOT_COMMITTED and run.state in _FENCED_STATES:
            # R1: a retry timer or redelivery after the fence; the attempt is refused
            _event(
                conn,
                now,
                spec.run_id,
                spec.id,
                OpEvent.GATE_REFUSED.value,
                existing.status.value,
                existing.status.value,
                {"fence": run.fence, "retry": True, "run_state": run.state.value},
            )
            return GateResult(GateVerdict.PREVENTED, existing, run.fence)
        return GateResult(GateVerdict.EXISTING, existing, run.fence)
    if run.state in (RunState.PAUSING, RunState.PAUSED):
        lc.settle_pause_txn(conn, run.id)  # a worker waiting at the gate is idle
        return GateResult(GateVerdict.PAUSED, fence=run.fence)
    if may_initiate and spec.needs_approval:
        return GateResult(GateVerdict.NEEDS_APPROVAL, fence=run.fence)
    evidence = [Evidence.local(f"fence:{run.fence}", f"run {run.state.value}; initiate revoked")]
    conn.execute(
        f"INSERT INTO operations ({rows.OP_COLUMNS}) VALUES "
        "(?, ?, ?, ?, ?, 'prevented', ?, ?, ?, 'none', 0, NULL, 0, NULL, NULL, ?, ?, ?, ?, ?)",
        (
            spec.id,
            spec.run_id,
            spec.tool,
            spec.description,
            spec.args_digest,
            spec.cancellable.value,
            int(spec.can_verify),
            int(spec.can_compensate),
            rows.dump_evidence(evidence),
            now,
            now,
            spec.compensates,
            spec.worker,
        ),
    )
    _event(
        conn,
        now,
        spec.run_id,
        spec.id,
        OpEvent.GATE_REFUSED.value,
        "not_started",
        "prevented",
        {"fence": run.fence, "run_state": run.state.value},
    )
    return GateResult(GateVerdict.PREVENTED, _op(conn, spec.id), run.fence)


def _record_txn(
    conn: sqlite3.Connection, op_id: str, update: OutcomeUpdate, now: float | None = None
) -> OperationRecord:
    row = conn.execute("SELECT status, run_id FROM operations WHERE id = ?", (op_id,)).fetchone()
    if row is None:
        raise UnknownOperation(op_id)
    source = OpStatus(row[0])
    target = apply(OPERATION_TABLE, source, update.event)
    now = time.time() if now is None else now
    result_text, has_result = rows.dump_result(update.result, update.has_result)
    items = [rows.dump_data(e.to_json()) for e in update.evidence]
    appended = _append_evidence_sql(len(items))
    updated = conn.execute(
        f"UPDATE operations SET status = ?, evidence = {appended}, updated_at = ?,"
        " cause = COALESCE(?, cause), error = COALESCE(?, error),"
        " result = CASE WHEN ? THEN ? ELSE result END,"
        " has_result = CASE WHEN ? THEN 1 ELSE has_result END,"
        " cancel_state = COALESCE(?, cancel_state)"
        f" WHERE id = ? AND status = ? RETURNING {rows.OP_COLUMNS}",
        (
            target.value,
            *items,
            now,
            update.cause.value if update.cause else None,
            update.error,
            has_result,
            result_text,
            has_result,
            update.cancel_state,
            op_id,
            source.value,
        ),
    ).fetchone()
    data: dict[str, Any] = {"evidence": [e.to_json() for e in update.evidence]}
    if update.cause is not None:
        data["cause"] = update.cause.value
    if update.error is not None:
        data["error"] = update.error
    if update.late:
        data["late"] = True
    _event(conn, now, row[1], op_id, update.event.value, source.value, target.value, data)
    return rows.op_from_row(updated)


@functools.cache
def _append_evidence_sql(count: int) -> str:
    """``json_insert`` appending ``count`` items: no read-modify-write of the array in Python."""
    if count == 0:
        return "evidence"
    pairs = ", ".join(["'$[#]', json(?)"] * count)
    return f"json_insert(evidence, {pairs})"
