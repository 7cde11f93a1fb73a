"""What the engines probe found (issue: F1, F2, F4), on a real Temporal dev server and
a real DBOS: a DBOS cancel during a step it does not preempt fences the run; a
resumed run is live again for a worker that saw its fence; and following a Temporal
receipt's recovery line literally sends nothing twice. Ground truth in the
provider's file; barriers and the engines' own answers, no sleeps."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest
from dbos import DBOS, SetWorkflowID
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from stopline import Headline, OpStatus
from stopline.domain.model import EventRecord
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines import dbos_app
from tests.engines.dbos_harness import cancelled_in_flight
from tests.engines.dbos_harness import harness as dbos_harness
from tests.engines.temporal_harness import harness as temporal_harness
from tests.engines.temporal_workflows import Plan


def _since_resume(events: list[EventRecord]) -> list[EventRecord]:
    kinds = [e.kind for e in events]
    return events[kinds.index("resume") :]


@pytest.mark.parametrize("backend", ["sqlite"])
async def test_f2_dbos_cancel_during_a_step_it_does_not_preempt_fences_the_run(
    backend: str, tmp_path: Path
) -> None:
    """``notify`` is a plain step: DBOS does not cut it, and this execution learns of
    the cancel only when it writes the step's result (DBOS raises its "no longer
    owned" error, a BaseException). The run is fenced then, and settles: the step
    that finished is kept, the one after it never passes the gate."""
    async with dbos_harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("committed")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["notify", "upload"])
        await hold.reached.wait()
        await DBOS.cancel_workflow_async(workflow_id)
        hold.release()
        with pytest.raises(BaseException, match="cancelled"):  # DBOS: awaited, cancelled
            await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert h.provider.effects() == [hold.key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.cancelled_by == "dbos"


@pytest.mark.parametrize("backend", ["sqlite"])
async def test_f4_dbos_calls_after_a_resume_are_not_late_answers(
    backend: str, tmp_path: Path
) -> None:
    """The worker saw the stopline cancel; after ``ledger.resume`` and
    ``DBOS.resume_workflow`` the steps it sends are the resumed run's own calls,
    not completions "after the cancel"."""
    async with dbos_harness(backend, tmp_path) as h:
        workflow_id = await cancelled_in_flight(h, ["upload", "notify"])
        await h.ledger.resume(workflow_id, by="user:42")
        again = await DBOS.resume_workflow_async(workflow_id)
        with anyio.fail_after(30):
            await again.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        events = await h.ledger.backend.events(workflow_id)
    effects = h.provider.effects()
    assert len(effects) == 2 == len(set(effects))  # upload, then notify: each once
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    assert not [e for e in _since_resume(events) if (e.data or {}).get("late")]


async def test_f1_f4_temporal_recovery_line_followed_literally_sends_nothing_twice(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A stopline cancel while ``notify`` is in flight, after ``upload`` completed. The
    receipt says: resume, then re-enter the run with the same run id, 1 completed action
    returned from the ledger. Done literally (Temporal re-enters a workflow id by
    starting it again: a new execution), in the worker that saw the cancel: ``upload``
    is returned from the ledger, ``notify`` is sent once, the re-entered workflow is not
    cancelled again, and nothing it sends is taken for a late answer."""
    async with temporal_harness(temporal_server, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        upload_done = h.provider.barriers.hold("committed")
        first = await h.start(Plan(["upload", "notify"]), workflow_id)
        await upload_done.reached.wait()
        hold = h.provider.barriers.hold("received")  # the next call: notify
        upload_done.release()
        await hold.reached.wait()  # upload committed; notify received, not committed
        await h.ledger.cancel(workflow_id, by="user:42", reason="pressed stop")
        with pytest.raises(WorkflowFailureError):
            await first.result()
        stopped = await h.ledger.wait_settled(workflow_id, timeout=15)
        hold.release()
        assert stopped.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
        assert [line.status for line in stopped.lines] == [
            OpStatus.COMMITTED,
            OpStatus.NOT_COMMITTED,
        ]
        assert "re-enter the run with the same run id" in (stopped.resume_rule or "")
        uploaded = h.provider.effects()
        assert len(uploaded) == 1

        await h.ledger.resume(workflow_id, by="user:42")
        second = await h.start(Plan(["upload", "notify"]), workflow_id)
        with anyio.fail_after(60):
            results = await second.result()
        assert (await second.describe()).status is WorkflowExecutionStatus.COMPLETED
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        events = await h.ledger.backend.events(workflow_id)
    effects = h.provider.effects()
    assert len(effects) == 2 == len(set(effects))  # upload once, notify once
    assert results[0]["id"] == uploaded[0]  # upload's result, returned from the ledger
    assert results[1]["id"] == effects[1]
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert not [e for e in _since_resume(events) if (e.data or {}).get("late")]
    assert [e.kind for e in events].count("cancel") == 1  # cancelled once, by the user
