"""What the fourth engines probe found on a real Temporal dev server (P4).

- A heartbeat timeout is decided by the server: the worker's process had stopped
  (SIGSTOP: a freeze, a pause, a partition) after the provider committed, Temporal
  timed the attempt out for want of heartbeats, and when the process went on its
  next heartbeat was answered "not found". The cut was recorded as ``local_error``
  ("Temporal no longer knows the activity"); it is ``timeout`` now, naming the
  heartbeat timeout, and the receipt says what the read-back proves (the effect
  happened) where Temporal says the activity timed out.
- One rule for odd workflow ids (ADR 0085): a workflow id the ledger cannot keep as
  a run id runs under the derived id, as on DBOS, and a stopline cancel of that run
  reaches the Temporal workflow.

Ground truth is the provider's file; barriers, Temporal's history, no sleeps.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import anyio
import pytest
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle

from stopline import Headline, OpStatus
from stopline.integrations.temporal import run_id_of
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import harness, worker_process
from tests.engines.temporal_workflows import Plan


async def _timed_out(handle: WorkflowHandle[object, object]) -> int | None:
    """The timeout type Temporal ended the activity's first attempt with, once it has:
    the retry's last failure while the activity is pending, else the history's."""
    described = await handle.describe()
    for pending in described.raw_description.pending_activities:
        if pending.attempt > 1 and pending.last_failure.HasField("timeout_failure_info"):
            return int(pending.last_failure.timeout_failure_info.timeout_type)
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            failure = event.activity_task_timed_out_event_attributes.failure
            return int(failure.timeout_failure_info.timeout_type)
    return None


@pytest.mark.parametrize("attempts", [1, 2])
async def test_p4_a_heartbeat_timeout_is_a_timeout_and_the_read_back_decides(
    temporal_server: TemporalDevServer, tmp_path: Path, attempts: int
) -> None:
    """The worker's process commits the upload and stops (SIGSTOP) before answering;
    Temporal times the attempt out for want of heartbeats. The process goes on; its
    next heartbeat is answered "not found", and the call is cut: ``unknown`` by
    ``timeout``, naming the heartbeat timeout (old: ``local_error``), read back:
    completed, sent once. With one attempt allowed the workflow fails (the receipt
    keeps the upload Temporal says timed out); with two, the retry reaches the same
    operation and gets its result."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        child = await worker_process(temporal_server, h)
        try:
            plan = Plan(["upload"], heartbeat_timeout=1.0, maximum_attempts=attempts)
            handle = await h.start(plan)
            key = (await child.expect("committed ")).split(" ", 1)[1]
            os.kill(child.proc.pid, signal.SIGSTOP)  # frozen: no heartbeat leaves
            try:
                with anyio.fail_after(30):
                    # Temporal offers nothing to await for a timeout: ask it
                    while (timed_out := await _timed_out(handle)) is None:  # noqa: ASYNC110
                        await anyio.sleep(0.1)
            finally:
                os.kill(child.proc.pid, signal.SIGCONT)
            with anyio.fail_after(30):
                try:
                    results = await handle.result()
                except WorkflowFailureError:
                    results = None
            receipt = await h.ledger.wait_settled(handle.id, timeout=20)
            (cut,) = [
                e
                for e in await h.ledger.backend.events(handle.id)
                if e.op_id and e.to_state == "unknown"
            ]
            status = (await handle.describe()).status
        finally:
            await child.kill()
    assert timed_out == TimeoutType.TIMEOUT_TYPE_HEARTBEAT  # Temporal's word
    assert cut.data.get("cause") == "timeout", cut.data  # old: local_error
    assert "heartbeat" in str(cut.data)
    assert h.provider.effects() == [key]  # sent once
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]  # read back
    assert receipt.cancelled_by is None
    if attempts == 1:
        assert results is None and status is WorkflowExecutionStatus.FAILED
        assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]
        assert receipt.headline is Headline.FAILED
    else:
        assert status is WorkflowExecutionStatus.COMPLETED
        assert results is not None and results[0]["id"] == key
        assert receipt.headline is Headline.COMPLETED


@pytest.mark.parametrize("shape", ["tab\there-", "w" * 980])
async def test_p4_b_a_stopline_cancel_reaches_an_odd_id_workflow(
    temporal_server: TemporalDevServer, tmp_path: Path, shape: str
) -> None:
    """The workflow waits for "go" under an id with a tab, or too long for an operation's
    id: its run is the derived one (``run_id_of``); ``ledger.cancel`` of that run
    cancels the Temporal workflow (by its own id), and nothing is sent."""
    async with harness(temporal_server, tmp_path) as h:
        workflow_id = f"{shape}{uuid.uuid4().hex[:12]}"
        handle = await h.start(Plan(["upload"], wait_for_go=True), workflow_id)
        run_id = run_id_of(workflow_id)
        while run_id not in {r.id for r in await h.ledger.backend.list_runs()}:
            await h.ledger.wait_for_change(run_id)
        receipt = await h.ledger.cancel(run_id, by="user:42", reason="pressed stop")
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
            await handle.result()
        status = (await handle.describe()).status
        settled = await h.ledger.wait_settled(run_id, timeout=15)
    assert run_id != workflow_id and "#sha256:" in run_id
    assert receipt.run_id == run_id
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == []
    assert settled.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
