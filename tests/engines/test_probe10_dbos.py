"""What the tenth probe found on a real DBOS, on SQLite and the machine's PostgreSQL,
ground truth in the provider's own log; barriers, no sleeps (ADR 0104).

- **DBOS's cancel of a parent that waits on its child fenced nothing until the parent
  ran again.** ``DBOS.cancel_workflow(parent)`` while the parent awaits its child's
  result (or waits in ``DBOS.recv``): DBOS checks for a cancel only before a step, so
  the parent's run was fenced once the child had finished, and the child, whose run
  the parent's owns exclusively (R6), went on sending: its next step was sent after
  the cancel and it reached ``SUCCESS``. Now a watcher reads, once an interval, DBOS's
  status of the gated workflows running in the process (one read for all of them)
  and fences the run of a cancelled one that waits, as DBOS's own check would: the
  child's run is fenced with it and cancelled in DBOS: its next step is not sent.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID

from stopline import Headline, OpStatus, Receipt, RunState, UnknownRun
from stopline.integrations import _dbos_watch
from tests.engines import dbos_app
from tests.engines.dbos_harness import MARKS, Harness, harness, status, until_status

pytestmark = MARKS


@DBOS.workflow()
@dbos_app.gate.workflow()
async def awaits_its_child(steps: list[str]) -> list[Any]:
    child = await DBOS.start_workflow_async(dbos_app.pipeline, steps)
    result: list[Any] = await child.get_result()
    return result


@DBOS.workflow()
@dbos_app.gate.workflow()
async def waits_in_recv(steps: list[str]) -> None:
    await DBOS.start_workflow_async(dbos_app.pipeline, steps)
    await DBOS.recv_async("go", timeout_seconds=60)


_PARENTS = {"get_result": awaits_its_child, "recv": waits_in_recv}


async def _until_fenced(h: Harness, run_id: str) -> None:
    """Until the run is fenced (a barrier on the ledger: each change wakes it)."""
    with anyio.fail_after(30):
        while (await h.ledger.backend.get_run(run_id)).cancelled_at is None:
            await h.ledger.wait_for_change(run_id)


async def _until_opened(h: Harness, run_id: str) -> None:
    """Until the workflow's run is open."""
    with anyio.fail_after(30):
        while True:
            try:
                await h.ledger.backend.get_run(run_id)
                return
            except UnknownRun:
                await h.ledger.wait_for_change(run_id)


@pytest.mark.parametrize("waits", sorted(_PARENTS))
async def test_a_dbos_cancel_of_a_waiting_parent_fences_its_child_at_once(
    backend: str, tmp_path: Path, waits: str
) -> None:
    """The parent waits (on its child's result, or in ``recv``) while the child's
    ``notify`` is held at the provider; ``DBOS.cancel_workflow(parent)``. The parent's
    run is fenced while the child's step is still held (old: only once the child had
    ended), with the child's, and the child is cancelled in DBOS. Released, the held
    call finishes (kept) and the child's next step, ``upload``, is never dispatched
    (old: sent, the child ``SUCCESS``). The parent's receipt names DBOS's cancel and
    what was stopped."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        parent_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(parent_id):
            parent = await DBOS.start_workflow_async(_PARENTS[waits], ["notify", "upload"])
        await hold.reached.wait()
        [child] = await DBOS.list_workflows_async(parent_workflow_id=parent_id)
        await DBOS.cancel_workflow_async(parent_id)
        await _until_fenced(h, parent_id)
        child_run = await h.ledger.backend.get_run(child.workflow_id)
        await until_status(child.workflow_id, "CANCELLED")  # the fence, carried into DBOS
        hold.release()
        if waits == "get_result":  # in ``recv``, DBOS's check comes at its timeout
            with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
                await parent.get_result()
        receipt = await h.ledger.wait_settled(parent_id, timeout=15)
        said = {w: await status(w) for w in (parent_id, child.workflow_id)}
        ops = await h.ledger.backend.operations(child.workflow_id)
    assert child_run.cancelled_at is not None  # fenced with its parent's run (R6)
    assert said == {parent_id: "CANCELLED", child.workflow_id: "CANCELLED"}
    assert h.provider.effects() == [hold.key]  # the held step's call finished; upload not sent
    assert not [op for op in ops if op.id.endswith(":upload")]  # stopped before dispatch
    assert receipt.cancelled_by == "dbos" and receipt.cancel_reason == "DBOS.cancel_workflow"
    assert receipt.run_state is RunState.CANCELLED
    assert [(line.op_id, line.status) for line in receipt.lines] == [(hold.key, OpStatus.COMMITTED)]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_one_read_watches_every_waiting_workflow_and_a_failed_read_is_made_again(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gated workflows wait in ``recv``. The watcher reads DBOS's cancels of both in one
    read; its first read fails (a fake: DBOS's database unreachable; the real outage is
    probe 11's): counted in ``ledger.health``, made again at the next interval, no
    workflow failed. One is
    cancelled in DBOS: its run is fenced while it waits, nothing it would send is sent;
    the other goes on and commits. The watcher stops with the last of them."""
    reads: list[list[str]] = []
    read_both = anyio.Event()
    listed, loop = _dbos_watch._cancelled_among, asyncio.get_running_loop()

    def spy(workflow_ids: list[str]) -> list[str]:  # in the read's thread
        reads.append(sorted(workflow_ids))
        if len(reads) == 1:
            raise ConnectionError("DBOS's system database unreachable")
        if len(reads[-1]) == 2:
            loop.call_soon_threadsafe(read_both.set)
        return listed(workflow_ids)

    async with harness(backend, tmp_path) as h:
        watcher = dbos_app.gate._watch
        monkeypatch.setattr(_dbos_watch, "_cancelled_among", spy)
        ids = sorted(f"wf-{uuid.uuid4().hex[:12]}" for _ in range(2))
        handles = {}
        for workflow_id in ids:
            with SetWorkflowID(workflow_id):
                handles[workflow_id] = await DBOS.start_workflow_async(
                    dbos_app.pipeline, ["upload"], True
                )
        with anyio.fail_after(30):
            await read_both.wait()
        cancelled, going_on = ids
        await DBOS.cancel_workflow_async(cancelled)
        await _until_fenced(h, cancelled)
        for workflow_id in ids:
            await DBOS.send_async(workflow_id, "ready", "go")
        with anyio.fail_after(30):
            [sent] = await handles[going_on].get_result()
            with pytest.raises(Exception, match="cancelled"):
                await handles[cancelled].get_result()
            await watcher.stopped.wait()
        receipts = {w: await h.ledger.wait_settled(w, timeout=15) for w in ids}
        failed = h.ledger.health.steps["watch_dbos_cancels"].failures
    assert ids in reads  # one read for both
    assert all(set(read) <= set(ids) for read in reads)
    assert failed == 1  # the failed read, counted; the next one was made
    assert h.provider.effects() == [sent["id"]]  # the cancelled one sent nothing
    assert receipts[cancelled].cancel_reason == "DBOS.cancel_workflow"
    assert receipts[cancelled].headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipts[going_on].headline is Headline.COMPLETED


async def test_the_watcher_leaves_a_stopline_cancel_of_a_waiting_workflow_as_it_is(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopline cancel of a workflow waiting in ``recv`` cancels it in DBOS; the
    watcher then reads it cancelled and fences its run again: the cancel stays the
    user's (R7: who and why unchanged), nothing is sent."""
    async with harness(backend, tmp_path) as h:
        engine_gate, fenced_again = dbos_app.gate.gate, anyio.Event()
        fence = engine_gate.fence

        async def spy(run_id: str, reason: str) -> Receipt:
            receipt = await fence(run_id, reason)
            fenced_again.set()
            return receipt

        monkeypatch.setattr(engine_gate, "fence", spy)
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"], True)
        await _until_opened(h, workflow_id)
        await h.ledger.cancel(workflow_id, by="user:42", reason="pressed stop")
        with anyio.fail_after(30):
            await fenced_again.wait()  # by the watcher: the workflow still waits
            await DBOS.send_async(workflow_id, "ready", "go")
            with pytest.raises(Exception, match="cancelled"):
                await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert (receipt.cancelled_by, receipt.cancel_reason) == ("user:42", "pressed stop")
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert h.provider.effects() == []
