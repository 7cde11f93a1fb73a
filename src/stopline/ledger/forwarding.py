"""``ForwardingBackend``: a backend that passes every call to another, written out once.

An observer (``stopline.telemetry``, ``stopline.testing``) subclasses it and
overrides the few calls it watches; everything else reaches ``self.inner``
with every argument, as typed here (mypy checks each one against the seam,
so an option added to a method cannot be dropped on the way). A wrapper
that must act before *every* call (a crash switch) overrides ``inner``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import anyio
import anyio.abc

from stopline.domain.lifecycle import ApprovalRecord, CancelResult, Checkpoint
from stopline.domain.model import EventRecord, Evidence, OperationRecord, OperationSpec, RunRecord
from stopline.domain.vocab import OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import IllegalTransition, UnknownOperation, UnknownRun
from stopline.ledger.backend import (
    FENCE_COMMITTED,
    Backend,
    GateResult,
    Note,
    OutcomeUpdate,
    RunSpec,
)
from stopline.ledger.leases import WorkerLease

__all__ = ["ForwardingBackend", "seeing_the_commit"]


@contextlib.contextmanager
def seeing_the_commit(see: Callable[[CancelResult], None]) -> Iterator[None]:
    """Around an observer's call of the inner ``cancel``: ``see(result)`` as the fence's
    commit is seen on the loop, before the runtime cuts the calls it interrupts
    (ADR 0043). A backend that sees its commit outside the caller's task calls it
    there (SQLite); where none does, ``see`` is not called and the inner call's
    return is that moment."""
    cut = FENCE_COMMITTED.get()

    def seen(result: CancelResult) -> None:
        see(result)
        if cut is not None:
            cut(result)

    hooked = FENCE_COMMITTED.set(seen)
    try:
        yield
    finally:
        FENCE_COMMITTED.reset(hooked)


class ForwardingBackend(Backend):
    def __init__(self, inner: Backend) -> None:
        self._inner = inner
        self.location = inner.location

    @property
    def inner(self) -> Backend:
        """The backend every call reaches."""
        return self._inner

    @property
    def defers_outcomes(self) -> bool:  # type: ignore[override]
        return self._inner.defers_outcomes

    @property
    def bound_to_its_loop(self) -> bool:  # type: ignore[override]
        return self._inner.bound_to_its_loop

    def __getattr__(self, name: str) -> Any:
        """A backend's own attributes beyond the seam (``path``, ``listener``, ...)."""
        if name == "_inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def close(self) -> None:
        await self._inner.close()

    # -- Gate ------------------------------------------------------------------------
    async def gate(self, spec: OperationSpec) -> GateResult:
        return await self.inner.gate(spec)

    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        return await self.inner.begin_compensation(spec, evidence)

    # -- Journal ---------------------------------------------------------------------
    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        return await self.inner.record(op_id, update)

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        return await self.inner.record_many(items)

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        self.inner.record_deferred(op_id, update, then)

    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        return await self.inner.note(op_id, kind, data, cancel_state)

    async def note_many(self, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
        return await self.inner.note_many(notes)

    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None:
        await self.inner.audit(
            run_id, principal=principal, action=action, allowed=allowed, detail=detail
        )

    # -- RunControl ------------------------------------------------------------------
    async def create_run(self, spec: RunSpec) -> RunRecord:
        return await self.inner.create_run(spec)

    async def run_event(
        self, run_id: str, event: RunEvent, *, by: str, reason: str = ""
    ) -> tuple[RunRecord, bool]:
        return await self.inner.run_event(run_id, event, by=by, reason=reason)

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        return await self.inner.run_events(items, by=by)

    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord:
        return await self.inner.set_phase(run_id, kind, policy)

    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        return await self.inner.cancel(run_id, by=by, reason=reason)

    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool, by: str) -> None:
        await self.inner.add_owner(run_id, owner_run, exclusive=exclusive, by=by)

    async def leave_to_owners(self, run_id: str, *, cut_by: str) -> list[str]:
        return await self.inner.leave_to_owners(run_id, cut_by=cut_by)

    async def pause(self, run_id: str, *, by: str, reason: str = "") -> list[str]:
        return await self.inner.pause(run_id, by=by, reason=reason)

    async def settle_pause(self, run_id: str) -> RunRecord:
        return await self.inner.settle_pause(run_id)

    async def resume(self, run_id: str, *, by: str) -> tuple[RunRecord, list[str]]:
        return await self.inner.resume(run_id, by=by)

    async def request_approval(
        self, approval_id: str, run_id: str, scope: str, *, approver: str, requested_by: str
    ) -> ApprovalRecord:
        return await self.inner.request_approval(
            approval_id, run_id, scope, approver=approver, requested_by=requested_by
        )

    async def decide_approval(
        self, approval_id: str, *, granted: bool, by: str, expires_at: float | None
    ) -> ApprovalRecord:
        return await self.inner.decide_approval(
            approval_id, granted=granted, by=by, expires_at=expires_at
        )

    async def checkpoint(self, run_id: str, name: str, state: Any) -> Checkpoint:
        return await self.inner.checkpoint(run_id, name, state)

    async def watch_cancels(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        holding: Callable[[str], bool] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.inner.watch_cancels(on_cancel, holding=holding, task_status=task_status)

    async def cancel_watch_ended(self) -> None:
        await self.inner.cancel_watch_ended()

    # -- Queries ---------------------------------------------------------------------
    async def get_run(self, run_id: str) -> RunRecord:
        return await self.inner.get_run(run_id)

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, RunRecord]:
        return await self.inner.get_runs(run_ids)

    async def change_mark(self) -> str:
        return await self.inner.change_mark()

    async def list_runs(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return await self.inner.list_runs(state=state, owner=owner, limit=limit)

    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        return await self.inner.operations(run_id, descendants=descendants)

    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        return await self.inner.run_and_operations(run_id, descendants=descendants)

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        return await self.inner.runs_and_operations(run_ids, settling=settling)

    async def trees_and_operations(
        self, run_ids: Sequence[str]
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        return await self.inner.trees_and_operations(run_ids)

    async def unsettled_below(self, run_ids: Sequence[str]) -> dict[str, set[RunState]]:
        return await self.inner.unsettled_below(run_ids)

    async def owners_of(self, run_ids: Sequence[str]) -> dict[str, dict[str, bool]]:
        return await self.inner.owners_of(run_ids)

    async def list_trees(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[tuple[RunRecord, list[OperationRecord]]]:
        return await self.inner.list_trees(state=state, owner=owner, limit=limit)

    async def get_operation(self, op_id: str) -> OperationRecord:
        return await self.inner.get_operation(op_id)

    async def get_operations(
        self, op_ids: Sequence[str]
    ) -> list[OperationRecord | UnknownOperation]:
        return await self.inner.get_operations(op_ids)

    async def events(self, run_id: str) -> list[EventRecord]:
        return await self.inner.events(run_id)

    async def unresolved(
        self, limit: int = 10_000, statuses: Collection[OpStatus] | None = None
    ) -> list[OperationRecord]:
        return await self.inner.unresolved(limit, statuses)

    async def approvals(self, run_id: str) -> list[ApprovalRecord]:
        return await self.inner.approvals(run_id)

    async def get_approval(self, approval_id: str) -> ApprovalRecord:
        return await self.inner.get_approval(approval_id)

    async def last_checkpoint(self, run_id: str) -> Checkpoint | None:
        return await self.inner.last_checkpoint(run_id)

    async def compensations(self, op_id: str) -> list[OperationRecord]:
        return await self.inner.compensations(op_id)

    # -- Leases ----------------------------------------------------------------------
    async def heartbeat(self, worker: str, *, host: str, pid: int, lease_until: float) -> None:
        await self.inner.heartbeat(worker, host=host, pid=pid, lease_until=lease_until)

    async def in_flight_workers(self) -> list[WorkerLease]:
        return await self.inner.in_flight_workers()

    async def recover_orphans(
        self, workers: Collection[str], evidence: Sequence[Evidence]
    ) -> list[OperationRecord]:
        return await self.inner.recover_orphans(workers, evidence)
