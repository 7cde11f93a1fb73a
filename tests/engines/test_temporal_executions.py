"""Temporal: executions that reuse a workflow id, odd ids, errors no retry can fix,
a cancel before any worker started the workflow, heartbeat details, and the cause
recorded when Temporal (not a user) cuts a call. A real dev server, ground truth in
the provider's file; barriers and the server's own answers, no sleeps."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

import stopline
from stopline import Headline, OpStatus
from stopline.integrations import temporal
from stopline.integrations.temporal import run_id_of
from stopline.integrations.temporal_server import TemporalDevServer
from stopline.ledger.backend import RunSpec
from tests.engines.temporal_harness import Harness, activities, harness, plugin
from tests.engines.temporal_workflows import GiveUp, Pipeline, Plan


async def _worker(h: Harness, *extra: Any) -> Worker:
    acts = activities(h.provider)
    return Worker(
        h.client,
        task_queue=h.task_queue,
        workflows=[Pipeline, GiveUp],
        activities=[*acts, *extra],
        plugins=[plugin(h.ledger, h.provider, acts)],
    )


def _failure(exc: WorkflowFailureError) -> ApplicationError:
    """The activity's failure under the workflow's."""
    assert isinstance(exc.cause, ActivityError)
    assert isinstance(exc.cause.cause, ApplicationError)
    return exc.cause.cause


async def test_temporal_reused_workflow_id_gets_a_run_of_its_own(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """ADR 0050: a second execution under a workflow id whose first one completed is not
    refused as "cancelled": it runs in a run of its own, and the first receipt stays."""
    async with harness(temporal_server, tmp_path) as h:
        workflow_id = f"daily-{uuid.uuid4().hex[:8]}"
        first = await h.start(Plan(["upload"]), workflow_id)
        await first.result()
        second = await h.start(Plan(["upload"]), workflow_id)
        with anyio.fail_after(60):
            results = await second.result()
        assert second.result_run_id is not None
        own = run_id_of(workflow_id, second.result_run_id)
        receipt = await h.ledger.wait_settled(own, timeout=10)
        first_receipt = await h.ledger.receipt(workflow_id)
    assert own == f"{workflow_id}@run:{second.result_run_id}"
    assert len(h.provider.effects()) == 2  # each execution sent its own
    assert results[0]["id"] == h.provider.effects()[1]
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert first_receipt.headline is Headline.COMPLETED
    assert [line.status for line in first_receipt.lines] == [OpStatus.COMMITTED]


async def test_temporal_workflow_retry_runs_in_a_run_of_its_own(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Temporal's workflow retry policy: the first attempt fails in the workflow's code
    before any activity; the retry's activity passes the gate."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.client.start_workflow(
            Pipeline.run,
            Plan(["upload"], fail_first_attempt=True),
            id=f"wf-{uuid.uuid4().hex[:12]}",
            task_queue=h.task_queue,
            retry_policy=RetryPolicy(
                initial_interval=timedelta(milliseconds=50), maximum_attempts=2
            ),
        )
        with anyio.fail_after(60):
            results = await handle.result()
        described = await handle.describe()
        receipt = await h.ledger.wait_settled(run_id_of(handle.id, described.run_id), timeout=10)
        first = await h.ledger.receipt(handle.id)
    assert [r["id"] for r in results] == h.provider.effects()
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert first.headline is Headline.FAILED  # the attempt that failed, as it failed
    assert first.lines == ()


async def test_temporal_cancelled_workflow_id_still_refuses_its_reruns(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """ADR 0024 kept: once the workflow id's run is cancelled, an execution that reuses
    the id is refused at the gate, and nothing reaches the provider."""
    async with harness(temporal_server, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        first = await h.start(Plan(["upload"], wait_for_go=True), workflow_id)
        while await h.ledger.backend.list_runs(limit=10) == []:
            await h.ledger.wait_for_change(workflow_id)
        await temporal.cancel(h.ledger, h.client, workflow_id, by="user:42", reason="stop")
        with anyio.fail_after(60), pytest.raises(WorkflowFailureError):
            await first.result()
        again = await h.start(Plan(["upload"]), workflow_id)
        with anyio.fail_after(60), pytest.raises(WorkflowFailureError):
            await again.result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=10)
    assert h.provider.effects() == []
    assert h.provider.barriers.passed == []  # the provider never saw a request
    assert {line.status for line in receipt.lines} <= {OpStatus.PREVENTED}
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_temporal_cancel_before_any_worker_started_the_workflow(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """No worker has polled the workflow yet (its run is not open): the cancel fences a
    run made for it and asks Temporal to cancel; when a worker comes, nothing is sent."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        handle = await h.start(Plan(["upload"]))
        receipt = await temporal.cancel(h.ledger, h.client, handle.id, by="user:42", reason="no")
        async with await _worker(h):
            with anyio.fail_after(60), pytest.raises(WorkflowFailureError):
                await handle.result()
        status = (await handle.describe()).status
        settled = await h.ledger.wait_settled(handle.id, timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.cancelled_by == "user:42"
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == []
    assert h.provider.barriers.passed == []
    assert settled.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_temporal_cancel_of_a_workflow_nobody_knows_is_unknown(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    async with harness(temporal_server, tmp_path, worker=False) as h:
        with pytest.raises(stopline.UnknownRun):
            await temporal.cancel(h.ledger, h.client, "never-started", by="user:42")


@dataclasses.dataclass
class Charge:  # a result Temporal converts and the ledger does not keep (not JSON)
    id: str


@pytest.mark.parametrize("seeded", ["not_replayable", "idempotency_conflict"])
async def test_temporal_error_no_retry_can_fix_fails_the_activity_at_once(
    temporal_server: TemporalDevServer, tmp_path: Path, seeded: str
) -> None:
    """The activity's operation was committed before, with a result the ledger did not
    keep (or with other arguments): every retry would raise the same, so the activity
    fails at once, non-retryable, named, with the message (Temporal's default retry
    policy is unlimited: it looped for ever)."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        handle = await h.start(Plan(["upload"]))  # no worker yet: nothing runs
        payload = f"upload of {handle.id}"
        args = ["other arguments"] if seeded == "idempotency_conflict" else [payload]

        async def charged(*_args: Any) -> Charge:
            return Charge("ch_1")

        spec = RunSpec(id=handle.id, name="temporal:Pipeline", owner="user:42", tenant="default")
        await h.ledger.backend.create_run(spec)
        tool: stopline.Tool[Charge] = stopline.Tool(charged, name="upload")
        # seeded by another process's ledger: in this one "upload" is the worker's tool
        # (one tool per name, ADR 0078)
        async with stopline.open(h.ledger_url) as seeding:
            await seeding.dispatch(handle.id, tool, *args, key=f"{handle.result_run_id}:2")
        async with await _worker(h):
            with anyio.fail_after(60), pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
    failure = _failure(failed.value)
    expected = {"not_replayable": "NotReplayable", "idempotency_conflict": "IdempotencyConflict"}
    assert failure.type == expected[seeded]
    assert failure.non_retryable
    assert f"{handle.id}/{handle.result_run_id}:2" in failure.message
    assert h.provider.effects() == []  # never sent again


@pytest.mark.parametrize("workflow_id", ["x" * 1000, "tab\there"])
async def test_temporal_odd_workflow_ids_run_under_a_derived_run_id(
    temporal_server: TemporalDevServer, tmp_path: Path, workflow_id: str
) -> None:
    """Ids Temporal accepts and the ledger cannot keep as they are (too long for the
    operation's id, a control character) run under ``run_id_of``: its start and a
    digest, stable and findable. They hung the workflow before (InvalidInput on every
    retry)."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["upload"]), workflow_id)
        with anyio.fail_after(60):
            results = await handle.result()
        run_id = run_id_of(workflow_id)
        receipt = await h.ledger.wait_settled(run_id, timeout=10)
    assert run_id != workflow_id
    assert "#sha256:" in run_id
    assert run_id == run_id_of(workflow_id)  # stable
    assert [r["id"] for r in results] == h.provider.effects()
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_temporal_plugin_heartbeats_keep_the_activitys_details(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The activity checkpoints in its heartbeat details; the plugin's own heartbeat
    follows; the attempt fails; the retry resumes from the checkpoint (the plugin's
    heartbeat sent none and wiped it)."""
    seen: list[list[Any]] = []

    @activity.defn(name="checkpointed")
    async def checkpointed(payload: str) -> str:
        info = activity.info()
        seen.append(list(info.heartbeat_details))
        if info.attempt > 1:
            return "resumed"
        activity.heartbeat("done 3 of 10")
        assert info.workflow_id is not None
        handle = h.client.get_workflow_handle(info.workflow_id)
        recorded = None
        while True:  # until the server has recorded a later heartbeat: the plugin's
            pending = (await handle.describe()).raw_description.pending_activities[0]
            beat = pending.last_heartbeat_time.ToDatetime()
            if recorded is None and pending.heartbeat_details.payloads:
                recorded = beat
            elif recorded is not None and beat > recorded:
                break
            await anyio.sleep(0.05)  # the server offers nothing to await
        raise stopline.Rejected("item 4 refused, nothing of it sent")

    async with (
        harness(temporal_server, tmp_path, worker=False) as h,
        await _worker(h, checkpointed),
    ):
        handle = await h.start(Plan(["checkpointed"], maximum_attempts=2))
        with anyio.fail_after(60):
            assert await handle.result() == ["resumed"]
    assert seen == [[], ["done 3 of 10"]]


async def test_temporal_workflow_cancelling_its_activity_is_no_user_cancel(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The workflow's own code cancels its activity after the provider committed: the
    call is ``unknown`` by a local abort (then read back committed), never by a user's
    cancel that did not happen; the run completes, not cancelled."""
    async with (
        harness(temporal_server, tmp_path, worker=False) as h,
        await _worker(h),
    ):
        hold = h.provider.barriers.hold("committed")
        handle = await h.client.start_workflow(
            GiveUp.run, id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=h.task_queue
        )
        await hold.reached.wait()
        await handle.signal(GiveUp.go)
        with anyio.fail_after(60):
            assert await handle.result() == "gave up"
        while (await h.ledger.backend.operations(handle.id))[0].status is OpStatus.REQUESTED:
            await h.ledger.wait_for_change(handle.id)
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        hold.release()
    refs = [e.ref for e in receipt.lines[0].evidence]
    assert "user_cancel" not in refs
    assert "local_error" in refs
    assert receipt.cancelled_by is None
    assert receipt.lines[0].status is OpStatus.COMMITTED  # read back: in the log
