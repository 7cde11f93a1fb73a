"""The exception tree, written down once.

    StoplineError                      root of every error stopline raises
    ├── IllegalTransition              (state, event) not in the table
    │   └── NotCorrectable             compensate of an operation not committed: why, what to do
    ├── NotFound
    │   ├── UnknownRun
    │   ├── UnknownOperation
    │   └── UnknownTool                an MCP server lists no such tool (also LookupError)
    ├── InvalidInput (also ValueError) an id or argument the ledger cannot take
    │   └── UnstableValue              an argument with no digest stable across processes
    ├── IdempotencyConflict            an operation id reused with other arguments
    ├── AlreadyAttached                a run already attached in this process
    ├── OperationInDoubt               a replayed operation whose outcome is unknown
    ├── NotReplayable                  a committed operation whose result was not kept
    ├── NotPermitted                   the run lacks the authority for this
    ├── ApprovalNeeded                 no granted, unexpired approval for the operation (S5)
    ├── Rejected                       raised by a provider: refused before any effect
    ├── NoAnswer                       raised by a provider: the answer was lost, and why
    ├── NoRun                          no run to act in: a tool called bare, a scope not entered
    ├── PlanError                      a `stopline check-mcp` plan it cannot run
    ├── RunEnded                       entering, resuming or pausing a run that has ended
    ├── RunPaused                      re-entering a paused run before it is resumed
    ├── LedgerClosed (also RuntimeError) a ledger used before it is open or once closed
    ├── WrongEventLoop (also RuntimeError) a run, a correction, a decision off its loop
    └── LedgerError                    storage problems, always naming the ledger
        ├── LedgerCorrupt
        ├── LedgerRefused              a constraint or trigger refuses the write, and would again
        ├── LedgerLocked
        ├── LedgerUnavailable          unreadable, missing directory, refused
        │   ├── LedgerFull             the disk (or the file size limit) is full
        │   ├── LedgerReadOnly         the file, its directory or the mount is read-only
        │   ├── LedgerIOError          the storage failed a read or a write
        │   └── CancelInDoubt          the cancel's reply was lost: it may have committed
        ├── SchemaTooNew               written by a newer stopline
        ├── LeaseExpired               fencing: this worker's lease expired, intent refused
        └── CommitInDoubt              a lost reply to a commit that could not be settled
            └── GateInDoubt            ... of the gate's intent (nothing was dispatched)

    RunFenced (BaseException)          unwinds a workflow whose run was fenced

``RunFenced`` derives from ``BaseException`` like the cancellation
exceptions of asyncio and trio, so ``except Exception`` in a workflow does not
swallow it.

Every exception stopline raises is defined here; the modules that raise
them re-export them. Deprecated aliases, kept for one release (0.2), then
removed: ``RunCancelled`` (now ``RunFenced``) and ``ApprovalRequired`` (now
``ApprovalNeeded``): the old names are also Pydantic AI's, and code that
integrates both should not have to alias one of them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stopline.domain.vocab import Cause

__all__ = [
    "AlreadyAttached",
    "ApprovalNeeded",
    "ApprovalRequired",
    "CancelInDoubt",
    "CommitInDoubt",
    "GateInDoubt",
    "IdempotencyConflict",
    "IllegalTransition",
    "InvalidInput",
    "LeaseExpired",
    "LedgerClosed",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerFull",
    "LedgerIOError",
    "LedgerLocked",
    "LedgerReadOnly",
    "LedgerRefused",
    "LedgerUnavailable",
    "NoAnswer",
    "NoRun",
    "NotCorrectable",
    "NotFound",
    "NotInReview",
    "NotPermitted",
    "NotReplayable",
    "OperationInDoubt",
    "PlanError",
    "Rejected",
    "RowHeld",
    "RunCancelled",
    "RunEnded",
    "RunFenced",
    "RunPaused",
    "SchemaTooNew",
    "SchemaTooOld",
    "StoplineError",
    "UnknownOperation",
    "UnknownRun",
    "UnknownTool",
    "UnstableValue",
    "WrongEventLoop",
    "describe",
]


class _Rebuilt:
    """Pickles as the call that made it: each error takes its own arguments (an id, a
    status, a cause), not the message ``BaseException`` would pickle, so a process
    pool, DBOS or Temporal that carries one to another process gets it back whole."""

    _made_with: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls, *args)
        self._made_with = (args, kwargs)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._made_with
        return _rebuild, (type(self), args, kwargs, self.__dict__)


def _rebuild(
    cls: type[BaseException], args: tuple[Any, ...], kwargs: dict[str, Any], state: dict[str, Any]
) -> BaseException:
    error = cls(*args, **kwargs)
    error.__dict__.update(state)
    return error


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` of any exception, as evidence and logs tell it; also of one
    whose ``str`` raises (the message is then said to be unreadable, and the outcome is
    recorded all the same)."""
    try:
        message = str(exc)
    except Exception as failed:
        message = f"(its message could not be read: {type(failed).__name__})"
    return f"{type(exc).__name__}: {message}"


class StoplineError(_Rebuilt, Exception):
    """Root of every error stopline raises."""

    def to_json(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": str(self)}


class IllegalTransition(StoplineError):
    def __init__(self, state: enum.Enum, event: enum.Enum) -> None:
        self.state = state
        self.event = event
        super().__init__(f"illegal transition: event {event.value!r} in state {state.value!r}")


class NotCorrectable(IllegalTransition):
    """A correction asked of an operation that is not committed (``ledger.compensate``,
    two at once, a review's ``compensate``): refused, nothing written. ``why`` says why
    and what to do instead; ``state`` and ``event`` are the move that was refused."""

    def __init__(self, op_id: str, state: enum.Enum, event: enum.Enum, why: str) -> None:
        self.op_id = op_id
        self.why = why
        StoplineError.__init__(self, f"operation {op_id!r} is not corrected: {why}")
        self.state = state
        self.event = event


class NotInReview(IllegalTransition):
    """A reviewer's decision on an operation that is not in review: refused, nothing
    written. Its status is what its evidence proves (``state``); a decision has
    nothing to settle."""

    def __init__(self, op_id: str, state: enum.Enum, event: enum.Enum) -> None:
        self.op_id = op_id
        StoplineError.__init__(
            self,
            f"operation {op_id!r} is not in review: it is {state.value}, as its evidence "
            "proves; nothing recorded",
        )
        self.state = state
        self.event = event


class NotFound(StoplineError):
    pass


class UnknownRun(NotFound):
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"unknown run id {run_id!r}")


class UnknownOperation(NotFound):
    def __init__(self, op_id: str) -> None:
        self.op_id = op_id
        super().__init__(f"unknown operation id {op_id!r}")


class UnknownTool(NotFound, LookupError):
    def __init__(self, name: str, server: str) -> None:
        self.name = name
        self.server = server
        super().__init__(f"MCP server {server!r} lists no tool named {name!r}")


class InvalidInput(StoplineError, ValueError):
    """Refused before anything was written or sent: names the input and the problem."""

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(f"invalid {what}: {problem}")


class UnstableValue(InvalidInput):
    """An argument whose digest would differ from one process to the next."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"argument {path}", why)


class IdempotencyConflict(StoplineError):
    def __init__(self, op_id: str) -> None:
        self.op_id = op_id
        super().__init__(
            f"operation id {op_id!r} was already used with different arguments; "
            "an id is an idempotency key and names one logical call"
        )


class AlreadyAttached(StoplineError):
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(
            f"run {run_id!r} is already attached in this process; "
            "a run has one block at a time (use the Run object it gave)"
        )


class OperationInDoubt(StoplineError):
    def __init__(self, op_id: str, status: enum.Enum) -> None:
        self.op_id = op_id
        self.status = status
        super().__init__(
            f"operation {op_id!r} was dispatched before and its outcome is {status.value!r}; "
            "verify or review it before running it again"
        )


class NotReplayable(StoplineError):
    def __init__(self, op_id: str, why: str = "its result was not JSON and was not kept") -> None:
        self.op_id = op_id
        self.why = why
        super().__init__(
            f"operation {op_id!r} committed, but {why}; it is not sent again:"
            " read the result from its destination"
        )


class NotPermitted(StoplineError):
    def __init__(self, what: str) -> None:
        super().__init__(what)


class ApprovalNeeded(StoplineError):
    """The operation needs a granted, unexpired approval and has none (S5)."""

    def __init__(self, op_id: str, why: str) -> None:
        self.op_id = op_id
        self.why = why
        super().__init__(f"operation {op_id!r} needs approval: {why}")


class Rejected(StoplineError):
    """Raised by a provider that refused the request before any effect.

    This is the only way a failed call becomes ``not_committed``: any other
    exception leaves the operation ``unknown`` (R3).
    """

    def __init__(self, reason: str, ref: str = "") -> None:
        self.reason = reason
        self.ref = ref
        super().__init__(reason)


class NoAnswer(StoplineError):
    """Raised by a provider or integration that lost the answer, saying why.

    The operation becomes ``unknown`` with ``cause`` recorded (R3): a timeout,
    a broken transport and a server error are told apart in the ledger.
    """

    def __init__(self, cause: Cause, detail: str) -> None:
        self.cause = cause
        self.detail = detail
        super().__init__(f"{cause.value}: {detail}")


class NoRun(StoplineError):
    """No run to act in: a gated tool called outside a run, or a run's name reached on
    the scope ``ledger.run(...)`` gives before ``async with`` enters it (ADR 0089)."""


class PlanError(StoplineError):
    """The plan file is not what ``stopline check-mcp`` can run (the message says why)."""


class RunEnded(StoplineError):
    """``ledger.run(..., run_id=...)`` of a run that has ended, is stopped (cancelling,
    settling) or is in review, ``ledger.resume`` of one that cannot resume yet, or
    ``ledger.pause`` of one with nothing to pause; ``what_to_do`` says how to go on (R14)."""

    def __init__(self, run_id: str, state: enum.Enum, what_to_do: str | None = None) -> None:
        self.run_id = run_id
        self.state = state
        if what_to_do is None:
            what_to_do = (
                "resume it first (ledger.resume) to continue it"
                if state.value == "cancelled"
                else "start a new run to do more"
            )
        self.what_to_do = what_to_do
        where = "has ended" if getattr(state, "ended", True) else "is stopped"
        where = "is in review" if state.value == "needs_review" else where  # not ended (ADR 0093)
        super().__init__(f"run {run_id!r} {where} ({state.value}): {what_to_do}")


class RunPaused(StoplineError):
    """A workflow re-entering a paused run (one waiting for an approval, say): its first
    call would wait at the gate until someone resumes the run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id!r} is paused: resume it (ledger.resume) before re-entering")


class LedgerError(StoplineError):
    def __init__(self, location: str, cause: str) -> None:
        self.location = location
        self.cause = cause
        super().__init__(f"ledger {location}: {cause}")


class LedgerCorrupt(LedgerError):
    pass


class LedgerRefused(LedgerError):
    """The ledger's database refused this write, and would refuse it again: a constraint
    or a trigger (an operator's, a migration's), a value it cannot store. Nothing of the
    write landed; no wait clears it, so nothing retries it: an outcome the outbox holds
    is recorded as refused at once, a background step stops at it (ADR 0079)."""


class LedgerLocked(LedgerError):
    pass


class RowHeld(LedgerLocked):
    """PostgreSQL: a write on the group commit's own connection waited for a row another
    session holds; the group sets it aside, to run alone (``ledger.postgres_aside``).
    Not raised to callers (were it, it is the ``LedgerLocked`` it is). ``doubt``: the
    write's commit was in doubt already."""

    def __init__(self, location: str, cause: str, *, doubt: bool) -> None:
        super().__init__(location, cause)
        self.doubt = doubt


class LedgerUnavailable(LedgerError):
    pass


class LedgerFull(LedgerUnavailable):
    """The write did not happen: no space (or the process's file size limit) left."""


class LedgerReadOnly(LedgerUnavailable):
    """The write did not happen: the file, its directory or its mount is read-only."""


class LedgerIOError(LedgerUnavailable):
    """The storage failed a read or a write; the transaction did not commit."""


class CancelInDoubt(LedgerUnavailable):
    """The connection failed after the cancel was sent: it may have committed.

    Cancelling is idempotent (R7), so asking again is safe and says which it was.
    """

    def __init__(self, location: str, run_id: str, cause: str) -> None:
        self.run_id = run_id
        super().__init__(
            location,
            f"cancel of run {run_id!r} is in doubt ({cause}); it may have taken effect. "
            "Cancelling again is safe and idempotent",
        )


class SchemaTooOld(LedgerUnavailable):
    """A read-only open of a ledger whose schema predates what this stopline reads.

    A read-only open migrates nothing; a read-write open (``stopline.open``, any
    writing command, the console) migrates it, and the reads work from then on."""

    def __init__(self, location: str, found: int, readable_from: int, current: int) -> None:
        self.found = found
        self.readable_from = readable_from
        super().__init__(
            location,
            f"schema version {found} predates what this stopline reads ({readable_from} "
            f"to {current}); a read-only open migrates nothing: open it once read-write "
            "(a writing command such as `stopline reconcile`, the console, or a worker's "
            "stopline.open) to migrate it",
        )


class SchemaTooNew(LedgerError):
    def __init__(self, location: str, found: int, supported: int) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            location,
            f"schema version {found} was written by a newer stopline "
            f"(this one supports up to {supported}); upgrade stopline to open it",
        )


class LeaseExpired(LedgerError):
    """Fencing: this worker's lease expired, so it may not record a new intent.

    Raised by the gate, which recorded nothing; the worker renews its lease
    (its next heartbeat) before it dispatches again.
    """

    def __init__(self, worker: str, location: str = "ledger") -> None:
        self.worker = worker
        super().__init__(location, f"worker {worker!r} holds no live lease: intent refused")


class CommitInDoubt(LedgerError):
    """The connection was lost while a write's commit was on the wire, and it could not be
    settled: the write may or may not be in the ledger. Read before acting on it."""


class GateInDoubt(CommitInDoubt):
    """The gate's intent commit is in doubt and the ledger stayed unreachable.

    Nothing was dispatched (the caller never got ``PASSED``). The intent may be
    recorded as ``requested``: the backend remembers it and, on its next
    successful transaction, records it ``unknown`` (cause ``transport``), never
    ``not_committed``; reconciliation then reads it back (R2, R3).
    """

    def __init__(self, location: str, op_id: str) -> None:
        self.op_id = op_id
        super().__init__(location, f"the intent of operation {op_id!r} may be recorded: in doubt")


class RunFenced(_Rebuilt, BaseException):
    """Raised in a workflow whose run is fenced; ``ledger.run()`` absorbs it."""

    def __init__(self, run_id: str, op_id: str | None = None) -> None:
        self.run_id = run_id
        self.op_id = op_id
        where = f" (operation {op_id!r} refused at the gate)" if op_id else ""
        # the gate refuses a run that was cancelled and one that has ended alike
        super().__init__(f"run {run_id!r} is fenced: cancelled or ended{where}")


# Deprecated aliases (0.2, removed in 0.3): the old names are also Pydantic AI's.
RunCancelled = RunFenced
ApprovalRequired = ApprovalNeeded


class LedgerClosed(StoplineError, RuntimeError):
    """A ledger used before ``async with stopline.open(...)`` or once closed (it opens
    once): one answer on every engine, before anything is tried (ADR 0078)."""

    def __init__(self, location: str, why: str) -> None:
        self.location, self.why = location, why
        super().__init__(f"ledger {location} {why}")


class WrongEventLoop(StoplineError, RuntimeError):
    """A run entered, its call made, or a correction or review decision asked, off the
    thread whose loop opened the ledger (a PostgreSQL ledger: any use, ADR 0086)."""

    def __init__(self, location: str, what: str) -> None:
        self.location, self.what = location, what
        super().__init__(f"ledger {location} is open in another thread's event loop: {what}")
