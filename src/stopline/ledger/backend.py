"""The storage seam, by role: what a ledger backend must do, and nothing more.

Each role is a handful of async methods, each one transaction:

- ``Gate``: the dispatch gate and a compensation's gate (R1, S8);
- ``Journal``: what happened to an operation (outcomes, notes, the audit);
- ``RunControl``: runs and their lifecycle (cancel, pause, resume, approvals,
  checkpoints);
- ``Queries``: reads;
- ``Leases``: workers, their leases and crash recovery (R2).

``Backend`` is all five plus ``close``. Both backends serve it with the
engine's transaction bodies (``stopline.ledger.engine``); a wrapper that
observes some calls subclasses ``stopline.ledger.forwarding.ForwardingBackend``
and overrides only those. The contract suite in ``tests/ledger`` runs
unchanged against every backend.
"""

from __future__ import annotations

import abc
import contextvars
import dataclasses
import enum
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar, cast

import anyio
import anyio.abc

from stopline.domain.lifecycle import ApprovalRecord, CancelResult, Checkpoint
from stopline.domain.limits import sanitise
from stopline.domain.model import (
    EventRecord,
    Evidence,
    OperationRecord,
    OperationSpec,
    RunRecord,
)
from stopline.domain.vocab import (
    Cause,
    Grant,
    OpEvent,
    OpStatus,
    PhaseKind,
    Policy,
    RunEvent,
    RunState,
)
from stopline.errors import IllegalTransition, UnknownOperation, UnknownRun
from stopline.ledger.leases import WorkerLease

__all__ = [
    "FENCE_COMMITTED",
    "Backend",
    "Gate",
    "GateResult",
    "GateVerdict",
    "Journal",
    "Leases",
    "Note",
    "OutcomeUpdate",
    "Queries",
    "RunControl",
    "RunSpec",
]


T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E", bound=Exception)

# Set by the runtime in the task that calls ``cancel`` (ADR 0043): a backend that sees
# the fence's commit outside that task (SQLite's writer thread, waking the loop) calls
# it there, on the loop, with the result, before the task resumes; the runtime cuts
# the interrupted calls then, a loop turn or two sooner. A backend whose commit returns
# in the calling task (PostgreSQL) leaves it; the runtime then cuts after the return.
FENCE_COMMITTED: contextvars.ContextVar[Callable[[CancelResult], None] | None] = (
    contextvars.ContextVar("stopline_fence_committed", default=None)
)


async def _each(
    call: Callable[[T], Awaitable[R]],
    items: Sequence[T],
    refused: type[E] | tuple[type[E], ...],
) -> list[R | E]:
    """``call`` of each item in turn, a refusal (``refused``) returned in its place: the
    many-at-once methods of a backend that has no faster way."""
    out: list[R | E] = []
    for item in items:
        try:
            out.append(await call(item))
        except refused as exc:
            out.append(exc)
    return out


class GateVerdict(enum.Enum):
    PASSED = "passed"  # intent recorded as requested; dispatch may proceed
    NEEDS_APPROVAL = "needs_approval"  # no valid approval for this operation: nothing recorded
    PREVENTED = "prevented"  # fenced: recorded as prevented
    PAUSED = "paused"  # run paused: nothing recorded, wait for resume
    EXISTING = "existing"  # this id was seen before with the same arguments


@dataclasses.dataclass(frozen=True, slots=True)
class GateResult:
    verdict: GateVerdict
    operation: OperationRecord | None = None  # set for PREVENTED and EXISTING
    fence: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RunSpec:
    id: str
    name: str
    owner: str
    tenant: str
    parent_id: str | None = None
    shared: bool = False  # the parent is one owner among others (R6)
    grants: Grant = Grant.INITIATE | Grant.VERIFY | Grant.COMPENSATE | Grant.AUDIT
    policy: Policy = Policy.VERIFY


@dataclasses.dataclass(frozen=True, slots=True)
class OutcomeUpdate:
    """A status change of one operation, with what it rests on."""

    event: OpEvent
    evidence: Sequence[Evidence]
    cause: Cause | None = None
    result: Any = None
    has_result: bool = False
    error: str | None = None
    cancel_state: str | None = None
    late: bool = False
    # a read-back's verdict: the ``attempts`` of the operation it looked for; refused
    # once a later attempt has been sent (a look begun before a retry speaks of the
    # earlier attempt only, ADR 0099). None: any attempt (an answer is its own call's)
    attempt: int | None = None

    def __post_init__(self) -> None:  # a provider's message: text every backend can store
        if self.error is not None:
            object.__setattr__(self, "error", sanitise(self.error))


@dataclasses.dataclass(frozen=True, slots=True)
class Note:
    """An event on an operation that changes no status (``Journal.note``'s arguments)."""

    op_id: str
    kind: str
    data: dict[str, Any]
    cancel_state: str | None = None


class Gate(abc.ABC):
    """The dispatch gate: nothing is sent unless its intent is recorded first (R1)."""

    @abc.abstractmethod
    async def gate(self, spec: OperationSpec) -> GateResult:
        """Check fence, state, ``initiate`` and the lease, and record the intent, atomically."""

    @abc.abstractmethod
    async def begin_compensation(
        self, spec: OperationSpec, evidence: Sequence[Evidence]
    ) -> GateResult:
        """Gate a compensation (``spec.compensates`` set, under the ``compensate`` grant)
        and move the operation it corrects committed -> compensating, atomically.

        Raises ``IllegalTransition`` (recording nothing) if that operation is not committed.
        """


class Journal(abc.ABC):
    """What happened to an operation: its transitions, notes, and the audit trail."""

    # A backend whose writes from one process apply in order (one writer, FIFO) can take
    # an outcome without the caller waiting for its commit: see ``record_deferred``.
    defers_outcomes: bool = False
    # A backend whose connections belong to the event loop that opened it (PostgreSQL's:
    # psycopg's async pool, group commit and listener): used from another thread's loop
    # it is refused (``Core.backend``, ADR 0086), where a read waited out its timeout.
    bound_to_its_loop: bool = False

    @abc.abstractmethod
    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        """Apply one transition (compare-and-set on the status read in the same txn)."""

    def record_deferred(
        self,
        op_id: str,
        update: OutcomeUpdate,
        then: Callable[[Callable[[], OperationRecord]], None],
    ) -> None:
        """Queue ``record`` now; once it commits, call ``then(outcome)`` on this event loop
        (``outcome()`` returns the record or raises what ``record`` would have).

        Only for backends with ``defers_outcomes``: every later call from this
        process is ordered after it, so reads see it; until its commit, a crash
        leaves the operation ``requested``, which recovery marks ``unknown`` and
        reads back (R2). The intent, which dispatch waits for, is never deferred.
        """
        raise NotImplementedError(f"{type(self).__name__} does not defer outcomes")

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        """``record`` for many operations (a cancelled tree's interrupted calls); one
        transaction where the backend can. An illegal transition is returned in its
        place, not raised, and leaves that operation as it was."""
        return await _each(lambda item: self.record(*item), items, IllegalTransition)

    @abc.abstractmethod
    async def note(
        self, op_id: str, kind: str, data: dict[str, Any], cancel_state: str | None = None
    ) -> OperationRecord:
        """Append an event that changes no status (progress, cancel asked, late copy)."""

    async def note_many(self, notes: Sequence[Note]) -> list[OperationRecord | UnknownOperation]:
        """``note`` for many operations in one transaction where the backend can (a
        cancelled tree's provider answers); an unknown operation is returned in its
        place, not raised."""
        return await _each(
            lambda n: self.note(n.op_id, n.kind, n.data, n.cancel_state), notes, UnknownOperation
        )

    @abc.abstractmethod
    async def audit(
        self, run_id: str, *, principal: str, action: str, allowed: bool, detail: str = ""
    ) -> None: ...


class RunControl(abc.ABC):
    """Runs and their lifecycle: ownership, cancel, pause, resume, approvals, checkpoints."""

    @abc.abstractmethod
    async def create_run(self, spec: RunSpec) -> RunRecord: ...

    @abc.abstractmethod
    async def run_event(
        self,
        run_id: str,
        event: RunEvent,
        *,
        by: str,
        reason: str = "",
    ) -> tuple[RunRecord, bool]:
        """Apply a run transition; CANCEL is idempotent (R7) and revokes ``initiate``.

        Returns the run and whether this call changed it.
        """

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        """``run_event`` for many runs (a cancelled tree's runs settling together), one
        transaction where the backend can; never ``CANCEL``. An illegal move or an
        unknown run is returned in its place, not raised, and leaves that run as it was."""
        moved = await _each(
            lambda item: self.run_event(*item, by=by), items, (IllegalTransition, UnknownRun)
        )
        return cast("list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]", moved)

    @abc.abstractmethod
    async def set_phase(self, run_id: str, kind: PhaseKind, policy: Policy) -> RunRecord: ...

    @abc.abstractmethod
    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        """Fence the run and every run it owns exclusively, in one transaction (R1, R6)."""

    @abc.abstractmethod
    async def add_owner(self, run_id: str, owner_run: str, *, exclusive: bool, by: str) -> None:
        """``owner_run`` owns ``run_id`` from now; its ``owner_added`` event names the
        principal ``by`` who made the link, in the link's own transaction (R11).
        ``exclusive`` is a share's ``False``: the library makes an exclusive link only
        for a parent's own child, and keeps one by a last owner's cancel, which fences
        the run (the settler relies on it: a run never fenced is its parent's, ADR
        0065)."""

    @abc.abstractmethod
    async def leave_to_owners(self, run_id: str, *, cut_by: str) -> list[str]:
        """The run's block was cut by the cancel of ``cut_by``, a run whose block is open
        around it: the runs owning it by a share that can go on with it, its
        ``left_to_owners`` event naming them written in the same transaction; none (and
        nothing written) if it is fenced or ended, or no such owner holds it (R6)."""

    @abc.abstractmethod
    async def pause(self, run_id: str, *, by: str, reason: str = "") -> list[str]:
        """running -> pausing (paused once idle) for the run and its exclusive subtree."""

    @abc.abstractmethod
    async def settle_pause(self, run_id: str) -> RunRecord: ...

    @abc.abstractmethod
    async def resume(self, run_id: str, *, by: str) -> tuple[RunRecord, list[str]]:
        """Back to running with initiate re-granted; returns the approvals that expired."""

    @abc.abstractmethod
    async def request_approval(
        self, approval_id: str, run_id: str, scope: str, *, approver: str, requested_by: str
    ) -> ApprovalRecord: ...

    @abc.abstractmethod
    async def decide_approval(
        self, approval_id: str, *, granted: bool, by: str, expires_at: float | None
    ) -> ApprovalRecord: ...

    @abc.abstractmethod
    async def checkpoint(self, run_id: str, name: str, state: Any) -> Checkpoint: ...

    async def watch_cancels(
        self,
        on_cancel: Callable[[list[str]], None],
        *,
        holding: Callable[[str], bool] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``on_cancel(run_ids)`` for every cancel committed by any process, until
        cancelled; ``task_status.started()`` once listening.

        Only speeds up the interruption of in-flight work: the gate reads the fence,
        so a lost notification never lets a dispatch through (R1). ``holding(run_id)``:
        this process has a call of the run in flight whose tool has not answered, so
        the run cannot have been resumed since a cancel of it (ADR 0041): a backend
        that checks a notified run is still fenced may skip the check for it. The
        default watches nothing (a backend serving one process needs nothing more).
        """
        task_status.started()

    async def cancel_watch_ended(self) -> None:
        """Until ``watch_cancels`` stops for good, then raise why: an error no wait can
        clear (the ledger corrupt, its file deleted). The runtime awaits it behind its
        error boundary, so the worker shows degraded at once (``health.broken``), not
        when another step next meets the error. The default: the watch never stops."""
        await anyio.sleep_forever()


class Queries(abc.ABC):
    """Reads: one transaction each, never a write."""

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunRecord: ...

    @abc.abstractmethod
    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, RunRecord]:
        """The runs of ``run_ids`` that exist, by id, in one read."""

    @abc.abstractmethod
    async def change_mark(self) -> str:
        """A mark that moves with every commit to this ledger that logs an event, by any
        process, and with nothing else. Two equal marks read one after the other mean
        nothing was committed in between; a hint, not a proof, where commits can land
        out of their log's order (PostgreSQL's mark misses one that lands behind more
        than ``MARK_WINDOW`` later numbers): a caller reads again now and then
        regardless (``wait_settled``: every 5 s)."""

    @abc.abstractmethod
    async def list_runs(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[RunRecord]: ...

    @abc.abstractmethod
    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        """The run's operations; with ``descendants``, its child runs' too (S4)."""

    @abc.abstractmethod
    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        """``get_run`` and its ``operations`` in one read, one snapshot (settling a run
        and building its receipt read both)."""

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        """``run_and_operations`` of many runs (their own operations), one read where the
        backend can (a cancelled tree's runs settling together); an unknown run is
        returned in its place, not raised. ``settling`` (a settling step's read) lets
        the backend leave out the settled operations that cannot be compensated: the
        step reads nothing of them (this default leaves out nothing)."""
        del settling
        return await _each(self.run_and_operations, run_ids, UnknownRun)

    async def trees_and_operations(
        self, run_ids: Sequence[str]
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        """``run_and_operations`` with ``descendants`` of many runs (what their receipts
        are built from), one read where the backend can; an unknown run is returned in
        its place, not raised."""
        return await _each(
            lambda run_id: self.run_and_operations(run_id, descendants=True), run_ids, UnknownRun
        )

    @abc.abstractmethod
    async def unsettled_below(self, run_ids: Sequence[str]) -> dict[str, set[RunState]]:
        """For each of ``run_ids`` with any, the states of the runs it owns exclusively
        (transitively) not settled yet: cancelling, settling or in review. A cancelled
        run settles after its tree (``transitions.settle_move``)."""

    @abc.abstractmethod
    async def owners_of(self, run_ids: Sequence[str]) -> dict[str, dict[str, bool]]:
        """For each of ``run_ids`` with any, the runs owning it now (links no cancel has
        let go), each with whether it owns it exclusively (whose tree it is in: its
        parent's, or a shared run's last owner's once that owner's cancel stopped it),
        in one read."""

    async def list_trees(
        self, *, state: RunState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[tuple[RunRecord, list[OperationRecord]]]:
        """``list_runs`` with each run's ``trees_and_operations`` (a page of runs with
        their receipts), from one snapshot where the backend can: a run's row and its
        receipt from one moment, and the listing from that moment too. This default
        reads twice, and each run's row comes from the second read."""
        listed = await self.list_runs(state=state, owner=owner, limit=limit)
        found = await self.trees_and_operations([run.id for run in listed])
        return [tree for tree in found if not isinstance(tree, UnknownRun)]

    @abc.abstractmethod
    async def get_operation(self, op_id: str) -> OperationRecord: ...

    async def get_operations(
        self, op_ids: Sequence[str]
    ) -> list[OperationRecord | UnknownOperation]:
        """``get_operation`` of many, one read where the backend can (a cancelled tree's
        calls verified together); an unknown operation is returned in its place."""
        return await _each(self.get_operation, op_ids, UnknownOperation)

    @abc.abstractmethod
    async def events(self, run_id: str) -> list[EventRecord]: ...

    @abc.abstractmethod
    async def unresolved(
        self, limit: int = 10_000, statuses: Collection[OpStatus] | None = None
    ) -> list[OperationRecord]:
        """Open operations through an index, never a scan of resolved history.

        ``statuses`` picks among the open ones (in flight, unknown, compensating,
        needs_review, compensation_failed); the default is what crash recovery
        and reconciliation look at: in flight, unknown and compensating.
        """

    @abc.abstractmethod
    async def approvals(self, run_id: str) -> list[ApprovalRecord]: ...

    @abc.abstractmethod
    async def get_approval(self, approval_id: str) -> ApprovalRecord: ...

    @abc.abstractmethod
    async def last_checkpoint(self, run_id: str) -> Checkpoint | None: ...

    @abc.abstractmethod
    async def compensations(self, op_id: str) -> list[OperationRecord]:
        """The compensation operations linked to ``op_id``, oldest first."""


class Leases(abc.ABC):
    """Workers and their leases, for crash recovery (R2) and fencing at the gate."""

    @abc.abstractmethod
    async def heartbeat(self, worker: str, *, host: str, pid: int, lease_until: float) -> None:
        """Register ``worker`` or renew its lease; ``lease_until=0`` retires it.

        A retired worker that still holds operations in flight keeps its row, with
        an expired lease, so the next recovery reconciles them (R2).
        """

    @abc.abstractmethod
    async def in_flight_workers(self) -> list[WorkerLease]:
        """The workers holding requested or accepted operations (through the open index)."""

    @abc.abstractmethod
    async def recover_orphans(
        self, workers: Collection[str], evidence: Sequence[Evidence]
    ) -> list[OperationRecord]:
        """Mark every requested or accepted operation of these dead workers ``unknown``
        (cause ``crash``) in one transaction, and forget dead workers holding nothing."""


class Backend(Gate, Journal, RunControl, Queries, Leases):
    """One ledger store: every role, each method one transaction."""

    location: str

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
