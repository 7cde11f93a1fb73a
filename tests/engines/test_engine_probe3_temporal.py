"""The third engines probe, from outside, on a real Temporal dev server.

A Temporal user's own operations around a gated activity, compared with what
Temporal's history says. Found: a reset (the client's ``ResetWorkflowExecution``)
to before ``open_run``'s marker (the first workflow task) sent an upload already
done again, also with it in flight, and ``temporal.cancel`` of a reset execution
fenced an empty run of its own (ADR 0073); a start-to-close timeout was recorded
as ``local_error`` (Temporal answers the next heartbeat "not found"). Held: a
reset after the upload, a retry after an attempt failed past the commit, a
continue-as-new chain cancelled, a child cancelled by its parent's close policy,
a signal and an update after a cancel, a cancel while the worker lies SIGKILLed,
odd workflow ids. Ground truth is the provider's file; barriers, the ledger's
changes and Temporal's history, no sleeps.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.service import RPCError, RPCStatusCode

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations import temporal
from stopline.integrations.temporal import call_context, run_id_of
from stopline.integrations.temporal_server import TemporalDevServer
from tests.conftest import FAST_VERIFY
from tests.engines.temporal_harness import Harness, harness, killed_after_commit, worker_for
from tests.engines.temporal_workflows import Chain, Pipeline, Plan, Updatable


async def _history(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [event async for event in handle.fetch_history_events()]


async def _kinds(handle: WorkflowHandle[Any, Any]) -> list[int]:
    return [event.event_type for event in await _history(handle)]


async def _reset(h: Harness, handle: WorkflowHandle[Any, Any], to_event: int) -> str:
    """Temporal's reset, as its client, UI or CLI sends it: the new execution's run id."""
    run_id = (await handle.describe()).run_id
    request = ResetWorkflowExecutionRequest(
        namespace=h.client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=run_id),
        reason="operator reset",
        workflow_task_finish_event_id=to_event,
        request_id=str(uuid.uuid4()),
    )
    return (await h.client.workflow_service.reset_workflow_execution(request)).run_id


async def _completed_activities(handle: WorkflowHandle[Any, Any]) -> int:
    completed = EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    return (await _kinds(handle)).count(completed)


async def _task_after_upload(handle: WorkflowHandle[Any, Any]) -> int | None:
    """The workflow task completed after the upload's completion, once there is one."""
    kinds = await _kinds(handle)
    if EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED not in kinds:
        return None
    after = kinds.index(EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)
    done = [n for n, kind in enumerate(kinds) if n > after and kind == _TASK_COMPLETED]
    return done[0] + 1 if done else None  # event ids count from 1


_TASK_COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED


async def _waiting_after_upload(h: Harness) -> tuple[WorkflowHandle[Any, Any], int]:
    """The workflow has uploaded and waits for "go" (its history says so: the workflow
    task after the upload's completion is completed); and that task's event id."""
    handle = await h.start(Plan(["upload"], hold_after=True))
    with anyio.fail_after(30):
        while (task := await _task_after_upload(handle)) is None:
            await h.ledger.wait_for_change(handle.id)
    return handle, task


async def test_a_reset_to_the_first_workflow_task_does_not_send_the_upload_again(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The workflow uploaded and waits; an operator resets it to its first workflow task
    (``temporal workflow reset --type FirstWorkflowTask``): Temporal closes the execution
    and runs the workflow's code again in a new one, from before the upload. The new
    execution is the same workflow (its ``original_execution_run_id`` names the first):
    its upload reaches the operation the first recorded and returns its result; the
    provider sees one upload, and the run's receipt one line."""
    async with harness(temporal_server, tmp_path) as h:
        handle, _ = await _waiting_after_upload(h)
        first_task = (await _history(handle))[3]
        assert first_task.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        new_run = await _reset(h, handle, first_task.event_id)
        reset = h.client.get_workflow_handle(handle.id, run_id=new_run)
        with anyio.fail_after(30):
            while not await _completed_activities(reset):
                await h.ledger.wait_for_change(handle.id)
        await reset.signal(Pipeline.go)
        with anyio.fail_after(30):
            results = await reset.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        runs = [r.id for r in await h.ledger.backend.list_runs()]
    assert h.provider.effects() == [results[0]["id"]]  # old: two uploads, one per execution
    assert runs == [handle.id]
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_reset_to_after_the_upload_replays_it_from_history(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A reset to the workflow task after the upload completed keeps the upload in the
    new execution's history: nothing reaches the gate again."""
    async with harness(temporal_server, tmp_path) as h:
        handle, after_upload = await _waiting_after_upload(h)
        new_run = await _reset(h, handle, after_upload)
        reset = h.client.get_workflow_handle(handle.id, run_id=new_run)
        await reset.signal(Pipeline.go)
        with anyio.fail_after(30):
            results = await reset.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    assert h.provider.effects() == [results[0]["id"]]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_start_to_close_timeout_after_the_commit_retries_into_the_read_back(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The provider commits and never answers; Temporal times the attempt out
    (``start_to_close_timeout``) and retries it. The first attempt is cut by the timeout
    (``unknown``, cause ``timeout``, never a user's cancel), read back committed; the
    retry reaches the same operation and gets its recorded result: one upload, and
    Temporal's history shows the timed-out attempt."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("responding")  # committed, never answered
        try:
            handle = await h.start(Plan(["upload"], start_to_close=2.0, heartbeat_timeout=1.0))
            with anyio.fail_after(60):
                results = await handle.result()
        finally:
            hold.release()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        (event,) = [
            e
            for e in await h.ledger.backend.events(handle.id)
            if e.op_id and e.to_state == "unknown"
        ]
        description = await handle.describe()
    assert hold.key is not None
    assert h.provider.effects() == [hold.key]  # sent once
    assert results[0]["id"] == hold.key
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    assert receipt.cancelled_by is None
    assert "user_cancel" not in [e.ref for e in receipt.lines[0].evidence]
    assert event.data.get("cause") == "timeout", event.data
    assert description.status is WorkflowExecutionStatus.COMPLETED


async def test_a_child_cancelled_by_its_parents_close_policy_sends_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The parent completes while its exclusive child (``ParentClosePolicy.REQUEST_CANCEL``)
    waits: Temporal cancels the child, whose run is fenced before its code hears of it;
    the child's upload never passes the gate."""
    async with harness(temporal_server, tmp_path) as h:
        parent = await h.start(Plan([], children=["exclusive"], child_activities=["upload"]))
        child = h.client.get_workflow_handle(f"{parent.id}-exclusive-0")
        while child.id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(child.id)
        await parent.signal(Pipeline.go)
        with anyio.fail_after(30):
            await parent.result()
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await child.result()
        receipt = await h.ledger.wait_settled(child.id, timeout=10)
        parent_run = await h.ledger.backend.get_run(parent.id)
        status = (await child.describe()).status
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == []
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.cancelled_by == "temporal"
    assert parent_run.state is RunState.COMPLETED


async def test_a_signal_after_a_stopline_cancel_sends_nothing_and_changes_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The user presses stop while the workflow waits for "go"; the workflow ends
    cancelled in Temporal. A "go" sent afterwards is refused by Temporal (the execution
    is closed), nothing is sent, and the receipt is the one the cancel gave."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["upload"], wait_for_go=True))
        while handle.id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(handle.id)
        first = await h.ledger.cancel(handle.id, by="user:42", reason="pressed stop")
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await handle.result()
        with pytest.raises(RPCError) as refused:
            await handle.signal(Pipeline.go)
        after = await h.ledger.wait_settled(handle.id, timeout=10)
        events = await h.ledger.backend.events(handle.id)
    assert refused.value.status is RPCStatusCode.NOT_FOUND
    assert h.provider.effects() == []
    assert first.headline is after.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert after.lines == ()
    assert not [e for e in events if e.op_id]
    assert (after.cancelled_by, after.cancel_reason) == ("user:42", "pressed stop")
    assert stopline.RunState.CANCELLED is after.run_state


async def test_an_update_after_a_workflow_cancel_is_refused_at_the_gate(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Temporal's cancel fences the run while ``upload`` (WAIT_CANCELLATION_COMPLETED)
    keeps the workflow open; an update then asks the workflow to ``notify``: Temporal
    accepts it and schedules the activity, which is refused at the gate and never
    retried (R1). The upload's real outcome is kept; the provider never sees notify."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.client.start_workflow(
            Updatable.run, id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=h.task_queue
        )
        await hold.reached.wait()
        await handle.cancel()
        while (await h.ledger.backend.get_run(handle.id)).state is RunState.RUNNING:
            await h.ledger.wait_for_change(handle.id)  # the fence, before the cancel lands
        with anyio.fail_after(30), pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(Updatable.send, "late news")
        hold.release()
        with anyio.fail_after(30):
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    cause = refused.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert (cause.cause.type, cause.cause.non_retryable) == ("RunFenced", True)
    assert h.provider.effects() == [hold.key]  # the upload only
    assert [p for p, k in h.provider.barriers.passed if k != hold.key] == []
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.PREVENTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_a_cancel_after_continue_as_new_reaches_the_chains_one_run(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The first execution uploads and continues as new; the second's upload has
    committed when Temporal's cancel arrives (the client's handle: the latest
    execution). The chain is one run: both uploads are in its receipt, the second read
    back committed, and Temporal's history shows both executions."""
    async with harness(temporal_server, tmp_path) as h:
        first = h.provider.barriers.hold("responding")
        handle = await h.client.start_workflow(
            Chain.run, args=[2, []], id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=h.task_queue
        )
        await first.reached.wait()
        second = h.provider.barriers.hold("committed")
        first.release()
        await second.reached.wait()
        await handle.cancel()
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        second.release()
        runs = [r.id for r in await h.ledger.backend.list_runs()]
        first_run = h.client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
        kinds = await _kinds(first_run)
        status = (await handle.describe()).status
    assert h.provider.effects() == [first.key, second.key]
    assert first.key != second.key
    assert runs == [handle.id]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.cancelled_by == "temporal"
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW in kinds
    assert status is WorkflowExecutionStatus.CANCELED


async def test_temporal_cancel_of_a_reset_execution_fences_the_run_it_went_on_in(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The workflow id's run completed; a second execution of the id runs in a run of
    its own (``ID@run:O``), uploads and waits; an operator resets it to its first
    workflow task. The reset execution goes on in ``ID@run:O`` (its upload not sent
    again), and ``temporal.cancel`` from a process with no worker fences that run: its
    receipt keeps the upload (it would have fenced an empty run of the reset
    execution's own and said "Canceled before external action")."""
    async with harness(temporal_server, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        await (await h.start(Plan(["upload"]), workflow_id)).result()
        handle = await h.start(Plan(["upload"], hold_after=True), workflow_id)
        with anyio.fail_after(30):
            while not await _completed_activities(handle):
                await h.ledger.wait_for_change(workflow_id)
        original = (await handle.describe()).run_id
        first_task = (await _history(handle))[3]
        new_run = await _reset(h, handle, first_task.event_id)
        reset = h.client.get_workflow_handle(workflow_id, run_id=new_run)
        with anyio.fail_after(30):
            while not await _completed_activities(reset):
                await h.ledger.wait_for_change(workflow_id)
        async with stopline.open(h.ledger_url, verify=FAST_VERIFY) as elsewhere:
            receipt = await temporal.cancel(elsewhere, h.client, workflow_id, by="user:42")
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await reset.result()
        runs = sorted(r.id for r in await h.ledger.backend.list_runs())
    assert len(h.provider.effects()) == 2  # one per execution that was not a reset
    assert runs == sorted([workflow_id, run_id_of(workflow_id, original)])
    assert receipt.run_id == run_id_of(workflow_id, original)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


@pytest.mark.parametrize("workflow_id", ["wf/ünï cødé:1", "wf@run:forged", "wf#sha256:00"])
async def test_odd_workflow_ids_are_cancelled_through_their_derived_run(
    temporal_server: TemporalDevServer, tmp_path: Path, workflow_id: str
) -> None:
    """Ids with a slash, a colon, a space and letters beyond ASCII, or with the forms a
    derived run id has: the workflow waits, ``temporal.cancel`` by the workflow id finds
    its run, fences it, and Temporal cancels the workflow; nothing is sent."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["upload"], wait_for_go=True), workflow_id)
        run_id = run_id_of(workflow_id)
        while run_id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(run_id)
        async with stopline.open(h.ledger_url, verify=FAST_VERIFY) as elsewhere:
            receipt = await temporal.cancel(elsewhere, h.client, workflow_id, by="user:42")
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await handle.result()
        runs = [r.id for r in await h.ledger.backend.list_runs()]
        status = (await handle.describe()).status
    assert runs == [run_id]
    assert receipt.run_id == run_id
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == []


async def test_a_reset_under_a_running_upload_reads_it_back_and_sends_it_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The provider has committed the upload and not answered when an operator resets
    the workflow to its first workflow task: Temporal closes the execution under the
    activity (not taken for a terminate: the run is not fenced) and runs the upload
    again in the new execution. Both attempts are the same operation: the cut one is
    read back committed, and the new one gets that result; one upload."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("committed")
        handle = await h.start(Plan(["upload"], hold_after=True))
        await hold.reached.wait()
        first_task = (await _history(handle))[3]
        new_run = await _reset(h, handle, first_task.event_id)
        reset = h.client.get_workflow_handle(handle.id, run_id=new_run)
        with anyio.fail_after(30):
            while not await _completed_activities(reset):
                await h.ledger.wait_for_change(handle.id)
        hold.release()
        await reset.signal(Pipeline.go)
        with anyio.fail_after(30):
            results = await reset.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    assert h.provider.effects() == [hold.key]
    assert results[0]["id"] == hold.key
    assert receipt.cancelled_by is None  # the reset is no cancel of the run
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_cancel_while_the_worker_lies_killed_mid_activity_keeps_the_effect_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The worker (a process of its own) commits the upload and is SIGKILLed before it
    answers. While no worker runs, the user cancels (``temporal.cancel``: the run fenced,
    Temporal's cancel requested). Another worker picks the workflow up: nothing is sent
    again (the upload read back committed, ``notify`` never passes the gate), Temporal
    closes the workflow cancelled, and the receipt keeps the upload."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        handle, key = await killed_after_commit(temporal_server, h, Plan(["upload", "notify"]))
        await h.ledger.recover()  # what a restarted worker does when it opens the ledger
        await temporal.cancel(h.ledger, h.client, handle.id, by="user:42", reason="stop")
        async with worker_for(h):
            with anyio.fail_after(60), pytest.raises(WorkflowFailureError):
                await handle.result()
            receipt = await h.ledger.wait_settled(handle.id, timeout=15)
            status = (await handle.describe()).status
    assert h.provider.effects() == [key]
    assert status is WorkflowExecutionStatus.CANCELED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert (receipt.cancelled_by, receipt.cancel_reason) == ("user:42", "stop")


async def test_an_attempt_that_fails_after_the_provider_committed_is_not_sent_again(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The activity's first attempt sends (the provider commits) and then fails in its
    own code (a plain exception: Temporal retries it). The failure is no proof that
    nothing happened: the call is ``unknown`` (``local_error``), and the retry reads it
    back and returns the result instead of sending again. Temporal's history shows the
    retried attempt; the receipt, one upload."""

    @activity.defn(name="upload_then_fail")
    async def upload_then_fail(payload: str) -> dict[str, Any]:
        sent = await h.provider.send(call_context().key, payload)
        if activity.info().attempt == 1:
            raise RuntimeError("the response could not be parsed")
        return sent  # pragma: no cover - the retry is answered from the ledger

    async with harness(temporal_server, tmp_path, worker=False) as h:
        extra = h.provider.tool("upload_then_fail", upload_then_fail, "upload it")
        async with worker_for(h, upload_then_fail, tools=[extra]):
            handle = await h.start(Plan(["upload_then_fail"], maximum_attempts=3))
            with anyio.fail_after(60):
                results = await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        description = await handle.describe()
        kinds = [e.kind for e in await h.ledger.backend.events(handle.id) if e.op_id]
    (key,) = h.provider.effects()
    assert results[0]["id"] == key
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]
    assert "lost" in kinds
    assert description.status is WorkflowExecutionStatus.COMPLETED


async def test_a_reset_of_a_completed_workflow_runs_in_a_run_of_its_own_and_says_so(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The limit (ADR 0073): the workflow completed, its run ended, and nothing reopens
    an ended run. A reset to its first workflow task runs in a run of its own
    (``ID@run:NEW``) and sends the upload again: each run's receipt says what it did,
    the completed one unchanged."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["upload"]))
        await handle.result()
        before = await h.ledger.wait_settled(handle.id, timeout=10)
        first_task = (await _history(handle))[3]
        new_run = await _reset(h, handle, first_task.event_id)
        with anyio.fail_after(30):
            await h.client.get_workflow_handle(handle.id, run_id=new_run).result()
        own = run_id_of(handle.id, new_run)
        theirs = await h.ledger.wait_settled(own, timeout=10)
        after = await h.ledger.wait_settled(handle.id, timeout=10)
    first, again = h.provider.effects()
    assert first.startswith(f"{handle.id}/") and again.startswith(f"{own}/")
    assert after == before
    assert [line.status for line in theirs.lines] == [OpStatus.COMMITTED]
    assert theirs.headline is Headline.COMPLETED
