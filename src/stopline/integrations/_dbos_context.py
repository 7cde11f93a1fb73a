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
workflow. Raised by a step's own call while DBOS had not cancelled it, it is
that call's exception like any other (``unknown``, read back, R3), and the
workflow's run fails with it: taken for DBOS's cancel, the run was fenced "by
dbos" and the fence cancelled the workflow in DBOS, a cancel nobody made.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from dbos import DBOS
from dbos._context import _dbos_context_var, get_local_dbos_context
from dbos._error import DBOSWorkflowCancelledError, DBOSWorkflowConflictIDError
from dbos._sys_db import WorkflowStatusString

from stopline.errors import describe
from stopline.integrations._dbos_watch import outside_workflow, why_cancelled
from stopline.integrations._engines import EngineGate

__all__ = ["as_application", "cancelled_in_dbos", "step_body", "workflow_raised"]

log = logging.getLogger("stopline.integrations.dbos")
R = TypeVar("R")
# DBOS's cancel errors a gated step's own call raised (not DBOS's check, preemption or
# stopline's refusal, which are raised around the call): the workflow's wrapper asks
# DBOS's record of the workflow whether it was cancelled after all
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


async def workflow_raised(
    gate: EngineGate, workflow_id: str, run_id: str, deadline_ms: int | None, exc: BaseException
) -> None:
    """What the workflow's run becomes when its code raised ``exc`` (called outside
    DBOS's context). DBOS's cancel (seen at its check before a step, at a preemptible
    step's cut, or raised by stopline for a refused step) fences the run; one that a
    step's own call raised fences it only if DBOS's record says the workflow is
    cancelled, else the run fails with it as with any error. An execution that lost the
    workflow (``DBOSWorkflowConflictIDError``) fences it when DBOS cancelled it, else
    leaves it to the execution that goes on. A ``BaseException`` leaves the run as it
    is (the process is going down)."""
    if isinstance(exc, DBOSWorkflowCancelledError):
        if exc not in _RAISED_BY_A_CALL or await _cancel_recorded(workflow_id, exc):
            await gate.fence(run_id, why_cancelled(deadline_ms))
            return
        log.warning(
            "%s: a step's own call raised DBOS's cancel error (%s), DBOS had not cancelled"
            " the workflow: its run fails with it, not cancelled",
            workflow_id,
            describe(exc),
        )
        await gate.end_run(run_id, exc)
    elif isinstance(exc, DBOSWorkflowConflictIDError):
        # this execution lost the workflow: DBOS.cancel_workflow during a step it does
        # not preempt (seen when the step's result is written), or a hand-off (resume,
        # recovery) whose new owner goes on with the run
        if await cancelled_in_dbos(workflow_id):
            await gate.fence(run_id, why_cancelled(deadline_ms))
    elif isinstance(exc, Exception):
        await gate.end_run(run_id, exc)


async def _cancel_recorded(workflow_id: str, exc: BaseException) -> bool:
    """Whether DBOS cancelled the workflow whose step's call raised ``exc``. A record
    DBOS cannot read proves no cancel: the call's exception is what is known (R8)."""
    try:
        return await cancelled_in_dbos(workflow_id)
    except Exception as failed:
        log.warning(
            "%s: DBOS's record of the workflow could not be read (%s): the cancel error"
            " its step's call raised (%s) is taken as the call's own",
            workflow_id,
            describe(failed),
            describe(exc),
        )
        return False
