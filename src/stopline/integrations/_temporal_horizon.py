"""What Temporal tells a gated activity about the end of its call (the worker side).

- **Its horizon** (R13): the activity's own timeouts bound how long Temporal
  waits for its attempt (``start_to_close_timeout``, and what is left of its
  ``schedule_to_close_timeout``); a tool that declares no ``settles_within``
  has that bound as the horizon of its call, so a read-back that finds nothing
  before it proves nothing ("not yet"), and one after it decides. A call cut
  after it (a worker frozen past it) ran until its cut: its horizon is the cut
  plus the bound (``EngineGate``'s rule for an engine's bound, ADR 0085).
- **Why it was cut** when its run is not fenced: a timeout (the worker's own,
  one the server decided, which the worker hears of as "not found" at its next
  heartbeat: Temporal's record of the attempt names it, ADR 0085; or an attempt
  Temporal no longer knows once its bound has passed), a worker shutdown, an
  activity Temporal no longer knows (its workflow closed under it), the
  workflow's own code cancelling it, or (a standalone activity) a client's
  cancel of the activity.
- **A workflow closed under it** (terminated, timed out): Temporal runs none
  of the workflow's code then, so the integration fences the run itself; so
  for a standalone activity Temporal closed (terminated, timed out, cancelled)
  while its attempt ran.
- **Whether Temporal retries it** (``retried``): a standalone activity's run
  ends with its execution's last attempt, and only then (ADR 0103).
- **A client's cancel of a standalone activity** (``client_cancel``): its
  run's cancel, with the client's reason (ADR 0103).
- **A retry's "not yet"** (R13): a retry of a call in doubt whose read-back
  finds nothing before the horizon sends nothing; Temporal's next attempt is
  scheduled at the horizon (``in_doubt``), and an attempt that none follows
  then (its retry policy spent, its ``schedule_to_close_timeout`` passed) waits
  for the horizon in place and looks again (``waits_here``), so "not yet" costs
  no attempt it cannot spare; nor does its message promise a retry that will
  not come.
- **A retry that meets its call in flight** (``requested``, ``accepted``: an
  earlier attempt's worker crashed mid-call and recovery has not taken the call
  yet, or froze and is still at work) waits in place for that call's answer or
  for recovery to take it, within its own timeout, then passes the gate again
  (``decidable_here``, ADR 0105): it no longer spends the retry policy's
  attempts at its pace and fails the activity on the last one.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import temporalio.client
from temporalio import activity
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from stopline.domain.receipt import horizon_words
from stopline.domain.vocab import Cause, OpStatus
from stopline.errors import NoAnswer, OperationInDoubt
from stopline.integrations._engine_doubt import decided_at, in_flight, until_decidable
from stopline.integrations._engines import EngineGate
from stopline.runtime.ledger import Ledger

__all__ = [
    "ACTIVITY_CLOSED",
    "attempt_bound",
    "client_cancel",
    "closed_under",
    "decidable_here",
    "in_doubt",
    "retried",
    "server_timeout",
    "waits_here",
    "why_cut",
]

# a call in doubt no later look can prove (no retry: review); another (``requested``,
# ``accepted``) is in flight elsewhere, and a later attempt finds its outcome
_IN_DOUBT_FOR_GOOD = frozenset({OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW})

# a workflow Temporal closed without running its code again: the reason its run is fenced with
_CLOSED_WITHOUT_CLEANUP = {
    temporalio.client.WorkflowExecutionStatus.TERMINATED: "terminated",
    temporalio.client.WorkflowExecutionStatus.TIMED_OUT: "timed out",
}
# a standalone activity Temporal closed while an attempt of it ran (no attempt follows)
ACTIVITY_CLOSED = {
    temporalio.client.ActivityExecutionStatus.TERMINATED: "terminated",
    temporalio.client.ActivityExecutionStatus.TIMED_OUT: "timed out",
    temporalio.client.ActivityExecutionStatus.CANCELED: "cancelled",
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


def _attempt_ends(info: activity.Info) -> float | None:
    """When a wait of this attempt stops (epoch seconds): a moment before Temporal's own
    bound on it (a tenth of it, at most a second), so that the attempt says why it
    stopped rather than being timed out; ``None`` without a bound."""
    bound = attempt_bound(info)
    if bound is None:
        return None
    return info.started_time.timestamp() + bound - min(1.0, bound / 10)


def _positive(timeout: timedelta | None) -> bool:
    return timeout is not None and timeout > timedelta(0)


# how long the cut's record waits for Temporal to say why (then: it cannot say)
_ASK = timedelta(seconds=5)
# what Temporal's timeout types are called in a receipt
_TIMEOUTS = {
    TimeoutType.TIMEOUT_TYPE_HEARTBEAT: "heartbeat timeout: no heartbeat reached Temporal"
    " within the activity's heartbeat_timeout",
    TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE: "start-to-close timeout",
    TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_CLOSE: "schedule-to-close timeout",
    TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START: "schedule-to-start timeout",
}


async def why_cut(client: temporalio.client.Client | None) -> NoAnswer:
    """Why Temporal cut an activity whose run is not fenced: never a user's cancel.

    A timeout the server decided (a heartbeat timeout above all: the worker's process
    froze, or its heartbeats were lost) is heard of as "not found" at the worker's next
    heartbeat, while the attempt's code may have run on until then: Temporal's record
    of the attempt (``server_timeout``) names it; failing that, an attempt Temporal no
    longer knows once its bound has passed was timed out too. ``timed_out`` is the
    worker's own timeout."""
    details = activity.cancellation_details()
    if details is not None and details.timed_out:
        return NoAnswer(Cause.TIMEOUT, "Temporal timed the activity out")
    info = activity.info()
    timeout = await server_timeout(client, info) if details and details.not_found else None
    if timeout is not None:
        return NoAnswer(
            Cause.TIMEOUT,
            f"Temporal timed attempt {info.attempt} of the activity out ({timeout}); its"
            " code ran on in the worker until its next heartbeat heard of it",
        )
    if details is not None and details.not_found and _past_its_bound(info):
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
    if not info.workflow_id:  # a standalone activity: no workflow's code to cancel it
        return NoAnswer(
            Cause.USER_CANCEL,
            "a client cancelled the activity in Temporal (a standalone activity: its run,"
            " the activity's own, is cancelled with it)",
        )
    return NoAnswer(
        Cause.LOCAL_ERROR, "Temporal cancelled the activity (the workflow's code, not the run)"
    )


async def server_timeout(
    client: temporalio.client.Client | None, info: activity.Info
) -> str | None:
    """The timeout Temporal ended this attempt with, as Temporal recorded it: the
    failure of the attempt that followed it (a pending activity's ``last_failure``,
    or, once it ended, its ``ActivityTaskStarted``'s), else the activity's
    ``ActivityTaskTimedOut`` of this attempt (its last) in the history; ``None`` when
    it was not a timeout or Temporal cannot say."""
    if client is None or not info.workflow_id:
        return None
    handle = client.get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
    try:
        described = await handle.describe(rpc_timeout=_ASK)
        for pending in described.raw_description.pending_activities:
            if pending.activity_id == info.activity_id:  # retried: its last failure is ours
                ours = pending.attempt == info.attempt + 1
                return _timeout(pending.last_failure) if ours else None
        scheduled: set[int] = set()
        async for event in handle.fetch_history_events(rpc_timeout=_ASK):
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                if event.activity_task_scheduled_event_attributes.activity_id == info.activity_id:
                    scheduled.add(event.event_id)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                started = event.activity_task_started_event_attributes
                if started.scheduled_event_id in scheduled and started.attempt > info.attempt:
                    ours = started.attempt == info.attempt + 1  # its last failure is ours
                    return _timeout(started.last_failure) if ours else None
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
                timed_out = event.activity_task_timed_out_event_attributes
                if timed_out.scheduled_event_id in scheduled:  # no later attempt started
                    return _timeout(timed_out.failure)
    except RPCError:
        pass
    return None


def _timeout(failure: Failure) -> str | None:
    """The timeout ``failure`` is, if it is one."""
    if not failure.HasField("timeout_failure_info"):
        return None
    return _TIMEOUTS.get(failure.timeout_failure_info.timeout_type, "timeout")


async def closed_under(client: temporalio.client.Client | None, info: activity.Info) -> str:
    """The reason to fence the activity's run with when Temporal cut it because its
    workflow execution was closed without running its code again (``"terminated"``,
    ``"timed out"``), or (a standalone activity) Temporal closed the activity itself
    (those, or ``"cancelled"``: no attempt follows); ``""`` otherwise, or when
    Temporal cannot say.

    Only when that execution is still the workflow id's latest: a reset closes it as
    terminated too, and its new execution goes on in the same run (it replays the
    run's opening from history); so may a retry or cron after a timeout, or a new
    start, whose own code ends its run."""
    details = activity.cancellation_details()
    if client is None or details is None:
        return ""
    if not info.workflow_id and (details.not_found or details.timed_out):
        handle = client.get_activity_handle(info.activity_id, run_id=info.activity_run_id)
        try:
            status = (await handle.describe(rpc_timeout=_ASK)).status
        except RPCError:
            return ""
        return ACTIVITY_CLOSED.get(status, "")  # running: another attempt comes
    if not details.not_found or not info.workflow_id:
        return ""
    try:
        described = await client.get_workflow_handle(info.workflow_id).describe()
    except RPCError:
        return ""
    if described.run_id != info.workflow_run_id or described.status is None:
        return ""
    return _CLOSED_WITHOUT_CLEANUP.get(described.status, "")


async def client_cancel(client: temporalio.client.Client | None, info: activity.Info) -> str | None:
    """The reason a client gave when it cancelled this standalone activity in Temporal
    (``""`` when Temporal cannot say): its run's cancel (ADR 0103), as a workflow cancel
    is its workflow's run's. ``None`` when the attempt was not cut by such a cancel (a
    workflow's activity, a timeout, a pause, a shutdown)."""
    details = activity.cancellation_details()
    if info.workflow_id or details is None or not details.cancel_requested:
        return None
    if client is None:
        return ""
    handle = client.get_activity_handle(info.activity_id, run_id=info.activity_run_id)
    try:
        return (await handle.describe(rpc_timeout=_ASK)).canceled_reason or ""
    except RPCError:
        return ""


def retried(info: activity.Info, error: BaseException) -> bool:
    """Whether Temporal starts another attempt after this one fails with ``error``: not
    non-retryable, and ``_retried_at`` its next attempt's moment (its
    ``next_retry_delay``, else its retry policy's backoff), by the failure's type (an
    ``ApplicationError``'s, else the exception's class name, as Temporal records it)."""
    delay = None
    if isinstance(error, ApplicationError):
        if error.non_retryable:
            return False
        kind, delay = error.type or "", error.next_retry_delay
    else:
        kind = type(error).__name__
    if delay is None:
        delay = _backoff(info)
    return _retried_at(info, time.time() + delay.total_seconds(), kind)


def _backoff(info: activity.Info) -> timedelta:
    """The wait Temporal's retry policy puts before the next attempt (none sent: none)."""
    policy = info.retry_policy
    if policy is None:
        return timedelta(0)
    cap = (policy.maximum_interval or policy.initial_interval * 100).total_seconds()
    try:
        wait = policy.initial_interval.total_seconds() * policy.backoff_coefficient ** (
            info.attempt - 1
        )
    except OverflowError:  # a long run of attempts: the cap
        wait = cap
    return timedelta(seconds=min(wait, cap))


def _retried_at(info: activity.Info, at: float, kind: str = "OperationInDoubt") -> bool:
    """Whether Temporal starts another attempt at ``at`` (epoch seconds) after this one
    fails with an error of type ``kind`` (in doubt: ``OperationInDoubt``): its retry
    policy has an attempt left and does not name ``kind``, and its
    ``schedule_to_close_timeout`` has not passed by then (a policy Temporal did not
    send: its default, unlimited)."""
    policy = info.retry_policy
    if policy is not None:
        if policy.maximum_attempts and info.attempt >= policy.maximum_attempts:
            return False
        if kind in (policy.non_retryable_error_types or ()):
            return False
    if _positive(info.schedule_to_close_timeout):
        assert info.schedule_to_close_timeout is not None
        return _moment(at) < info.scheduled_time + info.schedule_to_close_timeout
    return True


async def waits_here(ledger: Ledger, exc: OperationInDoubt, info: activity.Info) -> float | None:
    """The moment this attempt waits for and looks again at, when the read-back of its call
    in doubt said "not yet" (R13) and no attempt of Temporal's follows it then: its
    horizon, if this attempt's own bound has room for the wait (a wait past it would be
    cut by Temporal's timeout); ``None`` when the next attempt looks, or none can."""
    at = await decided_at(ledger, exc)
    if at is None or _retried_at(info, at):
        return None
    bound = attempt_bound(info)
    if bound is not None and info.started_time + timedelta(seconds=bound) <= _moment(at):
        return None
    return at


async def decidable_here(
    gate: EngineGate, run_id: str, exc: OperationInDoubt, info: activity.Info
) -> bool:
    """Whether this attempt, its call in doubt, waited here until the gate can decide it
    (then it passes the gate again), its beats going on meanwhile (a Temporal cancel
    reaches it; a stopline cancel ends the wait as the gate would refuse, ``RunFenced``).
    In flight (another attempt's call, ADR 0105): until that call answers or recovery
    takes it, within this attempt's own timeout. "Not yet" (R13): until its horizon,
    when no attempt of Temporal's follows then (``waits_here``). False: it fails in
    doubt (``in_doubt``)."""
    if in_flight(exc):
        return await until_decidable(gate, run_id, exc, None, until=_attempt_ends(info))
    at = await waits_here(gate.ledger, exc, info)
    return at is not None and await until_decidable(gate, run_id, exc, at)


async def in_doubt(ledger: Ledger, exc: OperationInDoubt, info: activity.Info) -> ApplicationError:
    """What the activity fails with when its call is in doubt. Before its horizon ("not
    yet", R13): retried at the horizon (``next_retry_delay``), when the read-back decides,
    and the message says whether Temporal's next attempt is that look, or none is left
    for it. Else the call is in flight elsewhere (a later attempt finds its outcome), or
    nobody can prove it: no retry, it waits in review."""
    at = await decided_at(ledger, exc)
    if at is None and in_flight(exc):
        return ApplicationError(f"{exc}: {_still_in_flight(info)}", type="OperationInDoubt")
    if at is None:
        return ApplicationError(
            str(exc), type="OperationInDoubt", non_retryable=exc.status in _IN_DOUBT_FOR_GOOD
        )
    until = horizon_words(at)
    then = (
        "the next attempt reads it back then"
        if _retried_at(info, at)
        else "no attempt of the activity is left to read it back then (its retry policy or"
        " schedule_to_close_timeout): the run's receipt says what the read-back finds"
    )
    return ApplicationError(
        f"{exc}: not yet: nothing found, and it may still land until {until}; {then}",
        type="OperationInDoubt",
        next_retry_delay=timedelta(seconds=max(0.0, at - time.time())),
    )


def _still_in_flight(info: activity.Info) -> str:
    """What an attempt that waited for another attempt's call in flight says at its end."""
    then = (
        "the next attempt waits for it again"
        if _retried_at(info, time.time())
        else "no attempt of the activity is left to wait for it: the run's receipt says"
        " what the read-back finds once recovery takes it"
    )
    return (
        "its call is still in flight in an earlier attempt (its worker at work, or dead"
        f" and not yet taken by the ledger's recovery) after this attempt's timeout; {then}"
    )


def _moment(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)
