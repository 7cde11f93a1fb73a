"""What the seventh engines probe found, on a real Temporal dev server and a real DBOS.

- **A retry of a call in doubt failed for good before its horizon (R13).** An activity
  whose tool declares no ``settles_within`` (a remote provider's: its horizon is its
  attempt's timeout) failed its first attempt after dispatch and before any effect
  (the connection dropped). Temporal's retry reached the operation ``unknown``; the
  read-back found nothing, which before the horizon proves nothing ("not yet"), and
  the retry raised a non-retryable ``OperationInDoubt``: the workflow failed, though
  its retry policy allowed more attempts and the read-back after the horizon decides.
  Now the next attempt is scheduled at the horizon, reads back, and sends once. On
  DBOS a step declaring ``settles_within`` burned its retries in milliseconds
  (``DBOSMaxStepRetriesExceeded``); now it waits for the horizon in place, unless DBOS
  cancelled the workflow meanwhile.
- **A local activity retried after a backoff was sent again.** Temporal gives a local
  activity whose retry comes after a backoff past its ``local_retry_threshold`` a new
  activity id; the key named the activity id, so the retry was a new operation and
  its effect happened twice. Its key now names its call in the execution
  (``local-N``, carried in a header from the workflow side). The plugin also
  heartbeated local activities, which have no heartbeat: Temporal's core warned at
  every beat.
- **A gated DBOS step in a workflow that is not gated** opened the workflow's run
  itself, which nothing ever ended: its receipt said "Running." for ever while DBOS
  said the workflow succeeded. Now the step is refused before dispatch
  (``InvalidInput`` naming the workflow and the fix), nothing written or sent.

Ground truth is the provider's own file; barriers, no sleeps.
"""

from __future__ import annotations

import contextvars
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID
from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    Interceptor,
    Worker,
)

from stopline import Headline, OpStatus, ReadBack
from stopline.errors import UnknownRun
from stopline.integrations.dbos import call_context as dbos_call
from stopline.integrations.temporal import call_context
from stopline.integrations.temporal_server import TemporalDevServer
from stopline.runtime.context import CallContext
from tests.engines import dbos_app
from tests.engines.dbos_harness import harness as dbos_harness
from tests.engines.dbos_harness import status, until_status
from tests.engines.temporal_harness import activities, harness, plugin, worker_for
from tests.engines.temporal_workflows import Plan

# -- Temporal ---------------------------------------------------------------------


async def test_a_temporal_retry_in_doubt_waits_for_its_horizon_and_sends_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """``flaky`` (a remote provider's tool: no ``settles_within``, its horizon the 2 s
    ``start_to_close_timeout``) loses its connection on attempt 1, after dispatch, before
    any effect. Attempt 2 reads back "not found" before the horizon: not yet. The
    workflow does not fail (old: a non-retryable ``OperationInDoubt``); the attempt
    after the horizon reads back again, finds nothing, and sends once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        ran: list[int] = []  # the attempts whose code ran (not refused by the gate)

        @activity.defn(name="flaky")
        async def flaky(payload: str) -> Any:
            ran.append(activity.info().attempt)
            if activity.info().attempt == 1:
                raise ConnectionError("connection reset: the request did not arrive")
            return await h.provider.send(call_context().key, payload)

        tool = h.provider.tool("flaky", flaky, "upload it remotely", None)
        async with worker_for(h, flaky, tools=[tool]):
            handle = await h.start(Plan(["flaky"], maximum_attempts=3, start_to_close=2))
            with anyio.fail_after(30):
                (result,) = await handle.result()  # old: WorkflowFailureError
            receipt = await h.ledger.wait_settled(handle.id, timeout=15)
    assert h.provider.effects() == [result["id"]]  # sent once
    assert ran == [1, 3]  # attempt 2 sent nothing: "not yet"; attempt 3 after the horizon
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


@workflow.defn(sandboxed=False)
class LocalCalls:
    """``lossy`` as a local activity whose retry comes after a backoff past its
    ``local_retry_threshold`` (Temporal gives it a new activity id), then ``notify``."""

    @workflow.run
    async def run(self) -> list[Any]:
        lossy = await workflow.execute_local_activity(
            "lossy",
            args=["local upload"],
            start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=300)),
            local_retry_threshold=timedelta(milliseconds=100),
        )
        notify = await workflow.execute_activity(
            "notify", args=["remote notify"], start_to_close_timeout=timedelta(seconds=10)
        )
        return [lossy, notify]


class _Beats(Interceptor):
    """Records every heartbeat the activities send, local or not."""

    def __init__(self) -> None:
        self.sent: list[bool] = []  # per heartbeat: whether its activity is local

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        beats = self

        class Inbound(ActivityInboundInterceptor):
            def init(self, outbound: ActivityOutboundInterceptor) -> None:
                class Outbound(ActivityOutboundInterceptor):
                    def heartbeat(self, *details: Any) -> None:
                        beats.sent.append(activity.info().is_local)
                        super().heartbeat(*details)

                super().init(Outbound(outbound))

        return Inbound(next)


async def test_a_local_activity_retried_after_a_backoff_is_one_call_sent_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """``lossy``, a local activity, reaches the provider, which commits, and loses the
    answer (attempt 1 raises). Temporal retries it after a backoff past its
    ``local_retry_threshold``, under a new activity id (old: a new operation, sent
    again: two effects, two "completed" lines). The retry is the same call: read back,
    committed, nothing sent again. A local activity gets no heartbeat (it has none:
    each one was refused with a warning from Temporal's core); ``notify`` does."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        ran: list[str] = []  # the activity id of each attempt whose code ran

        @activity.defn(name="lossy")
        async def lossy(payload: str) -> Any:
            ran.append(activity.info().activity_id)
            out = await h.provider.send(call_context().key, payload)
            if activity.info().attempt == 1:
                raise ConnectionError("connection reset: the answer was lost")
            return out

        acts = activities(h.provider)
        beats = _Beats()
        async with Worker(
            h.client,
            task_queue=h.task_queue,
            workflows=[LocalCalls],
            activities=[*acts, lossy],
            interceptors=[beats],
            plugins=[plugin(h.ledger, h.provider, acts, h.provider.tool("lossy", lossy))],
        ):
            handle = await h.client.start_workflow(
                LocalCalls.run, id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=h.task_queue
            )
            with anyio.fail_after(30):
                uploaded, notified = await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
    assert h.provider.effects() == [uploaded["id"], notified["id"]]  # old: lossy twice
    assert len(ran) == 1  # the retry sent nothing: its call was read back
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 2
    assert False in beats.sent  # notify's heartbeats
    assert True not in beats.sent  # old: the local activity's, refused by Temporal


# -- DBOS -------------------------------------------------------------------------

_attempts: list[str] = []  # the workflow ids whose ``flaky`` code ran, once per attempt
_read: list[anyio.Event] = []  # set at each read-back of ``flaky`` by a step's retry


# set in ``flaky``'s call: the read-back its loss starts in the background sees it; a
# retry's own read-back, made before its call, does not (ADR 0106: no read-back runs in
# DBOS's context, so ``DBOS.workflow_id`` no longer tells them apart)
_lost_here: contextvars.ContextVar[bool] = contextvars.ContextVar("lost_here", default=False)


async def _read_back(ctx: CallContext) -> ReadBack:
    if _read and not _lost_here.get():  # a retry's own (not the ledger's own)
        _read.pop(0).set()
    return await dbos_app._verify(ctx)


@DBOS.step(retries_allowed=True, interval_seconds=0.05, backoff_rate=1.0, max_attempts=4)
@dbos_app.gate.step(description="upload it remotely", verify=_read_back, settles_within=1.5)
async def flaky(payload: str) -> dict[str, Any]:
    workflow_id = DBOS.workflow_id or ""
    _lost_here.set(True)
    _attempts.append(workflow_id)
    if _attempts.count(workflow_id) == 1:
        raise ConnectionError("connection reset: the request did not arrive")
    return await dbos_app._provider[0].send(dbos_call().key, payload)


@DBOS.workflow()
@dbos_app.gate.workflow()
async def flaky_flow() -> Any:
    return await flaky("remote upload")


@DBOS.workflow()  # its author forgot @gate.workflow()
async def ungated_flow() -> Any:
    return await dbos_app.upload("from an ungated workflow")


async def test_a_dbos_step_retry_in_doubt_waits_for_its_horizon_and_sends_once(
    tmp_path: Path,
) -> None:
    """``flaky`` declares ``settles_within=1.5`` and DBOS retries; its first attempt loses
    its connection before any effect. The retry's read-back finds nothing before the
    horizon: it waits for it (old: every retry raised ``OperationInDoubt`` at once,
    ``DBOSMaxStepRetriesExceeded``), reads back again and sends once."""
    async with dbos_harness("sqlite", tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(flaky_flow)
        with anyio.fail_after(30):
            result = await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert h.provider.effects() == [result["id"]]  # sent once
    assert _attempts.count(workflow_id) == 2  # the failed attempt, then the one that sent
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_dbos_cancel_while_a_retry_waits_for_the_horizon_sends_nothing(
    tmp_path: Path,
) -> None:
    """As above, and ``DBOS.cancel_workflow`` comes while the retry waits for the horizon
    (the step is not preemptible): after the wait the step sends nothing; the run is
    fenced by DBOS's cancel and settles with the call read back as never made."""
    async with dbos_harness("sqlite", tmp_path) as h:
        first = anyio.Event()
        _read[:] = [first]
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(flaky_flow)
        with anyio.fail_after(30):
            await first.wait()  # the retry's read-back: "not yet"; it waits from here
        await DBOS.cancel_workflow_async(workflow_id)
        await until_status(workflow_id, "CANCELLED")
        with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
            await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        run = await h.ledger.backend.get_run(workflow_id)
    assert h.provider.effects() == []  # nothing sent after the cancel
    assert _attempts.count(workflow_id) == 1
    assert run.cancelled_by == "dbos" and run.cancel_reason == "DBOS.cancel_workflow"
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]


async def test_a_gated_step_in_an_ungated_dbos_workflow_is_refused_before_dispatch(
    tmp_path: Path,
) -> None:
    """The workflow lacks ``@gate.workflow()``; its gated ``upload`` would open the run
    and nothing would end it (old: the receipt said "Running." for ever while DBOS said
    SUCCESS). The step is refused (``InvalidInput`` naming the fix) before dispatch:
    nothing sent, no run written; DBOS says the workflow failed."""
    async with dbos_harness("sqlite", tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(ungated_flow)
        refused = r"is not gated itself.*@gate\.workflow\(\)"  # the problem, and the fix
        with anyio.fail_after(30), pytest.raises(Exception, match=refused):
            await handle.get_result()
        dbos_says = await status(workflow_id)
        with pytest.raises(UnknownRun):
            await h.ledger.backend.get_run(workflow_id)
    assert h.provider.effects() == []
    assert dbos_says == "ERROR"
