"""Whose ``DBOSWorkflowCancelledError`` it is when DBOS's record changes while the wrapper
reads it (ADRs 0114, 0118), on a real DBOS over SQLite and the machine's PostgreSQL,
with barriers: the wrapper's read of DBOS's ownership token is held (the real read,
made once the test lets it) while the test acts through DBOS's own API.

- **A resume between DBOS's cancel and the wrapper's read.** DBOS cancelled the
  workflow, its check raised the error before the next step, and a
  ``DBOS.resume_workflow`` lands before the wrapper reads the record: another execution
  holds the workflow (the ``HANDED_ON`` branch), the run is left to it, and the
  resumed workflow sends its next step once and completes. Taken for the code's own
  error (a status read alone: ``ENQUEUED``), the run would have failed and the resumed
  workflow been refused; taken for DBOS's cancel, fenced and refused again.
- **A cancel between the wrapper's read and DBOS's write of ERROR.** The code's own
  error, the record still this execution's: the run fails, then the cancel lands and
  DBOS records ``CANCELLED``. The receipt says what the ledger proves (failed, nobody's
  cancel, the step committed); a ``DBOS.resume_workflow`` then sends nothing again and
  ends the workflow ``ERROR`` in DBOS, with the run (ADR 0118).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID, WorkflowHandleAsync
from dbos._error import DBOSWorkflowCancelledError

from stopline import OpStatus, RunEnded, RunState
from stopline.integrations import _dbos_context, _dbos_watch
from tests.engines import dbos_app
from tests.engines.dbos_harness import MARKS, Harness, harness, status, until_status

pytestmark = MARKS

_go: dict[str, anyio.Event] = {}  # workflow id -> set by the test: go on
_uploaded: dict[str, anyio.Event] = {}  # workflow id -> set by the workflow: its step done
_own_error: dict[str, bool] = {}  # workflow id -> its code raises DBOS's cancel error


@DBOS.workflow()
@dbos_app.gate.workflow()
async def uploads_then_waits() -> list[Any]:
    """Uploads, waits for the test, then uploads again (DBOS's check before that step
    raises DBOS's cancel error if DBOS cancelled it) or its own code raises the error."""
    workflow_id = str(DBOS.workflow_id)
    first = await dbos_app.upload(f"first of {workflow_id}")
    _uploaded[workflow_id].set()
    await _go[workflow_id].wait()
    if _own_error[workflow_id]:
        raise DBOSWorkflowCancelledError(f"raised by the workflow's code after {first['id']}")
    return [first, await dbos_app.upload(f"second of {workflow_id}")]


class HeldRead:
    """The wrapper's read of DBOS's ownership token of one workflow, held once: before
    it is made (``before``) or after it answered (``after``), until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, workflow_id: str, at: str) -> None:
        self.reached, self.released = anyio.Event(), anyio.Event()
        self.read: list[str | None] = []
        real: Callable[[str], Awaitable[str | None]] = _dbos_watch.owner_in_dbos

        async def held(wid: str) -> str | None:
            first = wid == workflow_id and not self.reached.is_set()
            if first and at == "before":
                self.reached.set()
                await self.released.wait()
            token = await real(wid)
            if first and at == "after":
                self.read.append(token)
                self.reached.set()
                await self.released.wait()
            return token

        monkeypatch.setattr(_dbos_context, "owner_in_dbos", held)


async def _started(h: Harness, own_error: bool) -> tuple[str, Any]:
    # the watcher of waiting workflows reads no cancel here: the wrapper decides alone
    # (the watcher's own race with a resume is its ``since``, ADR 0104)
    dbos_app.gate._watch.every = 3600
    workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
    _go[workflow_id], _uploaded[workflow_id] = anyio.Event(), anyio.Event()
    _own_error[workflow_id] = own_error
    with SetWorkflowID(workflow_id):
        handle = await DBOS.start_workflow_async(uploads_then_waits)
    with anyio.fail_after(30):
        await _uploaded[workflow_id].wait()
    return workflow_id, handle


async def test_a_resume_before_the_wrapper_reads_dbos_record_leaves_the_run_to_it(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DBOS.cancel_workflow`` after the first step; DBOS's check raises the error before
    the second; ``DBOS.resume_workflow`` lands while the wrapper's read of the record is
    held. The read finds another execution's workflow: the run is neither fenced nor
    failed, the resumed execution sends the second step (the first is DBOS's replay, not
    sent again), and the run and the workflow both complete."""
    async with harness(backend, tmp_path) as h:
        workflow_id, _ = await _started(h, own_error=False)
        held = HeldRead(monkeypatch, workflow_id, "before")
        await DBOS.cancel_workflow_async(workflow_id)
        _go[workflow_id].set()  # DBOS's check before the second step raises
        with anyio.fail_after(30):
            await held.reached.wait()
        await DBOS.resume_workflow_async(workflow_id)
        held.released.set()
        resumed: WorkflowHandleAsync[list[Any]]
        resumed = await DBOS.retrieve_workflow_async(workflow_id)
        with anyio.fail_after(30):
            first, second = await resumed.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        dbos_says = await status(workflow_id)
    assert dbos_says == "SUCCESS"
    assert receipt.run_state is RunState.COMPLETED  # not failed, not fenced by dbos
    assert receipt.cancelled_by is None
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 2
    assert h.provider.effects() == [first["id"], second["id"]]  # each step sent once


async def test_a_cancel_after_the_wrapper_read_its_own_error_leaves_the_run_failed(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workflow's code raises DBOS's cancel error; the wrapper reads the record (still
    this execution's: nobody cancelled it) and is held there while
    ``DBOS.cancel_workflow`` lands. The run fails (the code's error, nobody's cancel:
    what the ledger recorded before any cancel reached it), and DBOS, its write of ERROR
    refused by the cancel, says ``CANCELLED``. A ``DBOS.resume_workflow`` then runs the
    code again: the committed step is DBOS's replay (nothing sent again), the run stays
    failed, and DBOS records the workflow ``ERROR`` with ``RunEnded``: the two records
    agree again, one effect in all."""
    async with harness(backend, tmp_path) as h:
        workflow_id, handle = await _started(h, own_error=True)
        held = HeldRead(monkeypatch, workflow_id, "after")
        _go[workflow_id].set()
        with anyio.fail_after(30):
            await held.reached.wait()
        await DBOS.cancel_workflow_async(workflow_id)
        held.released.set()
        with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
            await handle.get_result()  # DBOS's: its write of ERROR came after the cancel
        cancelled = await status(workflow_id)
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        await DBOS.resume_workflow_async(workflow_id)
        await until_status(workflow_id, "ERROR")
        resumed: WorkflowHandleAsync[list[Any]]
        resumed = await DBOS.retrieve_workflow_async(workflow_id)
        with anyio.fail_after(30), pytest.raises(RunEnded) as raised:
            await resumed.get_result()
        after = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert held.read and held.read[0] is not None  # the execution still held it as read
    assert cancelled == "CANCELLED"
    assert receipt.run_state is RunState.FAILED
    assert receipt.cancelled_by is None  # the cancel came after the run had ended
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert raised.value.state is RunState.FAILED
    assert after.run_state is RunState.FAILED
    assert [line.status for line in after.lines] == [OpStatus.COMMITTED]
    assert len(h.provider.effects()) == 1  # nothing sent again
