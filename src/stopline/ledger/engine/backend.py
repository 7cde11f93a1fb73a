"""``SqlBackend``: the ``Backend`` seam served by the engine's transaction bodies.

A concrete backend supplies ``_execute(body, safe=..., outcome=..., prompt=...,
committed=...)``: run ``body(db)`` as one transaction on one of its connections.
``safe`` says the body may run again after a lost reply (a read, or an
idempotent write); a backend that cannot lose a reply (SQLite's writer thread)
ignores it.
``outcome`` marks an operation's outcome, which must not be lost: SQLite
waits for it even for a cancelled caller; PostgreSQL settles a lost reply by
reading the status back. ``prompt`` marks a cancel's fence, which interrupts
nothing until it is durable: SQLite commits it without the jobs queued after
it; a backend whose transactions are not shared ignores it. ``committed`` is
called with the result on the loop once it commits, before the caller resumes,
by a backend that sees the commit outside the caller's task (SQLite); others
ignore it. Every method below is that one line: the rules live in the bodies,
written once. A read by one id checks it first (``check_id``): an id no ledger
can hold (a NUL, which PostgreSQL's text cannot carry) is ``InvalidInput`` on
both engines, before a connection is taken.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import Any, TypeVar

from stopline.domain.lifecycle import ApprovalRecord, CancelResult, Checkpoint
from stopline.domain.limits import check_id, sanitise
from stopline.domain.model import EventRecord, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.vocab import OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import IllegalTransition, InvalidInput, UnknownOperation, UnknownRun
from stopline.ledger import rows
from stopline.ledger.backend import (
    FENCE_COMMITTED,
    Backend,
    GateResult,
    Note,
    OutcomeUpdate,
    RunSpec,
)
from stopline.ledger.engine import approvals as ap
from stopline.ledger.engine import fence, owners, reads, runs, settling, truth
from stopline.ledger.engine.db import Db
from stopline.ledger.engine.gate import gate
from stopline.ledger.engine.record import record, record_many
from stopline.ledger.leases import WorkerLease

__all__ = ["SqlBackend"]

T = TypeVar("T")


class SqlBackend(Backend):
    @abc.abstractmethod
    async def _execute(
        self,
        body: Callable[[Db], Coroutine[Any, Any, T]],
        *,
        safe: bool = False,
        outcome: tuple[str, OutcomeUpdate] | None = None,
        prompt: bool = False,
        committed: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``body`` as one transaction; ``safe``: it may run again after a lost reply;
        ``outcome``: it records this ``(op id, update)``, which must not be lost;
        ``prompt``: its caller acts once it is durable, so nothing queued later delays it;
        ``committed(result)``: called on the loop as soon as it committed, before the
        caller resumes, by a backend that sees the commit outside the caller's task."""

    # -- runs ----------------------------------------------------------------------
    async def create_run(self, spec: RunSpec) -> RunRecord:
        return await self._execute(lambda db: runs.create_run(db, spec))

    async def run_event(
        self, run_id: str, event: RunEvent, *, by: str, reason: str = ""
    ) -> tuple[RunRecord, bool]:
        if event is RunEvent.CANCEL:  # one mechanism: the subtree fence
            result = await self.cancel(run_id, by=by, reason=reason)
            return result.run, result.first
        # a reason that cannot be stored never stops the move (both engines' moves)
        return await self._move(run_id, event, by, sanitise(reason))

    async def _move(
        self, run_id: str, event: RunEvent, by: str, reason: str
    ) -> tuple[RunRecord, bool]:
        """A run's move other than cancel, as one transaction (a backend whose commit can
        be in doubt settles it here)."""
        return await self._execute(lambda db: runs.run_event(db, run_id, event, by, reason))

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        if any(event is RunEvent.CANCEL for _, event in items):
            raise InvalidInput("run event", "a cancel is the subtree fence: use cancel()")
        return await self._execute(lambda db: runs.run_events(db, items, by))

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        return await self._execute(lambda db: runs.set_phase(db, run_id, kind, policy), safe=True)

    async def get_run(self, run_id: str) -> RunRecord:
        check_id("run_id", run_id)
        return await self._execute(lambda db: reads.load_run(db, run_id), safe=True)

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, RunRecord]:
        return await self._execute(lambda db: reads.load_runs(db, run_ids), safe=True)

    async def change_mark(self) -> str:
        return await self._execute(reads.change_mark, safe=True)

    async def list_runs(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return await self._execute(lambda db: reads.list_runs(db, state, owner, limit), safe=True)

    # -- operations ----------------------------------------------------------------
    async def gate(self, spec: OperationSpec) -> GateResult:
        return await self._execute(lambda db: gate(db, spec))

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        return await self._execute(lambda db: record(db, op_id, update), outcome=(op_id, update))

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        return await self._execute(lambda db: record_many(db, items))

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        return await self._execute(lambda db: runs.note(db, op_id, kind, data, cancel_state))

    async def note_many(self, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
        return await self._execute(lambda db: runs.note_many(db, notes))

    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        check_id("run_id", run_id)
        return await self._execute(lambda db: reads.operations(db, run_id, descendants), safe=True)

    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        check_id("run_id", run_id)
        return await self._execute(
            lambda db: reads.run_and_operations(db, run_id, descendants), safe=True
        )

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        return await self._execute(
            lambda db: reads.runs_and_operations(db, run_ids, settling=settling), safe=True
        )

    async def trees_and_operations(
        self, run_ids: Sequence[str]
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        return await self._execute(lambda db: reads.trees_and_operations(db, run_ids), safe=True)

    async def unsettled_below(self, run_ids: Sequence[str]) -> dict[str, set[RunState]]:
        if not run_ids:
            return {}
        return await self._execute(lambda db: settling.unsettled_below(db, run_ids), safe=True)

    async def owners_of(self, run_ids: Sequence[str]) -> dict[str, dict[str, bool]]:
        if not run_ids:
            return {}
        return await self._execute(lambda db: settling.owners_of(db, run_ids), safe=True)

    async def list_trees(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[tuple[RunRecord, list[OperationRecord]]]:
        return await self._execute(lambda db: reads.list_trees(db, state, owner, limit), safe=True)

    async def get_operation(self, op_id: str) -> OperationRecord:
        check_id("op_id", op_id)
        return await self._execute(lambda db: reads.load_op(db, op_id), safe=True)

    async def get_operations(
        self, op_ids: Sequence[str]
    ) -> list[OperationRecord | UnknownOperation]:
        return await self._execute(lambda db: reads.load_ops(db, op_ids), safe=True)

    async def events(self, run_id: str) -> list[EventRecord]:
        check_id("run_id", run_id)
        return await self._execute(lambda db: reads.events(db, run_id), safe=True)

    async def unresolved(
        self, limit: int = 10_000, statuses: Collection[OpStatus] | None = None
    ) -> list[OperationRecord]:
        reads.wanted_open(statuses)  # a ValueError before any connection
        return await self._execute(lambda db: reads.unresolved(db, limit, statuses), safe=True)

    # -- lifecycle -----------------------------------------------------------------
    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        # idempotent (R7): a retry after a doubt finds it done and says so
        return await self._execute(
            lambda db: fence.cancel(db, run_id, by, reason),
            safe=True,
            prompt=True,
            committed=FENCE_COMMITTED.get(),
        )

    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool, by: str) -> None:
        await self._execute(
            lambda db: owners.add_owner(db, run_id, owner_run, exclusive, by), safe=True
        )

    async def leave_to_owners(self, run_id: str, *, cut_by: str) -> list[str]:
        return await self._execute(lambda db: owners.leave_to_owners(db, run_id, cut_by))

    async def pause(self, run_id: str, *, by: str, reason: str = "") -> list[str]:
        return await self._execute(lambda db: fence.pause(db, run_id, by, reason))

    async def settle_pause(self, run_id: str) -> RunRecord:
        return await self._execute(lambda db: fence.settle_pause(db, run_id), safe=True)

    async def resume(self, run_id: str, *, by: str) -> tuple[RunRecord, list[str]]:
        return await self._execute(lambda db: fence.resume(db, run_id, by))

    async def request_approval(
        self, approval_id: str, run_id: str, scope: str, *, approver: str, requested_by: str
    ) -> ApprovalRecord:
        return await self._execute(
            lambda db: ap.request_approval(db, approval_id, run_id, scope, approver, requested_by)
        )

    async def decide_approval(
        self, approval_id: str, *, granted: bool, by: str, expires_at: float | None
    ) -> ApprovalRecord:
        return await self._execute(
            lambda db: ap.decide_approval(db, approval_id, granted, by, expires_at)
        )

    async def approvals(self, run_id: str) -> list[ApprovalRecord]:
        check_id("run_id", run_id)
        return await self._execute(lambda db: reads.approvals(db, run_id), safe=True)

    async def get_approval(self, approval_id: str) -> ApprovalRecord:
        check_id("approval_id", approval_id)
        return await self._execute(lambda db: reads.load_approval(db, approval_id), safe=True)

    async def checkpoint(self, run_id: str, name: str, state: Any) -> Checkpoint:
        # refused before the transaction, alike on every backend: a NUL in the name was
        # stored by SQLite and refused by PostgreSQL, a lone surrogate raised
        # ``UnicodeEncodeError`` on both (ADR 0095)
        check_id("run_id", run_id)
        check_id("name", name)
        text = rows.dump_state(state)
        return await self._execute(lambda db: ap.checkpoint(db, run_id, name, state, text))

    async def last_checkpoint(self, run_id: str) -> Checkpoint | None:
        check_id("run_id", run_id)
        return await self._execute(lambda db: reads.last_checkpoint(db, run_id), safe=True)

    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None:
        # one appended line: repeated after a lost reply at worst, never lost
        await self._execute(
            lambda db: ap.audit(db, run_id, principal, action, allowed, detail), safe=True
        )

    # -- truth ---------------------------------------------------------------------
    async def heartbeat(self, worker: str, *, host: str, pid: int, lease_until: float) -> None:
        await self._execute(
            lambda db: truth.heartbeat(db, worker, host, pid, lease_until), safe=True
        )

    async def in_flight_workers(self) -> list[WorkerLease]:
        return await self._execute(reads.in_flight_workers, safe=True)

    async def recover_orphans(
        self, workers: Collection[str], evidence: Sequence[Evidence]
    ) -> list[OperationRecord]:
        # a retry finds nothing left to mark: the first attempt's marks stand
        return await self._execute(
            lambda db: truth.recover_orphans(db, workers, evidence), safe=True
        )

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        return await self._execute(lambda db: truth.begin_compensation(db, spec, evidence))

    async def compensations(self, op_id: str) -> list[OperationRecord]:
        return await self._execute(lambda db: reads.compensations(db, op_id), safe=True)
