"""The thirteenth probe of the Temporal integration, on a real dev server (ADR 0119).

- **A reset of a continue-as-new chain's first execution** re-ran the chain's later
  uploads: a continued execution's keys named its own execution, so the
  continuation of a reset was a new execution, its calls new operations. A
  continued execution's keys now name its place in the chain (ADR 0119).
- **A workflow's run whose end the ledger refused for good** (an operator's trigger:
  ``LedgerRefused``; the workflow fails loudly, ADR 0111) stayed ``running`` in the
  ledger until someone ended it by hand. A worker's look (as it starts, then at each
  sweep) now ends it as Temporal recorded the workflow's end, once the ledger takes
  the write; a workflow still running is left to its own end.

Ground truth is the provider's own file, the ledger's events and Temporal's record.
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle

from stopline import Headline, OpStatus, RunState
from stopline.errors import UnknownRun
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import Harness, activities, harness, plugin, worker_for
from tests.engines.temporal_workflows import Chain, Plan

pytestmark = pytest.mark.timeout(120)

_ENDS = {RunState.COMPLETED.value, RunState.FAILED.value, RunState.CANCELLED.value}
# an operator's trigger: no run may end, completed or failed
_NO_END = (
    "CREATE TRIGGER no_end BEFORE UPDATE OF state ON runs"
    " WHEN NEW.state IN ('completed', 'failed')"
    " BEGIN SELECT RAISE(ABORT, 'no run ends today'); END"
)


async def _ends(h: Harness, run_id: str) -> list[tuple[str, str]]:
    """The run's own moves to an end, in order: (the state, the reason recorded)."""
    return [
        (str(e.to_state), str(e.data.get("reason", "")))
        for e in await h.ledger.backend.events(run_id)
        if e.op_id is None and e.to_state in _ENDS
    ]


async def _opened(h: Harness, handle: WorkflowHandle[Any, Any]) -> None:
    """Until the workflow's run is in the ledger (its ``open_run`` answered)."""
    while True:  # polled: the run is the worker's, and its commit wakes this wait
        with contextlib.suppress(UnknownRun):
            await h.ledger.backend.get_run(handle.id)
            return
        await h.ledger.wait_for_change(handle.id, poll=0.05)


async def _ended(h: Harness, run_id: str) -> None:
    """Until the run is no longer running."""
    while (await h.ledger.backend.get_run(run_id)).state is RunState.RUNNING:
        await h.ledger.wait_for_change(run_id, poll=0.05)


async def test_a_run_whose_end_was_refused_is_ended_by_the_next_workers_look(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An operator's trigger refuses every run's end. A workflow's call commits and its
    code returns; its run's end is refused: the workflow fails (``LedgerRefused``), its
    run left running. Another workflow waits for "go". The trigger dropped, the next
    worker's look ends the first run failed, with Temporal's record of the failure
    (old: "running" until someone ended it by hand), and leaves the waiting one to its
    own end (completed, once). Each upload was sent once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        try:
            db.execute(_NO_END)
            async with worker_for(h):
                handle = await h.start(Plan(["upload"]))
                with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
                    await handle.result()
                waiting = await h.start(Plan(["upload"], wait_for_go=True))
                with anyio.fail_after(30):
                    await _opened(h, waiting)
            left = (await h.ledger.backend.get_run(handle.id)).state
            db.execute("DROP TRIGGER no_end")
        finally:
            db.close()
        async with worker_for(h):
            with anyio.fail_after(30):
                await _ended(h, handle.id)  # old: never
            await waiting.signal("go")
            with anyio.fail_after(30):
                (answer,) = await waiting.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=20)
        ends = await _ends(h, handle.id)
        waited = await _ends(h, waiting.id)
        status = (await handle.describe()).status
    assert left is RunState.RUNNING  # as ADR 0111 left it
    assert status is WorkflowExecutionStatus.FAILED
    ((state, reason),) = ends  # ended once
    assert state == RunState.FAILED.value  # as Temporal recorded the workflow's end
    assert reason.startswith("RuntimeError: LedgerRefused: the workflow's code returned"), reason
    assert "no run ends today" in reason
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.run_state is RunState.FAILED
    assert waited == [(RunState.COMPLETED.value, "")]  # the look left it to its own end
    effects = h.provider.effects()
    assert len(effects) == len(set(effects)) == 2 and answer["id"] in effects  # each once


async def test_a_failed_workflows_refused_end_is_ended_with_its_own_failure(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A workflow fails on its own (its code raises before any activity) while the
    trigger refuses its run's end (logged, ADR 0111: its own error is its failure).
    The trigger dropped, a worker's look ends the run failed with the workflow's own
    error, as Temporal recorded it (old: "running" until someone ended it). Nothing
    was sent."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        try:
            db.execute(_NO_END)
            async with worker_for(h):
                handle = await h.start(Plan(["upload"], fail_first_attempt=True))
                with anyio.fail_after(30), pytest.raises(WorkflowFailureError):
                    await handle.result()
            left = (await h.ledger.backend.get_run(handle.id)).state
            db.execute("DROP TRIGGER no_end")
        finally:
            db.close()
        async with worker_for(h):
            with anyio.fail_after(30):
                await _ended(h, handle.id)  # old: never
        receipt = await h.ledger.wait_settled(handle.id, timeout=20)
        ends = await _ends(h, handle.id)
    assert left is RunState.RUNNING
    ((state, reason),) = ends
    assert state == RunState.FAILED.value
    assert "the first attempt fails before any activity" in reason, reason
    assert receipt.lines == ()
    assert receipt.headline is not Headline.COMPLETED
    assert h.provider.effects() == []


async def _reset(h: Harness, workflow_id: str, execution: str, to_event: int) -> str:
    """Temporal's reset of ``execution``, as its client, UI or CLI sends it: the new
    execution's run id."""
    request = ResetWorkflowExecutionRequest(
        namespace=h.client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=execution),
        reason="operator reset",
        workflow_task_finish_event_id=to_event,
        request_id=str(uuid.uuid4()),
    )
    return (await h.client.workflow_service.reset_workflow_execution(request)).run_id


async def _uploaded(h: Harness, handle: WorkflowHandle[Any, Any]) -> None:
    """Until the execution's history records its upload completed."""
    completed = EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    while not [e async for e in handle.fetch_history_events() if e.event_type == completed]:
        await h.ledger.wait_for_change(handle.id, poll=0.05)


@pytest.mark.parametrize("which", ["first", "second"])
async def test_a_reset_of_a_chains_execution_sends_no_upload_again(
    temporal_server: TemporalDevServer, tmp_path: Path, which: str
) -> None:
    """A chain of two executions joined by continue-as-new, each uploading once; the
    second waits for "go". An operator resets one of them to its first workflow task.
    The first: Temporal closes the second and runs the first's code again, which
    continues as new into a third; each re-run upload is the one the chain did at
    that place (old: the third's keys named its own execution, and the second upload
    was sent again). The second: its re-run reaches its own upload, as before. One
    run, two uploads, two lines."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.client.start_workflow(
            Chain.run, args=[2, []], id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=h.task_queue
        )
        first = handle.first_execution_run_id or ""
        with anyio.fail_after(30):
            while (second := (await handle.describe()).run_id) == first:
                await h.ledger.wait_for_change(handle.id, poll=0.05)
            await _uploaded(h, h.client.get_workflow_handle(handle.id, run_id=second))
        base = first if which == "first" else second
        history = h.client.get_workflow_handle(handle.id, run_id=base).fetch_history_events()
        first_task = [e async for e in history][3]
        assert first_task.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        reset = await _reset(h, handle.id, base, first_task.event_id)
        with anyio.fail_after(30):
            latest = reset
            while which == "first" and latest in (second, reset):  # it continues as new
                await h.ledger.wait_for_change(handle.id, poll=0.05)
                latest = (await handle.describe()).run_id
            last = h.client.get_workflow_handle(handle.id, run_id=latest)
            await _uploaded(h, last)
        await last.signal(Chain.go)
        with anyio.fail_after(30):
            await last.result()
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
        runs = [r.id for r in await h.ledger.backend.list_runs()]
    effects = h.provider.effects()
    assert len(effects) == len(set(effects)) == 2, effects  # old (first): the second twice
    assert runs == [handle.id]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED, OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED


async def test_a_workflow_that_waits_is_asked_of_again_only_after_its_wait(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A workflow waiting for a signal (its run running, no call in flight) is asked of
    Temporal once, then again only after a wait that doubles each time it is still
    running, from a third of the lease up to 10 minutes (ADR 0119): three looks in a
    row ask once (old: one ``describe`` per worker at every sweep of every running
    workflow). Its run ended, the look forgets it."""
    async with harness(temporal_server, tmp_path, worker=False) as h, worker_for(h):
        waiting = await h.start(Plan(["upload"], wait_for_go=True))
        with anyio.fail_after(30):
            await _opened(h, waiting)
        looks = plugin(h.ledger, h.provider, activities(h.provider)).activity_runs
        looks.client = h.client
        await looks._look_once()
        first = looks._again.get(waiting.id)
        await looks._look_once()
        await looks._look_once()
        again = looks._again.get(waiting.id)
        looks._again[waiting.id] = (0.0, first[1] if first else 0.0)  # its wait passed
        await looks._look_once()
        doubled = looks._again.get(waiting.id)
        await waiting.signal("go")
        with anyio.fail_after(30):
            await waiting.result()
            await _ended(h, waiting.id)
        await looks._look_once()
        forgotten = waiting.id not in looks._again
    assert first is not None and first[1] == h.ledger.lease / 3, first  # asked, running
    assert again == first  # not asked again before its wait
    assert doubled is not None and doubled[1] == 2 * first[1], doubled  # asked: twice the wait
    assert forgotten
