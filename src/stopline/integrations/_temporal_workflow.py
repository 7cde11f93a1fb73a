"""The workflow side of the Temporal integration: deterministic, sandbox-safe.

This module imports only ``temporalio`` and the standard library, because it
runs inside Temporal's workflow sandbox. The workflow talks to the ledger
only through three local activities (the worker side, ``temporal.py``):

- ``stopline.open_run`` when the workflow starts: the run exists before any
  activity, so a cancel before the first dispatch has a run to fence; a child
  workflow's run is a child of its parent's, shared when the child is started
  with ``ParentClosePolicy.ABANDON`` (it outlives its parent by design, R6);
- ``stopline.fence_run`` when Temporal delivers a workflow cancel (client, UI,
  CLI): the fence is committed *before* the workflow's code hears of the
  cancel, so nothing it does afterwards passes the gate (R1); it opens the
  run first if the cancel came before ``open_run`` did;
- ``stopline.end_run`` when the workflow ends on its own.

Every activity the workflow starts carries its ``ActivityCancellationType``
in a header, from which the worker side picks the call's phase policy.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import FailureError
from temporalio.worker import (
    ExecuteWorkflowInput,
    StartActivityInput,
    StartChildWorkflowInput,
    WorkflowInboundInterceptor,
    WorkflowOutboundInterceptor,
)

__all__ = [
    "CANCELLATION_HEADER",
    "END_RUN",
    "FENCE_RUN",
    "OPEN_RUN",
    "SHARED_HEADER",
    "StoplineWorkflowInbound",
]

OPEN_RUN = "stopline.open_run"
FENCE_RUN = "stopline.fence_run"
END_RUN = "stopline.end_run"
CANCELLATION_HEADER = "stopline-cancellation-type"
SHARED_HEADER = "stopline-shared"
_LEDGER_TIMEOUT = timedelta(seconds=30)


async def _ledger(name: str, *args: Any) -> None:
    await workflow.execute_local_activity(
        name, args=list(args), start_to_close_timeout=_LEDGER_TIMEOUT
    )


class StoplineWorkflowInbound(WorkflowInboundInterceptor):
    """Opens, fences and ends the workflow's stopline run."""

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        shared = SHARED_HEADER in input.headers and (
            workflow.payload_converter().from_payload(input.headers[SHARED_HEADER], bool)
        )
        parent = info.parent.workflow_id if info.parent is not None else ""
        run = (info.workflow_id, info.workflow_type, parent, shared)

        async def opened_then_run() -> Any:
            await _ledger(OPEN_RUN, *run)
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
                await _ledger(FENCE_RUN, *run, reason or "workflow cancel")
                main.cancel()
                result = await main
        except FailureError as exc:  # the workflow fails (a plain exception retries its task)
            await _ledger(END_RUN, info.workflow_id, f"{type(exc).__name__}: {exc}")
            raise
        await _ledger(END_RUN, info.workflow_id, "")
        return result


class _Outbound(WorkflowOutboundInterceptor):
    """Tells the worker side each activity's cancellation type and each child's ownership."""

    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        payload = workflow.payload_converter().to_payload(input.cancellation_type.name)
        input.headers = {**input.headers, CANCELLATION_HEADER: payload}
        return self.next.start_activity(input)

    async def start_child_workflow(
        self, input: StartChildWorkflowInput
    ) -> workflow.ChildWorkflowHandle[Any, Any]:
        shared = input.parent_close_policy is workflow.ParentClosePolicy.ABANDON
        payload = workflow.payload_converter().to_payload(shared)
        input.headers = {**input.headers, SHARED_HEADER: payload}
        return await self.next.start_child_workflow(input)
