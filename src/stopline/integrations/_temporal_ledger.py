"""The workflow side's ledger writes on the worker: three local activities that open,
fence and end a workflow's run, and what their faults tell Temporal (ADR 0111).

Temporal retries a failed local activity by its retry policy, and a workflow task
waits for it: an error no retry can fix, retried, held the workflow "running" for
ever (an operator's trigger refusing the run's end spun its ``end_run`` without a
bound, unseen). Each fault is now sorted as it is raised to Temporal:

- **A fault that may clear** (``retryable``: a lock another connection holds, a
  lost PostgreSQL connection, a full disk, a commit in doubt) and a ledger closed
  under the worker (another worker's attempt finds its own open): retried, typed,
  by the workflow's retry policy for them (``_temporal_workflow``: at most 5 s
  apart, for as long as it lasts: the workflow waits for its ledger, as its gated
  calls do).
- **One no retry can fix** (the ledger refuses the write, and would again:
  ``LedgerRefused``; a corrupt ledger, a newer schema; an input, transition or
  authority the ledger refuses): the activity fails at once, non-retryable, named
  by its type, with its message; the workflow fails with it (its run's end: a
  typed failure that names the run left running, ``_temporal_workflow``).

Every failure is counted in ``ledger.health`` under the activity's name, ``retrying``
as Temporal will: an operator sees a workflow waiting for its ledger there.
An error that is not stopline's (a bug) keeps Temporal's retry, as any activity's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from stopline.domain.limits import fitted
from stopline.errors import (
    IdempotencyConflict,
    IllegalTransition,
    InvalidInput,
    LedgerClosed,
    LedgerError,
    NotPermitted,
    NotReplayable,
    StoplineError,
    UnknownRun,
)
from stopline.integrations._engines import RUN_ROOM, EngineGate
from stopline.integrations._temporal_runs import execution_run, run_id_of
from stopline.integrations._temporal_workflow import END_RUN, FENCE_RUN, OPEN_RUN
from stopline.runtime.boundary import retryable

__all__ = ["failing_for_good", "ledger_activities"]

# stopline's errors that no retry can fix: the activity fails at once, named, with its message
FOR_GOOD = (
    NotReplayable,
    InvalidInput,
    IdempotencyConflict,
    NotPermitted,
    IllegalTransition,
    UnknownRun,
)


@contextlib.contextmanager
def failing_for_good() -> Iterator[None]:
    """A stopline error no retry can fix fails the activity at once: Temporal's default
    retry policy would repeat it for ever. So does a ledger error no wait clears (the
    ledger refuses the write, and would again; a corrupt ledger, a newer schema: ADR
    0111), which a gated call meets each attempt alike; one that may clear is retried."""
    try:
        yield
    except FOR_GOOD as exc:
        raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc
    except LedgerError as exc:
        if retryable(exc):
            raise
        raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc


@contextlib.contextmanager
def _ledger_write(gate: EngineGate, name: str) -> Iterator[None]:
    """One of the workflow side's ledger writes: its stopline error raised to Temporal
    typed, retryable only if a retry may succeed, and counted in ``ledger.health``."""
    try:
        yield
    except StoplineError as exc:
        again = retryable(exc) or isinstance(exc, LedgerClosed)
        gate.ledger.health.failed(name, exc, retrying=again)
        raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=not again) from exc


def ledger_activities(gate: EngineGate) -> list[Any]:
    """The three local activities the workflow side calls (``_temporal_workflow``)."""

    async def opened(
        workflow_id: str,
        execution: str,
        workflow: str,
        parent_run: str,
        parent_workflow: str,
        shared: bool,
        carried: str,
        original: str,
        continued: str,
    ) -> list[str]:
        parent_id = parent_run or (run_id_of(parent_workflow) if parent_workflow else None)
        run_id, keyed_by = await execution_run(
            gate,
            workflow_id,
            execution,
            fitted(workflow, RUN_ROOM),
            parent_id=parent_id,
            shared=shared,
            carried=carried,
            original=original,
            continued=continued,
        )
        return [run_id, keyed_by]

    @activity.defn(name=OPEN_RUN)
    async def open_run(
        workflow_id: str,
        execution: str,
        workflow: str,
        parent_run: str,
        parent_workflow: str,
        shared: bool,
        carried: str,
        original: str = "",
        continued: str = "",
    ) -> list[str]:
        """The execution's run and the execution its keys name (``execution_run``);
        its parent's run is the header's, else (a parent started before the
        header) its workflow id's; ``original``: the execution a reset one was
        reset from (none from a workflow that predates it); ``continued``: what the
        keys of the execution a continue-as-new goes on from named (ADR 0119)."""
        with _ledger_write(gate, OPEN_RUN):
            return await opened(
                workflow_id,
                execution,
                workflow,
                parent_run,
                parent_workflow,
                shared,
                carried,
                original,
                continued,
            )

    @activity.defn(name=FENCE_RUN)
    async def fence_run(
        workflow_id: str,
        execution: str,
        workflow: str,
        parent_run: str,
        parent_workflow: str,
        shared: bool,
        carried: str,
        reason: str,
        original: str = "",
        continued: str = "",
    ) -> None:
        with _ledger_write(gate, FENCE_RUN):
            run_id, _ = await opened(
                workflow_id,
                execution,
                workflow,
                parent_run,
                parent_workflow,
                shared,
                carried,
                original,
                continued,
            )
            await gate.fence(run_id, f"temporal workflow cancel: {reason}")

    @activity.defn(name=END_RUN)
    async def end_run(run_id: str, error: str) -> None:
        with _ledger_write(gate, END_RUN):
            await gate.end_run(run_id, RuntimeError(error) if error else None)

    return [open_run, fence_run, end_run]
