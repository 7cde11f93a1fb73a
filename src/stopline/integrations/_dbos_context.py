"""Whose code runs in DBOS's context, and whose cancel a DBOS cancel error is (ADR 0106).

DBOS keeps the workflow (or step) a piece of code belongs to in a context
variable, and a task inherits it from the task that started it. The ledger
starts background work (a read-back of a call in doubt, a provider asked to
cancel, a run's settling) from the task that caused it: from a gated step or
workflow, that work ran as the workflow's code. A verifier that called a DBOS
API was recorded as the workflow's next step (``DBOS.getStatus`` where the
workflow's own next step was due: ``DBOSUnexpectedStepError``, the workflow
failed), and ``DBOS.workflow_id`` named the workflow. So only the step's own
call (its body) and the workflow's own code run in DBOS's context; the gate,
the ledger and all they start run as the application (``as_application``).

``DBOSWorkflowCancelledError`` is DBOS's signal that it cancelled the
workflow. Raised by the workflow's own code or a step's own call while DBOS
had not cancelled it, it is that code's exception like any other (a step's
call ``unknown``, read back, R3), and the workflow's run fails with it: taken
for DBOS's cancel, the run was fenced "by dbos" and the fence cancelled the
workflow in DBOS, a cancel nobody made (ADRs 0106, 0114). Which it is, DBOS's
record says: the execution's ownership token (DBOS clears it as it cancels,
and a resume or a recovery writes another) and the workflow's status. DBOS
itself parks an execution its signal ends (``PENDING`` for ever); one the run
failed for ends in DBOS as ``ERROR`` instead, with ``RunEnded`` (the run
failed), so both records say the same.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from dbos import DBOS
from dbos._context import _dbos_context_var, get_local_dbos_context
from dbos._error import DBOSWorkflowCancelledError, DBOSWorkflowConflictIDError
from dbos._sys_db import WorkflowStatusString

from stopline.domain.vocab import RunState
from stopline.errors import RunEnded, describe
from stopline.integrations._dbos_watch import (
    outside_workflow,
    owner_in_dbos,
    short,
    why_cancelled,
)
from stopline.integrations._engines import EngineGate

__all__ = ["as_application", "cancelled_in_dbos", "owner_token", "step_body", "workflow_raised"]

log = logging.getLogger("stopline.integrations.dbos")
R = TypeVar("R")
# DBOS's cancel errors a gated step's own call raised (not DBOS's check, preemption or
# stopline's refusal, which are raised around the call): taken as the call's own when
# DBOS's record of the workflow cannot be read
_RAISED_BY_A_CALL: weakref.WeakSet[BaseException] = weakref.WeakSet()


@contextlib.contextmanager
def as_application() -> Iterator[None]:
    """The block runs, and what it starts is started, outside DBOS's context: DBOS does
    not take it for the workflow's code (its DBOS calls are no steps of the workflow).
    The current task only, restored on the way out."""
    token = _dbos_context_var.set(None)
    try:
        yield
    finally:
        _dbos_context_var.reset(token)


def step_body(
    fn: Callable[..., Awaitable[R]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], Awaitable[R]]:
    """The step's own call, run in the step's DBOS context (the caller's, taken now)
    whichever task runs it; a ``DBOSWorkflowCancelledError`` it raises is marked as the
    call's own."""
    step = get_local_dbos_context()

    async def body() -> R:
        token = _dbos_context_var.set(step)
        try:
            return await fn(*args, **kwargs)
        except DBOSWorkflowCancelledError as exc:
            _RAISED_BY_A_CALL.add(exc)
            raise
        finally:
            _dbos_context_var.reset(token)

    return body


async def cancelled_in_dbos(workflow_id: str) -> bool:
    """Whether DBOS's record of the workflow says it is cancelled (a
    ``DBOS.cancel_workflow``, or its timeout)."""
    status = await outside_workflow(DBOS.get_workflow_status_async(workflow_id))
    return status is not None and str(status.status) == WorkflowStatusString.CANCELLED.value


def owner_token() -> str | None:
    """The ownership token of the workflow execution whose code runs now (DBOS's
    context), which DBOS's record of the workflow keeps until a cancel, a resume or a
    recovery takes the workflow from it."""
    ctx = get_local_dbos_context()
    return ctx.owner_xid if ctx is not None else None


class _Whose(enum.Enum):
    """Whose ``DBOSWorkflowCancelledError`` ended an execution, by DBOS's record."""

    DBOS = "DBOS cancelled the workflow"  # its status says CANCELLED
    THE_CODES = "raised by the code, DBOS had not cancelled it"  # still this execution's
    HANDED_ON = "another execution holds the workflow"  # a cancel resumed, a recovery


async def workflow_raised(
    gate: EngineGate,
    workflow_id: str,
    run_id: str,
    execution: tuple[int | None, str | None],
    exc: BaseException,
) -> BaseException | None:
    """What the workflow's run becomes when its code raised ``exc`` (called outside
    DBOS's context), and what the workflow raises to DBOS instead of ``exc`` (``None``:
    ``exc`` itself). ``execution``: DBOS's deadline of the workflow (epoch ms) and this
    execution's ownership token (``owner_token``).

    A ``DBOSWorkflowCancelledError`` (DBOS's check before a step, a preemptible step's
    cut, stopline's refusal of a step, or the code's own) is read against DBOS's record:
    cancelled there, the run is fenced; still this execution's (nobody cancelled it),
    the run fails with it and the workflow raises ``RunEnded`` so that DBOS records it
    ``ERROR`` (DBOS parks an execution its own signal ends, ``PENDING``); taken on by
    another execution (a cancel a ``DBOS.resume_workflow`` lifted, a recovery), the run
    is left to it. An execution that lost the workflow (``DBOSWorkflowConflictIDError``)
    fences it when DBOS cancelled it, else leaves it to the execution that goes on. A
    ``BaseException`` leaves the run as it is (the process is going down)."""
    deadline_ms, owner = execution
    if isinstance(exc, DBOSWorkflowCancelledError):
        whose = await _whose_cancel(workflow_id, owner, exc)
        if whose is _Whose.DBOS:
            await gate.fence(run_id, why_cancelled(deadline_ms))
        elif whose is _Whose.THE_CODES:
            log.warning(
                "%s: its code raised DBOS's cancel error (%s), DBOS had not cancelled the"
                " workflow: its run fails with it, and DBOS records the workflow ERROR",
                workflow_id,
                describe(exc),
            )
            await gate.end_run(run_id, exc)
            return RunEnded(run_id, RunState.FAILED, _OWN_CANCEL_ERROR.format(describe(exc)))
    elif isinstance(exc, DBOSWorkflowConflictIDError):
        # this execution lost the workflow: DBOS.cancel_workflow during a step it does
        # not preempt (seen when the step's result is written), or a hand-off (resume,
        # recovery) whose new owner goes on with the run
        if await cancelled_in_dbos(workflow_id):
            await gate.fence(run_id, why_cancelled(deadline_ms))
    elif isinstance(exc, Exception):
        await gate.end_run(run_id, exc)
    return None


# what DBOS records as the error of a workflow whose code raised DBOS's cancel error
_OWN_CANCEL_ERROR = (
    "the workflow's code raised DBOS's cancel error ({}) though DBOS had not cancelled"
    " the workflow: the run failed with it, and DBOS records the workflow ERROR (not"
    " PENDING, as an execution DBOS's own cancel ends). Fix the code that raises it;"
    " DBOS.fork_workflow runs the workflow again (a step that happened is not sent again)"
)


async def _whose_cancel(workflow_id: str, owner: str | None, exc: BaseException) -> _Whose:
    """Whose cancel error ``exc`` is, by DBOS's record. The token first: DBOS clears it
    as it cancels the workflow, before any of its checks can raise, and nothing gives it
    back, so a record still holding this execution's token was cancelled by nobody.
    Else the status: ``CANCELLED`` is DBOS's cancel; any other, another execution's
    (a resume after the cancel, a recovery). A record DBOS cannot read proves nothing:
    a step's call's own error is then the call's (R8), any other DBOS's (ADR 0106)."""
    try:
        if owner is not None and await owner_in_dbos(workflow_id) == owner:
            return _Whose.THE_CODES
        if await cancelled_in_dbos(workflow_id):
            return _Whose.DBOS
        return _Whose.HANDED_ON if owner is not None else _Whose.THE_CODES
    except Exception as failed:
        whose = _Whose.THE_CODES if exc in _RAISED_BY_A_CALL else _Whose.DBOS
        log.warning(
            "%s: DBOS's record of the workflow could not be read (%s): the cancel error"
            " (%s) is taken as %s",
            workflow_id,
            describe(short(failed)),
            describe(exc),
            "the step's call's own" if whose is _Whose.THE_CODES else "DBOS's",
        )
        return whose
