"""What the eleventh probe found on a real DBOS, on SQLite and the machine's PostgreSQL,
ground truth in the provider's own log; barriers, no sleeps (ADR 0106).

- **The watcher of waiting workflows went blind in an outage of DBOS's database.** Its
  read of DBOS's cancels was DBOS's own listing, which waits out a lost database
  retrying, up to a minute between attempts: with DBOS's database unreachable (a
  PostgreSQL role that may no longer log in, its sessions ended; an exclusive lock held
  on the SQLite file) the read hung, nothing counted it, and it went on sleeping after
  the database was back (a cancel made then was not fenced for as long); its thread
  held up the process's exit while the database stayed down. Now one attempt a read:
  a failed or unanswered read is counted in ``ledger.health`` (degraded), fences
  nothing, and the next one, once the database is back, fences what DBOS cancelled.
- **A step's own ``DBOSWorkflowCancelledError`` was taken for DBOS's cancel.** The run
  was fenced "by dbos" ("DBOS.cancel_workflow"), and the fence cancelled the workflow
  in DBOS, though nobody had. Now, unless DBOS's record says the workflow is
  cancelled, the run fails with the call's exception, as with any other.
- **A read-back started from a step ran as the workflow's code.** It inherited DBOS's
  context: a verifier's ``DBOS.get_workflow_status`` was recorded as the workflow's
  next step, and the workflow's own next step then failed with
  ``DBOSUnexpectedStepError``; ``DBOS.workflow_id`` named the workflow. Now only the
  step's call runs in DBOS's context.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID
from dbos._error import DBOSWorkflowCancelledError

from stopline import Headline, OpStatus, ReadBack, RunState
from stopline.integrations.dbos import call_context
from stopline.runtime.context import CallContext
from tests.engines import dbos_app
from tests.engines.dbos_harness import (
    MARKS,
    Harness,
    harness,
    outage_ready,
    running,
    status,
    until_opened,
    until_watch_failing,
)
from tests.engines.provider import FileProvider

pytestmark = MARKS

_WATCH = "watch_dbos_cancels"  # the watcher's step in ledger.health


async def _until_fenced(h: Harness, run_id: str) -> None:
    with anyio.fail_after(30):
        while (await h.ledger.backend.get_run(run_id)).cancelled_at is None:
            await h.ledger.wait_for_change(run_id)


async def _until_ended(h: Harness, run_id: str) -> None:
    """Until the run has left ``running`` (DBOS parks a workflow its own cancel error
    left: its handle never answers)."""
    await until_opened(h, run_id)
    with anyio.fail_after(30):
        while (await h.ledger.backend.get_run(run_id)).state is RunState.RUNNING:
            await h.ledger.wait_for_change(run_id)


# -- an outage of DBOS's system database, for real --------------------------------------


async def test_the_watcher_survives_an_outage_of_dbos_database_and_says_so(
    backend: str, tmp_path: Path
) -> None:
    """Two gated workflows wait in ``recv``; DBOS's system database becomes unreachable
    for real (SQLite: an exclusive lock held by another connection; PostgreSQL: DBOS's
    role locked out, its sessions ended). The watcher's read fails or goes unanswered:
    counted in ``ledger.health``, the ledger degraded (old: nothing, the read hung in
    DBOS's retry), and no run is fenced. The database back, the health recovers; a
    ``DBOS.cancel_workflow`` of one of them is fenced by the next read; the other goes
    on and commits; the watcher stops with the last of them."""
    with outage_ready(backend, tmp_path) as (dbs, outage):
        async with running(dbs, FileProvider(tmp_path / "effects.jsonl")) as h:
            watcher = dbos_app.gate._watch
            ids = sorted(f"wf-{uuid.uuid4().hex[:12]}" for _ in range(2))
            handles = {}
            for workflow_id in ids:
                with SetWorkflowID(workflow_id):
                    handles[workflow_id] = await DBOS.start_workflow_async(
                        dbos_app.pipeline, ["upload"], True
                    )
                await until_opened(h, workflow_id)
            await anyio.to_thread.run_sync(outage.begin)
            try:
                await until_watch_failing(h, True)
                degraded = h.ledger.health.degraded
                fenced_in_outage = [(await h.ledger.backend.get_run(w)).cancelled_at for w in ids]
            finally:
                await anyio.to_thread.run_sync(outage.end)
            await until_watch_failing(h, False)  # the first read after it answered
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
            watch = h.ledger.health.steps[_WATCH]
            recovered = not h.ledger.health.degraded
    assert degraded and watch.failures >= 1  # visible: counted, the ledger degraded
    assert fenced_in_outage == [None, None]  # a failed read fences nothing
    assert recovered and watch.failing == 0
    assert h.provider.effects() == [sent["id"]]  # the cancelled one sent nothing
    assert receipts[cancelled].cancel_reason == "DBOS.cancel_workflow"
    assert receipts[cancelled].headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipts[going_on].headline is Headline.COMPLETED  # nothing else cancelled


# -- a step's own DBOSWorkflowCancelledError ----------------------------------------------

_cancel_first: dict[str, bool] = {}  # workflow id -> the test cancels it in DBOS first


@DBOS.step()
@dbos_app.gate.step(description="post, then raise DBOS's cancel", verify=dbos_app._verify)
async def raises_dbos_cancel(payload: str) -> dict[str, Any]:
    sent = await dbos_app._provider[0].send(call_context().key, payload)
    # the call's own code raises DBOS's signal (a library's, a mistaken re-raise)
    raise DBOSWorkflowCancelledError(f"raised by the step's own code after {sent['id']}")


@DBOS.workflow()
@dbos_app.gate.workflow()
async def own_cancel_flow() -> Any:
    return await raises_dbos_cancel("the report")


@pytest.mark.parametrize("dbos_cancelled", [False, True])
async def test_a_steps_own_dbos_cancel_error_is_its_exception_unless_dbos_cancelled(
    backend: str, tmp_path: Path, dbos_cancelled: bool
) -> None:
    """A step's call commits, then its own code raises ``DBOSWorkflowCancelledError``.
    Nobody cancelled the workflow: the call is ``unknown`` (``local_error``, the
    exception named) and read back ``committed``; the run fails with the exception, not
    cancelled, and the workflow is not cancelled in DBOS (old: the run fenced "by dbos",
    "DBOS.cancel_workflow", and the fence cancelled the workflow in DBOS). With a
    ``DBOS.cancel_workflow`` while the call was at the provider, it is DBOS's cancel:
    the run fenced by dbos, as before."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            await DBOS.start_workflow_async(own_cancel_flow)
        await hold.reached.wait()
        if dbos_cancelled:
            await DBOS.cancel_workflow_async(workflow_id)  # the step is not preempted
        hold.release()
        await _until_ended(h, workflow_id)
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        lost = [e.data for e in await h.ledger.backend.events(workflow_id) if e.kind == "lost"]
        dbos_says = await status(workflow_id)
    assert h.provider.effects() == [hold.key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]  # read back
    assert [(d["cause"], d["evidence"][0]["detail"].split(":")[0]) for d in lost] == [
        ("local_error", "DBOSWorkflowCancelledError")
    ]
    if dbos_cancelled:
        assert (receipt.cancelled_by, receipt.cancel_reason) == ("dbos", "DBOS.cancel_workflow")
        assert dbos_says == "CANCELLED"
        return
    assert receipt.run_state is RunState.FAILED  # old: cancelled by dbos
    assert receipt.cancelled_by is None
    assert receipt.headline is Headline.FAILED
    assert dbos_says != "CANCELLED"  # old: cancelled by stopline's fence; ERROR (ADR 0114)


# -- a read-back started from a step ----------------------------------------------------

_seen: dict[str, Any] = {}  # what the verifier saw, and when it is done


async def _verify_asking_dbos(ctx: CallContext) -> ReadBack:
    """A verifier that asks DBOS something (any DBOS API called from a read-back)."""
    try:
        _seen["workflow_id"] = DBOS.workflow_id
        _seen["status"] = await DBOS.get_workflow_status_async(f"other-{uuid.uuid4().hex}")
        return await dbos_app._verify(ctx)
    finally:
        _seen["done"].set()


@DBOS.step()
@dbos_app.gate.step(description="post, answer lost", verify=_verify_asking_dbos)
async def loses_its_answer(payload: str) -> dict[str, Any]:
    await dbos_app._provider[0].send(call_context().key, payload)
    raise ConnectionError("connection reset after the request")


@DBOS.workflow()
@dbos_app.gate.workflow()
async def goes_on_after_a_loss() -> str:
    with contextlib.suppress(ConnectionError):
        await loses_its_answer("the report")
    await _seen["done"].wait()  # the read-back (in the background) has asked DBOS
    return await dbos_app.report("after")


async def test_a_read_back_started_from_a_step_does_not_run_as_the_workflow(
    backend: str, tmp_path: Path
) -> None:
    """A step's call loses its answer after the provider committed: its read-back runs in
    the background, and its verifier asks DBOS something. It runs outside DBOS's
    context: ``DBOS.workflow_id`` is ``None`` and DBOS records no step for its call; the
    workflow's next step runs as step 2 and the workflow succeeds (old: the verifier's
    ``DBOS.getStatus`` was recorded as step 2, the workflow's ``report`` then failed with
    ``DBOSUnexpectedStepError``)."""
    async with harness(backend, tmp_path) as h:
        _seen.clear()
        _seen["done"] = anyio.Event()
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(goes_on_after_a_loss)
        with anyio.fail_after(30):
            result = await handle.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        steps = [s["function_name"] for s in await DBOS.list_workflow_steps_async(workflow_id)]
    assert _seen["workflow_id"] is None  # old: the workflow's id
    assert steps == ["loses_its_answer", "report"]  # old: DBOS.getStatus in between
    assert result == "report: after"
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]  # read back
