"""The tenth probe of the Temporal integration: standalone activities, on a real dev server.

An activity a client starts itself (``Client.start_activity``: no workflow) is a run of
its own, made by its first gated call (ADR 0103).

- **Its run never ended.** Nothing ended it: its receipt said "Running." for ever and
  ``ledger.wait_settled`` never returned. It now ends with the activity's execution:
  completed, or failed with its error once Temporal retries it no more; an attempt
  Temporal retries leaves it open, and the retry finds it.
- **A stopline cancel of it asked Temporal to cancel a workflow** of the run's id
  (``activity:ID``): "not found", and the activity ran on; a workflow of that id would
  have been cancelled instead. It now asks Temporal to cancel the activity itself.
- **A client's Temporal cancel of it did not fence its run** (a workflow cancel fences
  a workflow's). It now does, when the activity's code hears of the cancel.
- **A reused activity id reached the first execution's operation** (Temporal's default
  ``ALLOW_DUPLICATE``): the same arguments returned the recorded result and sent
  nothing; others failed ``IdempotencyConflict``. Each execution is now a run of its
  own (``info.activity_run_id``), every attempt of one execution its one operation.
- **A workflow whose id is ``activity:X`` shared its run with standalone activity X.**
  An activity's run id now has a form no workflow id's run has.

Also: ``temporal.cancel_activity`` (a process with no worker), and a last attempt that
Temporal times out (its run fenced "timed out", as a workflow's closed under its
activity is). Ground truth is the provider's own file; barriers, events and the
ledger's changes.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest
from temporalio.client import (
    ActivityExecutionStatus,
    ActivityFailureError,
    WorkflowExecutionStatus,
)
from temporalio.exceptions import CancelledError

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations._engines import engine_key
from stopline.integrations.temporal import run_id_of
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import (
    Harness,
    harness,
    standalone_worker,
    start_standalone,
    worker_for,
)
from tests.engines.temporal_workflows import Plan

pytestmark = pytest.mark.timeout(120)


async def _runs_of(h: Harness, activity_id: str) -> list[str]:
    """The runs of standalone activity ``activity_id``'s operations, oldest first: found
    by the operation, whatever the run's id (``RUN/:ACTIVITY_ID``, no execution)."""
    found = []
    for run in reversed(await h.ledger.reads.runs()):
        ops = await h.ledger.backend.operations(run.id)
        if any(op.id == f"{run.id}/:{engine_key(activity_id)}" for op in ops):
            found.append(run.id)
    return found


async def test_a_standalone_activitys_run_ends_with_it(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The activity completes: its run is completed, and ``wait_settled`` returns
    (old: "Running." for ever, ``wait_settled`` timed out)."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        async with standalone_worker(h):
            handle = await start_standalone(h, activity_id)
            with anyio.fail_after(30):
                result = await handle.result()
        (run_id,) = await _runs_of(h, activity_id)
        receipt = await h.ledger.wait_settled(run_id, timeout=10)  # old: TimeoutError
        run = await h.ledger.backend.get_run(run_id)
    assert run.state is RunState.COMPLETED
    assert receipt.headline is Headline.COMPLETED
    assert h.provider.effects() == [result["id"]]


async def test_a_retried_attempt_finds_the_run_and_the_last_failure_ends_it(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Attempt 1 is refused by the provider before any effect (retryable): the run stays
    open, and attempt 2 sends in it; the activity completes, its run with it. A second
    activity, one attempt allowed, refused: its run ends failed, with the refusal."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        retried, refused = f"act-{uuid.uuid4().hex[:8]}", f"act-{uuid.uuid4().hex[:8]}"
        async with standalone_worker(h):
            h.provider.reject_next = True
            handle = await start_standalone(h, retried, attempts=2)
            with anyio.fail_after(30):
                result = await handle.result()
            h.provider.reject_next = True
            once = await start_standalone(h, refused, attempts=1)
            with anyio.fail_after(30), pytest.raises(ActivityFailureError):
                await once.result()
        (run_id,) = await _runs_of(h, retried)
        receipt = await h.ledger.wait_settled(run_id, timeout=10)  # old: TimeoutError
        (failed_id,) = await _runs_of(h, refused)
        failed = await h.ledger.wait_settled(failed_id, timeout=10)
        failed_run = await h.ledger.backend.get_run(failed_id)
        events = await h.ledger.backend.events(failed_id)
    assert h.provider.effects() == [result["id"]]  # attempt 2 sent, once
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert failed_run.state is RunState.FAILED
    (ended,) = [e for e in events if e.op_id is None and e.to_state == RunState.FAILED.value]
    assert "refused before any effect" in str(ended.data), ended
    assert [line.status for line in failed.lines] == [OpStatus.NOT_COMMITTED]


@pytest.mark.parametrize("shape", ["act-{}", "act@run:{}"], ids=["as-is", "derived"])
async def test_a_stopline_cancel_of_a_standalone_activity_cancels_the_activity(
    temporal_server: TemporalDevServer, tmp_path: Path, shape: str
) -> None:
    """The activity's request is held at the provider, before any effect; a stopline
    cancel of its run: Temporal cancels the activity itself (old: a workflow named after
    the run, "not found", and the activity ran on), its call is cut, nothing is sent,
    and the run settles before any external action. An activity id the run holds
    derived (``@run:`` in it) is cancelled by the worker that runs it."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = shape.format(uuid.uuid4().hex[:8])
        hold = h.provider.barriers.hold("received")
        try:
            async with standalone_worker(h):
                handle = await start_standalone(h, activity_id)
                with anyio.fail_after(30):
                    await hold.reached.wait()
                (run_id,) = await _runs_of(h, activity_id)
                assert ("#sha256:" in run_id) is (shape == "act@run:{}")
                await h.ledger.cancel(run_id, by="user:42", reason="not needed")
                with anyio.fail_after(30), pytest.raises(ActivityFailureError) as failed:
                    await handle.result()  # old: held, the activity running on
                status = (await handle.describe()).status
        finally:
            hold.release()
        receipt = await h.ledger.wait_settled(run_id, timeout=10)
    assert status is ActivityExecutionStatus.CANCELED
    assert isinstance(failed.value.cause, CancelledError)
    assert h.provider.effects() == []
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_a_client_cancel_of_a_standalone_activity_fences_its_run(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A client cancels the activity in Temporal while its request is held at the
    provider: the activity's code hears of it, and its run is fenced (old: running, as
    a workflow's run would not be after a workflow cancel), with the client's reason;
    nothing is sent, and the run settles before any external action."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        hold = h.provider.barriers.hold("received")
        try:
            async with standalone_worker(h):
                handle = await start_standalone(h, activity_id)
                with anyio.fail_after(30):
                    await hold.reached.wait()
                await handle.cancel(reason="not needed")
                with anyio.fail_after(30), pytest.raises(ActivityFailureError):
                    await handle.result()
        finally:
            hold.release()
        (run_id,) = await _runs_of(h, activity_id)
        run = await h.ledger.backend.get_run(run_id)
        assert run.cancelled_at is not None, run.state  # old: running, not fenced
        receipt = await h.ledger.wait_settled(run_id, timeout=10)
    assert "not needed" in (run.cancel_reason or "")
    assert h.provider.effects() == []
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_a_reused_activity_id_is_a_run_of_its_own(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """One activity id started three times, one after another (Temporal's default
    ``ALLOW_DUPLICATE``): "a", "a" again, then "b". Each execution sends its own, in a
    run of its own (old: the second returned the first's recorded result and sent
    nothing; the third failed ``IdempotencyConflict``)."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        results = []
        async with standalone_worker(h):
            for payload in ("a", "a", "b"):
                handle = await start_standalone(h, activity_id, payload)
                with anyio.fail_after(30):
                    results.append(await handle.result())  # old: the third failed
        runs = await _runs_of(h, activity_id)
        receipts = [await h.ledger.wait_settled(run, timeout=10) for run in runs]
    assert [r["payload"] for r in results] == ["a", "a", "b"]
    assert h.provider.effects() == [r["id"] for r in results]  # each sent, once
    assert len(set(h.provider.effects())) == 3 and len(set(runs)) == 3
    assert all(r.headline is Headline.COMPLETED for r in receipts)


async def test_a_workflow_named_activity_x_is_not_standalone_activity_xs_run(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A workflow whose id is ``activity:X`` waits; standalone activity X runs, and a
    stopline cancel of X's run cancels X alone: the workflow goes on and completes (old:
    X joined the workflow's run, ``activity:X``, and the cancel fenced the workflow's);
    each run's receipt holds its own call."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        hold = h.provider.barriers.hold("received")
        try:
            async with worker_for(h):  # its workflows' worker serves standalone activities too
                plan = Plan(["upload"], wait_for_go=True)
                workflow = await h.start(plan, f"activity:{activity_id}")
                handle = await start_standalone(h, activity_id)
                with anyio.fail_after(30):
                    await hold.reached.wait()
                (run_id,) = await _runs_of(h, activity_id)
                assert run_id != run_id_of(workflow.id)  # old: the workflow's run
                await h.ledger.cancel(run_id, by="user:42", reason="not needed")
                with anyio.fail_after(30), pytest.raises(ActivityFailureError) as failed:
                    await handle.result()
                await workflow.signal("go")
                with anyio.fail_after(30):
                    (uploaded,) = await workflow.result()
                status = (await workflow.describe()).status
        finally:
            hold.release()
        theirs = await h.ledger.wait_settled(workflow.id, timeout=10)
        ours = await h.ledger.wait_settled(run_id, timeout=10)
    assert status is WorkflowExecutionStatus.COMPLETED
    assert isinstance(failed.value.cause, CancelledError)
    assert h.provider.effects() == [uploaded["id"]]  # the workflow's; the activity's, none
    assert theirs.headline is Headline.COMPLETED and len(theirs.lines) == 1
    assert ours.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION and len(ours.lines) == 1


async def test_cancel_activity_from_a_process_without_a_worker(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An activity Temporal holds that no worker has started: ``temporal.cancel_activity``
    (by its id alone) fences a run for it at once and asks Temporal to cancel the
    activity itself; a worker started afterwards sends nothing. Its receipt: cancelled
    before any external action."""
    from stopline.integrations.temporal import activity_run_id, cancel_activity

    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        handle = await start_standalone(h, activity_id)
        assert handle.run_id is not None
        receipt = await cancel_activity(
            h.ledger, h.client, activity_id, by="user:42", reason="not needed"
        )
        async with standalone_worker(h):
            with anyio.fail_after(30), pytest.raises(ActivityFailureError) as failed:
                await handle.result()
        status = (await handle.describe()).status
        run = await h.ledger.backend.get_run(activity_run_id(activity_id, handle.run_id))
    assert receipt.run_id == run.id and run.cancelled_at is not None
    assert isinstance(failed.value.cause, CancelledError)
    assert status is ActivityExecutionStatus.CANCELED
    assert h.provider.effects() == []
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_a_standalone_activity_timed_out_on_its_last_attempt_ends_its_run(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """One attempt allowed, its request held at the provider past its 2 s
    ``start_to_close_timeout``: Temporal times the activity out, and the worker hears of
    it at its next heartbeat. Its run is fenced "timed out" (old: open for ever, as a
    workflow's run under a workflow timed out is fenced), and settles: nothing sent."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        hold = h.provider.barriers.hold("received")
        try:
            async with standalone_worker(h):
                handle = await start_standalone(h, activity_id, attempts=1, timeout=2)
                with anyio.fail_after(30), pytest.raises(ActivityFailureError):
                    await handle.result()
                (run_id,) = await _runs_of(h, activity_id)
                with anyio.fail_after(30):
                    receipt = await h.ledger.wait_settled(run_id)  # old: never
        finally:
            hold.release()
        run = await h.ledger.backend.get_run(run_id)
        status = (await handle.describe()).status
    assert status is ActivityExecutionStatus.TIMED_OUT
    assert run.cancel_reason == "timed out" and run.cancelled_by is not None
    assert h.provider.effects() == []
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


def test_no_workflows_run_has_a_standalone_activitys_run_id() -> None:
    """Workflow ids that mimic an activity's run, and their executions' own runs: none is
    a standalone activity's run (``standalone_of``), nor equal to one; each activity's
    run reads back as itself. Old: activity X's run was workflow ``activity:X``'s."""
    from stopline.integrations._temporal_runs import activity_run_id, standalone_of

    execution = str(uuid.uuid4())
    activities = ["x", "activity:x", "x@run:activity:y", "x#sha256:" + "a" * 64, "x" * 2000]
    runs = {activity_run_id(a, execution) for a in activities} | {activity_run_id("x", "")}
    workflow_ids = [*activities, *runs, f"x@run:activity:{execution}"]
    for workflow_id in workflow_ids:
        for workflow_run in (run_id_of(workflow_id), run_id_of(workflow_id, execution)):
            assert workflow_run not in runs, workflow_id
            assert standalone_of(workflow_run) is None, workflow_run
    assert standalone_of(activity_run_id("activity:x", execution)) == ("activity:x", execution)
    assert standalone_of(activity_run_id("x@run:activity:y", execution)) is None  # derived


async def test_cancel_activity_refuses_an_id_that_cannot_be_one(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An empty or overlong activity id, or an empty execution: ``InvalidInput`` naming
    it, before the ledger or Temporal is asked (nothing written)."""
    from stopline.integrations.temporal import cancel_activity

    async with harness(temporal_server, tmp_path, worker=False) as h:
        before = await h.ledger.reads.runs()
        for activity_id, run_id, named in [
            ("", None, "activity_id"),
            ("a" * 5_000, None, "activity_id"),
            ("act-1", "", "run_id"),
        ]:
            with pytest.raises(stopline.InvalidInput, match=named):
                await cancel_activity(h.ledger, h.client, activity_id, run_id=run_id, by="ops")
        assert await h.ledger.reads.runs() == before
