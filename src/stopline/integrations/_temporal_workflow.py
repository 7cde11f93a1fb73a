"""The workflow side of the Temporal integration: deterministic, sandbox-safe.

This module imports only ``temporalio`` and the standard library, because it
runs inside Temporal's workflow sandbox. The workflow talks to the ledger
only through three local activities (the worker side, ``_temporal_ledger``):

- ``stopline.open_run`` when the workflow starts: the run exists before any
  activity, so a cancel before the first dispatch has a run to fence; a child
  workflow's run is a child of its parent's, shared when the child is started
  with ``ParentClosePolicy.ABANDON`` (it outlives its parent by design, R6).
  It answers the run's id (ADR 0050): the workflow id's run, or a run of this
  execution's own when the workflow id's run ended on its own before; and the
  execution its activities' keys name: a reset execution names the one it was
  reset from (``original_execution_run_id``, ADR 0073);
- ``stopline.fence_run`` when Temporal delivers a workflow cancel (client, UI,
  CLI): the fence is committed *before* the workflow's code hears of the
  cancel, so nothing it does afterwards passes the gate (R1); it opens the
  run first if the cancel came before ``open_run`` did;
- ``stopline.end_run`` when the workflow ends on its own. A fault that may clear is
  retried while it lasts; one no retry can fix (the ledger refuses the write) fails
  the workflow, typed and non-retryable, naming its run, left as the ledger holds it
  (ADR 0111), until a worker's look ends it as Temporal recorded the workflow's end
  (ADR 0119, ``_temporal_closed``).

Every activity the workflow starts carries its ``ActivityCancellationType``
and its run's id in headers, from which the worker side picks the call's
phase policy and its run (a local activity also its call, ``LOCAL_HEADER``);
a child workflow carries its parent's run, and a continue-as-new the run it
goes on with and what its keys named: the next execution's keys name its place
in the chain (``FIRST~N``, ADR 0119), so that the continuation of a reset
execution reaches the operations of the one it re-runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from temporalio.worker import (
    ContinueAsNewInput,
    ExecuteWorkflowInput,
    StartActivityInput,
    StartChildWorkflowInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowOutboundInterceptor,
)

__all__ = [
    "CANCELLATION_HEADER",
    "END_RUN",
    "EXECUTION_HEADER",
    "FENCE_RUN",
    "LOCAL_HEADER",
    "OPEN_RUN",
    "RUN_HEADER",
    "SHARED_HEADER",
    "StoplineWorkflowInbound",
]

OPEN_RUN = "stopline.open_run"
FENCE_RUN = "stopline.fence_run"
END_RUN = "stopline.end_run"
CANCELLATION_HEADER = "stopline-cancellation-type"
SHARED_HEADER = "stopline-shared"
RUN_HEADER = "stopline-run"  # the stopline run an activity, child or continuation belongs to
# the execution an activity's key names: its workflow's own, or the cancelled one a re-entry
# after a resume goes on with (ADR 0056)
EXECUTION_HEADER = "stopline-execution"
# a local activity's call in its execution (``local-N``, the Nth started): Temporal gives a
# local activity retried after a backoff (past its ``local_retry_threshold``) a new activity
# id, so that id does not name the call across its attempts
LOCAL_HEADER = "stopline-local-activity"
_LEDGER_TIMEOUT = timedelta(seconds=30)
# a ledger write that cannot succeed fails at once (the worker side makes it non-retryable,
# ``_temporal_ledger``); one that may (a lock, a lost connection) is retried at most 5 s
# apart while it lasts: Temporal's default waited up to 100 s once the ledger was back
_LEDGER_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=100),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
)


async def _ledger(name: str, *args: Any) -> Any:
    return await workflow.execute_local_activity(
        name, args=list(args), start_to_close_timeout=_LEDGER_TIMEOUT, retry_policy=_LEDGER_RETRY
    )


def _not_ended(run_id: str, exc: ActivityError | ApplicationError) -> ApplicationError:
    """The workflow's failure when its code returned and the ledger refused its run's end
    for good (ADR 0111): named as the ledger's error, non-retryable (a retry of the
    workflow would run its code again), the run left as the ledger holds it."""
    cause = exc.cause if isinstance(exc, ActivityError) else exc
    kind = cause.type if isinstance(cause, ApplicationError) and cause.type else "LedgerError"
    said = cause.message if isinstance(cause, ApplicationError) else str(exc)
    then = (
        "; a worker's look ends it as Temporal records this failure once the ledger takes"
        " the write (ADR 0119)"
        if kind.startswith("Ledger")
        else ""
    )
    return ApplicationError(
        f"the workflow's code returned, but the ledger did not end its run {run_id!r}"
        f" ({kind}: {said}): the run is left as the ledger holds it, its receipt saying what"
        f" its calls did{then}",
        type=kind,
        non_retryable=True,
    )


def _header(input: ExecuteWorkflowInput, name: str, kind: type[Any], default: Any) -> Any:
    payload = input.headers.get(name)
    return default if payload is None else workflow.payload_converter().from_payload(payload, kind)


class StoplineWorkflowInbound(WorkflowInboundInterceptor):
    """Opens, fences and ends the workflow's stopline run."""

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        self._outbound = _Outbound(outbound)
        super().init(self._outbound)

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        parent = info.parent.workflow_id if info.parent is not None else ""
        # (workflow id, this execution, type, the parent's run, the parent's workflow id,
        # shared, the run a continue-as-new goes on with)
        execution = (
            info.workflow_id,
            info.run_id,
            info.workflow_type,
            _header(input, RUN_HEADER, str, "") if parent else "",
            parent,
            _header(input, SHARED_HEADER, bool, False),
            "" if parent else _header(input, RUN_HEADER, str, ""),
        )
        # the execution a reset one was reset from (ADR 0073): its own unless reset; and
        # what the keys of the execution a continue-as-new goes on from named (ADR 0119)
        original = info.original_execution_run_id or info.run_id
        continued = "" if parent else _header(input, EXECUTION_HEADER, str, "")
        outbound = self._outbound

        async def opened_then_run() -> Any:
            opened = await _ledger(OPEN_RUN, *execution, original, continued)
            # a history recorded before open_run answered: the run was the workflow id's;
            # before it answered with the execution the keys name: this one
            if isinstance(opened, list) and len(opened) == 2:
                outbound.run_id, outbound.keyed_by = (str(part) for part in opened)
            else:
                outbound.run_id = opened if isinstance(opened, str) else info.workflow_id
                outbound.keyed_by = info.run_id
            return await self.next.execute_workflow(input)

        main = asyncio.ensure_future(opened_then_run())
        try:
            try:
                result = await asyncio.shield(main)
            except asyncio.CancelledError:
                reason = workflow.cancellation_reason()
                if reason is None or main.done():  # not a workflow cancel (eviction...)
                    main.cancel()
                    raise
                # R1: fence first (opening the run if the cancel came before it was
                # opened), then let the workflow's code hear of the cancel
                said = reason or "workflow cancel"
                await _ledger(FENCE_RUN, *execution, said, original, continued)
                main.cancel()
                result = await main
        except FailureError as exc:  # the workflow fails (a plain exception retries its task)
            if outbound.run_id:  # else its run never opened: nothing to end
                try:
                    await _ledger(END_RUN, outbound.run_id, f"{type(exc).__name__}: {exc}")
                except (ActivityError, ApplicationError) as refused:  # its own is the failure
                    workflow.logger.error(
                        "the ledger did not end run %r: %s", outbound.run_id, refused
                    )
            raise
        try:
            await _ledger(END_RUN, outbound.run_id, "")
        except (ActivityError, ApplicationError) as exc:  # a local activity's failure
            # refused for good (a fault that may clear is retried): a retry would be too
            raise _not_ended(outbound.run_id, exc) from exc
        return result


class _Outbound(WorkflowOutboundInterceptor):
    """Tells the worker side each activity's cancellation type and run, each child's
    ownership and parent run, and a continuation's run."""

    run_id = ""  # the workflow's stopline run, once open_run has answered
    keyed_by = ""  # the execution its activities' keys name, from the same answer
    local_calls = 0  # the local activities this execution has started

    def _with_run(self, headers: dict[str, Payload]) -> dict[str, Payload]:
        if self.run_id:
            headers[RUN_HEADER] = workflow.payload_converter().to_payload(self.run_id)
        return headers

    def _activity_headers(
        self, headers: Mapping[str, Payload], cancellation: str
    ) -> dict[str, Payload]:
        convert = workflow.payload_converter().to_payload
        headers = self._with_run({**headers, CANCELLATION_HEADER: convert(cancellation)})
        if self.keyed_by:
            headers[EXECUTION_HEADER] = convert(self.keyed_by)
        return headers

    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._activity_headers(input.headers, input.cancellation_type.name)
        return self.next.start_activity(input)

    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._activity_headers(input.headers, input.cancellation_type.name)
        self.local_calls += 1  # deterministic: a replay starts them in the same order
        if input.activity_id is None:  # else the id the workflow gave it names it
            call = workflow.payload_converter().to_payload(f"local-{self.local_calls}")
            input.headers = {**input.headers, LOCAL_HEADER: call}
        return self.next.start_local_activity(input)

    async def start_child_workflow(
        self, input: StartChildWorkflowInput
    ) -> workflow.ChildWorkflowHandle[Any, Any]:
        shared = input.parent_close_policy is workflow.ParentClosePolicy.ABANDON
        payload = workflow.payload_converter().to_payload(shared)
        input.headers = self._with_run({**input.headers, SHARED_HEADER: payload})
        return await self.next.start_child_workflow(input)

    def continue_as_new(self, input: ContinueAsNewInput) -> NoReturn:
        """The next execution goes on in the run, its keys named after this one's (its
        place in the chain, which a reset of an earlier execution comes to again)."""
        input.headers = self._with_run(dict(input.headers))
        if self.keyed_by:
            convert = workflow.payload_converter().to_payload
            input.headers[EXECUTION_HEADER] = convert(self.keyed_by)
        self.next.continue_as_new(input)
