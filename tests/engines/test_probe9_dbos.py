"""What the ninth probe found on a real DBOS, on SQLite and the machine's PostgreSQL,
ground truth in the provider's own log; barriers, no sleeps (ADR 0102).

- **A step reached while its call is still in flight.** ``DBOS.cancel_workflow`` does
  not stop a step it does not preempt; ``DBOS.resume_workflow`` right after (or DBOS's
  recovery in a second process while the first still runs the step) starts another
  execution beside it, which reaches the step and found its operation ``requested``:
  ``OperationInDoubt`` ("verify or review it"), the workflow failed (DBOS resumes no
  failed workflow) while the first execution's call committed. The step now waits for
  that call's outcome and replays it; a stopline cancel meanwhile stops it as the gate
  does, the workflow cancelled (resumable), not failed.
- **A DBOS step timeout was recorded as a user's cancel.** ``timeout_seconds`` cut the
  step: its operation went ``unknown`` with cause ``user_cancel``, though nobody
  cancelled; now ``local_error``, saying DBOS cut the step and its workflow is not
  cancelled. DBOS's cancel of the workflow (a preemptible step) is still a cancel.
- Held: a read-back begun before a DBOS step retry and written after it (ADR 0099)
  moves nothing; the retry's own outcome stands, sent once.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from dbos import DBOS, SetWorkflowID, WorkflowHandleAsync

from stopline import Headline, OpStatus, ReadBack, RunState
from stopline.domain.model import OperationRecord
from stopline.integrations.dbos import call_context
from stopline.runtime.context import CallContext
from stopline.testing import Barrier
from tests.engines import dbos_app
from tests.engines.dbos_harness import MARKS, Harness, harness, status, until_status

pytestmark = MARKS


def _looks_in_flight(h: Harness, monkeypatch: pytest.MonkeyPatch, op_id: str) -> anyio.Event:
    """Set when the ledger is read for ``op_id`` while it is in flight: a second execution's
    step finding the first's call still at work (a spy on a read: it changes nothing).
    Set on the test's loop, whichever loop DBOS runs that execution on."""
    looked, loop = anyio.Event(), asyncio.get_running_loop()
    read = h.ledger.backend.get_operation

    async def spy(asked: str) -> OperationRecord:
        op = await read(asked)
        if asked == op_id and op.status.in_flight:
            loop.call_soon_threadsafe(looked.set)
        return op

    monkeypatch.setattr(h.ledger.backend, "get_operation", spy)
    return looked


async def _until_looked(looked: anyio.Event, second: WorkflowHandleAsync[Any]) -> None:
    """Until the second execution's step has found the call in flight; its workflow ending
    first (old: failed at once with ``OperationInDoubt``) raises that here."""
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(second.get_result)
            await looked.wait()
            tg.cancel_scope.cancel()


@DBOS.step()  # neither preempted nor retried by DBOS
@dbos_app.gate.step(description="post the message", verify=dbos_app._verify)
async def post(payload: str) -> dict[str, Any]:
    return await dbos_app._provider[0].send(call_context().key, payload)


_FIRST = {"notify": dbos_app.notify, "post": post}


@DBOS.workflow()
@dbos_app.gate.workflow()
async def then_upload(first: str) -> list[Any]:
    return [await _FIRST[first]("the message"), await dbos_app.upload("the report")]


async def _resumed_beside(
    h: Harness, monkeypatch: pytest.MonkeyPatch, hold: Barrier, step: str
) -> tuple[str, WorkflowHandleAsync[Any], WorkflowHandleAsync[Any]]:
    """``then_upload`` started with ``step`` first, held at the provider; cancelled in
    DBOS and resumed at once; returned once the resumed execution's step has found the
    first execution's call in flight: (workflow id, first, second execution)."""
    workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
    with SetWorkflowID(workflow_id):
        first = await DBOS.start_workflow_async(then_upload, step)
    await hold.reached.wait()
    assert hold.key is not None
    looked = _looks_in_flight(h, monkeypatch, hold.key)
    await DBOS.cancel_workflow_async(workflow_id)
    second = await DBOS.resume_workflow_async(workflow_id)
    await _until_looked(looked, second)
    return workflow_id, first, second


@pytest.mark.parametrize("step", sorted(_FIRST))
async def test_a_dbos_resume_while_the_cancelled_step_runs_waits_for_its_answer(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """``DBOS.cancel_workflow`` while ``notify`` (DBOS retries it) or ``post`` (no
    retries) is at the provider, not preempted; ``DBOS.resume_workflow`` at once. The
    resumed execution reaches the step while the first execution's call is in flight:
    it waits for its answer, replays it and goes on (old: ``OperationInDoubt``, the
    workflow failed, the run ``failed``, though the call committed). Sent once."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id, first, second = await _resumed_beside(h, monkeypatch, hold, step)
        hold.release()
        with anyio.fail_after(30):
            results: list[Any] = await second.get_result()
            assert await first.get_result() == results  # the first adopts the outcome
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        dbos_says = await status(workflow_id)
    assert h.provider.effects() == [hold.key, results[1]["id"]]  # each once
    assert results[0]["id"] == hold.key  # the first execution's answer, replayed
    assert dbos_says == "SUCCESS"
    assert receipt.headline is Headline.COMPLETED  # old: failed
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED] * 2


async def test_a_stopline_cancel_while_the_resumed_step_waits_refuses_it_at_the_gate(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, and a stopline cancel comes while the resumed step waits: it is refused as
    the gate refuses (the workflow cancelled in DBOS, so resumable; old: failed with
    ``OperationInDoubt``); the first execution's call commits, kept (R4); nothing else
    is sent."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id, first, second = await _resumed_beside(h, monkeypatch, hold, "post")
        await h.ledger.cancel(workflow_id, by="user:42", reason="pressed stop")
        with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
            await second.get_result()
        await until_status(workflow_id, "CANCELLED")
        hold.release()
        with anyio.fail_after(30), pytest.raises(Exception, match="cancelled"):
            await first.get_result()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        late = [e for e in await h.ledger.backend.events(workflow_id) if "late" in e.data]
    assert h.provider.effects() == [hold.key]  # upload never sent
    assert late and late[0].data["late"] is True  # the first execution's answer, kept
    assert receipt.cancelled_by == "user:42"
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


# -- DBOS's step timeout ---------------------------------------------------------------


@DBOS.step(timeout_seconds=0.2)
@dbos_app.gate.step(description="upload within its timeout", verify=dbos_app._verify)
async def timed_upload(payload: str) -> dict[str, Any]:
    return await dbos_app._provider[0].send(call_context().key, payload)


@DBOS.workflow()
@dbos_app.gate.workflow()
async def timed_flow() -> Any:
    return await timed_upload("the report")


async def _cut_cause(h: Harness, workflow_id: str) -> tuple[str, str]:
    """The cause and the evidence of the workflow's one call when it lost its answer."""
    lost = [e for e in await h.ledger.backend.events(workflow_id) if e.kind == "lost"]
    assert len(lost) == 1
    return lost[0].data["cause"], lost[0].data["evidence"][0]["detail"]


async def test_a_dbos_step_timeout_is_not_recorded_as_a_cancel(
    backend: str, tmp_path: Path
) -> None:
    """DBOS cuts ``timed_upload`` at its ``timeout_seconds`` while the call is at the
    provider: ``unknown`` with cause ``local_error``, saying DBOS cut the step and its
    workflow is not cancelled (old: ``user_cancel``, a cancel nobody made); the run is
    not fenced, the read-back finds nothing: did not happen."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(timed_flow)
        with anyio.fail_after(30), pytest.raises(Exception, match="timeout"):
            await handle.get_result()
        hold.release()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        run = await h.ledger.backend.get_run(workflow_id)
        cause, said = await _cut_cause(h, workflow_id)
    assert cause == "local_error"  # old: user_cancel
    assert "not cancelled" in said and "timeout_seconds" in said
    assert "user_cancel" not in receipt.text()
    assert run.cancelled_at is None and run.state is RunState.FAILED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    assert h.provider.effects() == []


async def test_a_dbos_cancel_that_preempts_a_step_is_still_a_cancel(
    backend: str, tmp_path: Path
) -> None:
    """``DBOS.cancel_workflow`` preempts ``upload`` (preemptible) at the provider: its call
    is cut by that cancel, ``user_cancel``, and the run is fenced by DBOS's cancel."""
    async with harness(backend, tmp_path) as h:
        hold = h.provider.barriers.hold("received")
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(dbos_app.pipeline, ["upload"])
        await hold.reached.wait()
        await DBOS.cancel_workflow_async(workflow_id)
        with anyio.fail_after(30), pytest.raises(Exception, match="cancel"):
            await handle.get_result()
        hold.release()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
        cause, _ = await _cut_cause(h, workflow_id)
    assert cause == "user_cancel"
    assert receipt.cancelled_by == "dbos"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert h.provider.effects() == []


# -- a read-back begun before a DBOS retry, written after it (ADR 0099) -------------------

# set in each attempt's call: the read-back that attempt's loss starts sees it
_lost_here: contextvars.ContextVar[bool] = contextvars.ContextVar("lost_here", default=False)
_plans: dict[str, dict[str, Any]] = {}  # workflow id -> what its ``book`` attempts do


async def _read(ctx: CallContext) -> ReadBack:
    found = await dbos_app._verify(ctx)
    plan = _plans[ctx.op_id.split("/", 1)[0]]
    if _lost_here.get() and not plan["looked"].is_set():  # the first loss's, in background
        plan["looked"].set()
        await plan["go_on"].wait()
    return found


@DBOS.step(retries_allowed=True, interval_seconds=0.01, backoff_rate=1.0, max_attempts=4)
@dbos_app.gate.step(description="book the seat", verify=_read)
async def book(payload: str) -> dict[str, Any]:
    plan = _plans[DBOS.workflow_id or ""]
    _lost_here.set(True)
    plan["attempts"] += 1
    if plan["attempts"] == 1:
        raise ConnectionError("connection reset before the request")
    await plan["looked"].wait()  # the first loss's read-back looked before this is sent
    sent = await dbos_app._provider[0].send(call_context().key, payload)
    if plan["attempts"] == 2 and plan["second_loses"]:
        raise ConnectionError("connection reset after the request")
    return sent


@DBOS.workflow()
@dbos_app.gate.workflow()
async def book_flow() -> Any:
    return await book("seat 12")


async def _notes(h: Harness, workflow_id: str) -> list[Mapping[str, Any]]:
    """The ``read_before_retry`` notes of the workflow's call (ADR 0099)."""
    events = await h.ledger.backend.events(workflow_id)
    return [e.data for e in events if e.kind == "read_before_retry"]


@pytest.mark.parametrize("second_loses", [False, True])
async def test_a_read_back_before_a_dbos_step_retry_moves_nothing_after_it(
    backend: str, tmp_path: Path, second_loses: bool
) -> None:
    """``book``'s first attempt loses its connection before any effect: ``unknown``, read
    back in the background, held after it looked (nothing). DBOS retries: the retry's
    own read-back proves nothing happened, it is sent and commits (or loses its answer
    too, and DBOS's next retry reads it back: committed). The held read is then
    written: refused for the attempt it looked for, kept as a ``read_before_retry``
    note; the call stays committed, sent once."""
    async with harness(backend, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        looked, go_on = anyio.Event(), anyio.Event()
        _plans[workflow_id] = {
            "attempts": 0,
            "looked": looked,
            "go_on": go_on,
            "second_loses": second_loses,
        }
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(book_flow)
        with anyio.fail_after(30):
            result = await handle.get_result()
        go_on.set()
        while not (notes := await _notes(h, workflow_id)):  # the held read, written
            await h.ledger.wait_for_change(workflow_id)
        receipt = await h.ledger.wait_settled(workflow_id, timeout=15)
    assert h.provider.effects() == [result["id"]]  # sent once
    assert notes == [
        {"evidence": notes[0]["evidence"], "attempt": 1, "verdict": "verified_not_committed"}
    ]
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
