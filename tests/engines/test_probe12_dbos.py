"""What the twelfth probe found on a real DBOS, on SQLite and the machine's PostgreSQL,
ground truth in DBOS's system database and the provider's own log; barriers, no sleeps
(ADR 0114).

- **The workflow's own ``DBOSWorkflowCancelledError`` was taken for DBOS's cancel.**
  Raised by the workflow's code (not a step's call, not DBOS's check), nobody having
  cancelled the workflow: the run was fenced "by dbos" ("DBOS.cancel_workflow") and
  the fence cancelled the workflow in DBOS. Now DBOS's record decides: the execution
  still owns the workflow there (nobody cancelled it), so the run fails with it.
- **A step's own cancel error left the workflow ``PENDING`` in DBOS for ever** while
  its run had failed: DBOS parks an execution its own signal ends, and its handle
  never answered. Now the workflow raises ``RunEnded`` (the run failed) in its place:
  DBOS records the workflow ``ERROR``, and both records say it failed.
- **The watcher of waiting workflows logged a warning at every read of an outage**
  of DBOS's system database (once a second). Now once as it begins and once as it
  ends, with how long it lasted and how many reads it failed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID
from dbos._error import DBOSWorkflowCancelledError

from stopline import Headline, OpStatus, RunEnded, RunState
from stopline.integrations import _dbos_watch
from stopline.integrations.dbos import call_context
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


async def _until_ended(h: Harness, run_id: str) -> None:
    await until_opened(h, run_id)
    with anyio.fail_after(30):
        while (await h.ledger.backend.get_run(run_id)).state is RunState.RUNNING:
            await h.ledger.wait_for_change(run_id)


# -- the workflow's own DBOSWorkflowCancelledError --------------------------------------

_go: dict[str, anyio.Event] = {}  # workflow id -> set by the test: go on
_uploaded: dict[str, anyio.Event] = {}  # workflow id -> set by the workflow: its step done


@DBOS.workflow()
@dbos_app.gate.workflow()
async def raises_dbos_cancel_itself() -> Any:
    """Uploads, waits for the test, then its own code raises DBOS's signal (a library's
    check, a mistaken re-raise), whether DBOS cancelled it meanwhile or not."""
    sent = await dbos_app.upload("the report")
    _uploaded[str(DBOS.workflow_id)].set()
    await _go[str(DBOS.workflow_id)].wait()
    raise DBOSWorkflowCancelledError(f"raised by the workflow's own code after {sent['id']}")


@pytest.mark.parametrize("dbos_cancelled", [False, True])
async def test_the_workflows_own_dbos_cancel_error_fails_its_run_unless_dbos_cancelled(
    backend: str, tmp_path: Path, dbos_cancelled: bool
) -> None:
    """The workflow's code raises ``DBOSWorkflowCancelledError`` after a step committed.
    Nobody cancelled it: the run fails (not cancelled, nobody's cancel in the receipt),
    DBOS records the workflow ``ERROR`` and its handle raises ``RunEnded`` naming the
    failed run (old: the run fenced "by dbos", and the fence cancelled the workflow in
    DBOS: ``CANCELLED``). With a ``DBOS.cancel_workflow`` before the raise, it is DBOS's
    cancel: the run fenced by dbos, DBOS ``CANCELLED``."""
    async with harness(backend, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        _go[workflow_id], _uploaded[workflow_id] = anyio.Event(), anyio.Event()
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(raises_dbos_cancel_itself)
        with anyio.fail_after(30):
            await _uploaded[workflow_id].wait()
        if dbos_cancelled:
            await DBOS.cancel_workflow_async(workflow_id)
        _go[workflow_id].set()
        await _until_ended(h, workflow_id)
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        if not dbos_cancelled:
            with anyio.fail_after(30), pytest.raises(RunEnded) as raised:
                await handle.get_result()  # old: CANCELLED (nobody's cancel)
        dbos_says = await status(workflow_id)
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert len(h.provider.effects()) == 1
    if dbos_cancelled:
        assert (receipt.cancelled_by, receipt.cancel_reason) == ("dbos", "DBOS.cancel_workflow")
        assert dbos_says == "CANCELLED"
        return
    assert receipt.run_state is RunState.FAILED  # old: cancelled by dbos
    assert receipt.cancelled_by is None
    assert receipt.headline is Headline.FAILED
    assert dbos_says == "ERROR"  # old: CANCELLED, by stopline's fence
    assert raised.value.state is RunState.FAILED
    assert "DBOSWorkflowCancelledError" in str(raised.value)


# -- a step's own DBOSWorkflowCancelledError: both records end failed --------------------


@DBOS.step()
@dbos_app.gate.step(description="post, then raise DBOS's cancel", verify=dbos_app._verify)
async def step_raising_dbos_cancel(payload: str) -> dict[str, Any]:
    sent = await dbos_app._provider[0].send(call_context().key, payload)
    raise DBOSWorkflowCancelledError(f"raised by the step's own code after {sent['id']}")


@DBOS.workflow()
@dbos_app.gate.workflow()
async def step_cancel_flow() -> Any:
    return await step_raising_dbos_cancel("the report")


async def test_a_steps_own_dbos_cancel_error_ends_the_workflow_failed_in_both_records(
    backend: str, tmp_path: Path
) -> None:
    """A step's call commits, then its own code raises ``DBOSWorkflowCancelledError``;
    nobody cancelled the workflow. Its run fails, and DBOS records the workflow
    ``ERROR``: its handle answers with ``RunEnded`` (the run failed), the call read
    back ``committed`` (old: DBOS parked the execution, the workflow ``PENDING`` for
    ever, its handle never answered)."""
    async with harness(backend, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(step_cancel_flow)
        with anyio.fail_after(30), pytest.raises(RunEnded) as raised:
            await handle.get_result()  # old: never answers
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        dbos_says = await status(workflow_id)
    assert dbos_says == "ERROR"  # old: PENDING
    assert receipt.run_state is RunState.FAILED
    assert receipt.cancelled_by is None
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]  # read back
    assert len(h.provider.effects()) == 1
    assert (raised.value.run_id, raised.value.state) == (workflow_id, RunState.FAILED)


# -- an outage of DBOS's system database, logged once each way ---------------------------


async def test_an_outage_of_dbos_database_is_logged_as_it_begins_and_as_it_ends(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gated workflow waits in ``recv``; DBOS's system database becomes unreachable for
    real (SQLite: an exclusive lock held by another connection; PostgreSQL: DBOS's role
    locked out, its sessions ended). The watcher's reads fail, more than one of them
    (each overdue first on SQLite, whose lock holds a read for DBOS's lock wait: the
    harness gives DBOS a 1 s wait, ``system_database_engine``, where DBOS's own is 30 s):
    one warning says so as the first fails (old: one at every failed or overdue read),
    one as a read answers again, with how long the outage lasted and how many reads it
    failed; the health counts the outage once. The workflow then goes on and commits."""
    caplog.set_level(logging.INFO)
    loop, listed = asyncio.get_running_loop(), _dbos_watch._cancelled_among
    reads: list[str] = []  # "began", "failed", "answered", in order (the outage's reads)
    changed = anyio.Event()
    outage_on = [False]
    # PostgreSQL refuses at once: two reads failed. SQLite's lock holds a read for its
    # busy timeout (overdue first, counted then): one failed, the next begun
    enough = 2 if backend == "postgres" else 1

    def note(what: str) -> None:
        nonlocal changed
        reads.append(what)
        changed.set()
        changed = anyio.Event()

    def spy(workflow_ids: list[str]) -> list[str]:  # in the read's thread
        if not outage_on[0]:
            return listed(workflow_ids)
        loop.call_soon_threadsafe(note, "began")
        try:
            found = listed(workflow_ids)
        except Exception:
            loop.call_soon_threadsafe(note, "failed")
            raise
        loop.call_soon_threadsafe(note, "answered")
        return found

    with outage_ready(backend, tmp_path, busy_ms=1000) as (dbs, outage):
        async with running(dbs, FileProvider(tmp_path / "effects.jsonl")) as h:
            watcher = dbos_app.gate._watch
            watcher.read_within = 0.5  # an unanswered read is overdue soon (SQLite's lock)
            monkeypatch.setattr(_dbos_watch, "_cancelled_among", spy)
            workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
            with SetWorkflowID(workflow_id):
                handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"], True)
            await until_opened(h, workflow_id)
            await anyio.to_thread.run_sync(outage.begin)
            outage_on[0] = True
            try:
                with anyio.fail_after(30):  # SQLite's busy timeout ends a read
                    while reads.count("failed") < enough or not _two_reads(reads):
                        await changed.wait()
            finally:
                await anyio.to_thread.run_sync(outage.end)
            await until_watch_failing(h, False)  # a read answered
            said = _said(caplog)
            failures = h.ledger.health.steps["watch_dbos_cancels"].failures
            outage_on[0] = False
            await DBOS.send_async(workflow_id, "ready", "go")
            with anyio.fail_after(30):
                [sent] = await handle.get_result()
    began = [m for m in said if "watch_dbos_cancels failed" in m]
    assert reads.count("began") >= 2  # more than one read in the outage ...
    assert len(began) == 1, said  # ... one warning as it began (old: one per read)
    assert "[SQL:" not in began[0] and "sqlalche.me" not in began[0], began  # old: both
    # what went wrong, said: SQLite's read is overdue first; PostgreSQL refuses DBOS's role
    assert ("has not answered" if backend == "sqlite" else "OperationalError") in began[0]
    ended = [m for m in said if "answers the watcher of waiting workflows again" in m]
    assert len(ended) == 1, said  # old: none
    assert "failed for" in ended[0]
    assert int(ended[0].split("reads failed: ")[1].split(";")[0]) >= enough
    assert failures == 1  # the outage, counted once
    assert h.provider.effects() == [sent["id"]]


def _two_reads(reads: list[str]) -> bool:
    """A read of the outage failed, and another began after it."""
    return "failed" in reads and "began" in reads[reads.index("failed") :]


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings stopline logged about the watcher so far."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("stopline")
    ]
