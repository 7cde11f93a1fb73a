"""What Temporal tells a gated activity about the end of its call (the worker side).

- **Its horizon** (R13): the activity's own timeouts bound how long Temporal
  waits for its attempt (``start_to_close_timeout``, and what is left of its
  ``schedule_to_close_timeout``); a tool that declares no ``settles_within``
  has that bound as the horizon of its call, so a read-back that finds nothing
  before it proves nothing ("not yet"), and one after it decides.
- **Why it was cut** when its run is not fenced: a timeout (the worker's own,
  or an attempt Temporal no longer knows once its bound has passed), a worker
  shutdown, an activity Temporal no longer knows (its workflow closed under
  it), or the workflow's own code cancelling it.
- **A workflow closed under it** (terminated, timed out): Temporal runs none
  of the workflow's code then, so the integration fences the run itself.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import temporalio.client
from temporalio import activity
from temporalio.service import RPCError

from stopline.domain.vocab import Cause
from stopline.errors import NoAnswer

__all__ = ["attempt_bound", "closed_under", "why_cut"]

# a workflow Temporal closed without running its code again: the reason its run is fenced with
_CLOSED_WITHOUT_CLEANUP = {
    temporalio.client.WorkflowExecutionStatus.TERMINATED: "terminated",
    temporalio.client.WorkflowExecutionStatus.TIMED_OUT: "timed out",
}


def attempt_bound(info: activity.Info) -> float | None:
    """Seconds from this attempt's start after which Temporal has given up on it: its
    ``start_to_close_timeout``, or what its ``schedule_to_close_timeout`` leaves, the
    earlier (``None`` without either: Temporal requires one, a test environment not)."""
    bounds: list[float] = []
    if _positive(info.start_to_close_timeout):
        assert info.start_to_close_timeout is not None
        bounds.append(info.start_to_close_timeout.total_seconds())
    if _positive(info.schedule_to_close_timeout):
        assert info.schedule_to_close_timeout is not None
        spent = (info.started_time - info.scheduled_time).total_seconds()
        bounds.append(max(0.0, info.schedule_to_close_timeout.total_seconds() - spent))
    return min(bounds) if bounds else None


def _past_its_bound(info: activity.Info) -> bool:
    bound = attempt_bound(info)
    if bound is None:
        return False
    return datetime.now(UTC) >= info.started_time + timedelta(seconds=bound)


def _positive(timeout: timedelta | None) -> bool:
    return timeout is not None and timeout > timedelta(0)


def why_cut() -> NoAnswer:
    """Why Temporal cut an activity whose run is not fenced: never a user's cancel. An
    attempt Temporal no longer knows once its bound has passed was timed out: that is
    how a worker hears of a start-to-close or schedule-to-close timeout (the server
    answers its next heartbeat "not found"; ``timed_out`` is the worker's own)."""
    details = activity.cancellation_details()
    if details is not None and details.timed_out:
        return NoAnswer(Cause.TIMEOUT, "Temporal timed the activity out")
    if details is not None and details.not_found and _past_its_bound(activity.info()):
        return NoAnswer(
            Cause.TIMEOUT, "Temporal timed the activity's attempt out (its timeout had passed)"
        )
    if details is not None and details.worker_shutdown:
        return NoAnswer(Cause.LOCAL_ERROR, "the worker shut down")
    if details is not None and details.not_found:
        return NoAnswer(
            Cause.LOCAL_ERROR,
            "Temporal no longer knows the activity (its workflow closed, or its attempt ended)",
        )
    return NoAnswer(
        Cause.LOCAL_ERROR, "Temporal cancelled the activity (the workflow's code, not the run)"
    )


async def closed_under(client: temporalio.client.Client | None, info: activity.Info) -> str:
    """The reason to fence the activity's run with when Temporal cut it because its
    workflow execution was closed without running its code again (``"terminated"``,
    ``"timed out"``); ``""`` otherwise, or when Temporal cannot say.

    Only when that execution is still the workflow id's latest: a reset closes it as
    terminated too, and its new execution goes on in the same run (it replays the
    run's opening from history); so may a retry or cron after a timeout, or a new
    start, whose own code ends its run."""
    details = activity.cancellation_details()
    if client is None or details is None or not details.not_found or not info.workflow_id:
        return ""
    try:
        described = await client.get_workflow_handle(info.workflow_id).describe()
    except RPCError:
        return ""
    if described.run_id != info.workflow_run_id or described.status is None:
        return ""
    return _CLOSED_WITHOUT_CLEANUP.get(described.status, "")
