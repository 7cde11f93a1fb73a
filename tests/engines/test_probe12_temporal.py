"""The twelfth probe of the Temporal integration, on a real dev server (ADR 0111).

- **A workflow's run end the ledger refuses** (an operator's trigger: ``LedgerRefused``)
  was retried by Temporal's default local-activity retry policy without a bound: the
  workflow stayed "running" for ever, its run too, nothing said why. It now fails at
  once, typed and non-retryable, naming its run left running; the worker goes on.
- **A fault that may clear** (another connection holds SQLite's write lock) is still
  retried, now seen in ``ledger.health``, and the run ends once the lock is released.

Ground truth is the provider's own file and the ledger's events.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ActivityError, ApplicationError

from stopline import Headline, OpStatus, RunState
from stopline.errors import UnknownRun
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import Harness, harness, hold_write_lock
from tests.engines.temporal_workflows import Plan

pytestmark = pytest.mark.timeout(120)

END_RUN = "stopline.end_run"
FENCE_RUN = "stopline.fence_run"


async def _ended_events(h: Harness, run_id: str) -> list[str]:
    """The run's own moves to an end (completed, failed, cancelled), in order."""
    ends = {RunState.COMPLETED.value, RunState.FAILED.value, RunState.CANCELLED.value}
    return [
        str(e.to_state)
        for e in await h.ledger.backend.events(run_id)
        if e.op_id is None and e.to_state in ends
    ]


async def _committed(h: Harness, handle: WorkflowHandle[Any, Any]) -> None:
    """Until the workflow's one call is committed in the ledger."""
    while True:  # polled: the call is the worker's, and its commit wakes this wait
        with contextlib.suppress(UnknownRun):  # its workflow has not opened it yet
            ops = await h.ledger.backend.operations(handle.id)
            if ops and ops[0].status is OpStatus.COMMITTED:
                return
        await h.ledger.wait_for_change(handle.id, poll=0.05)


async def _opened(h: Harness, handle: WorkflowHandle[Any, Any]) -> None:
    """Until the workflow's run is in the ledger (its ``open_run`` answered)."""
    while True:  # polled: the run is the worker's, and its commit wakes this wait
        with contextlib.suppress(UnknownRun):
            await h.ledger.backend.get_run(handle.id)
            return
        await h.ledger.wait_for_change(handle.id, poll=0.05)


async def test_a_run_end_the_ledger_refuses_fails_the_workflow_typed_at_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An operator's trigger refuses every run's completion. The workflow's call
    commits; its run's end is refused: the workflow fails at once, ``LedgerRefused``,
    non-retryable, naming its run, left running (old: ``stopline.end_run`` retried
    without a bound, the workflow "running" for ever). One try, counted in the
    ledger's health. The worker goes on: the trigger dropped, the next workflow
    completes and its run ends."""
    async with harness(temporal_server, tmp_path) as h:
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        db.execute(
            "CREATE TRIGGER no_end BEFORE UPDATE OF state ON runs"
            " WHEN NEW.state = 'completed' BEGIN SELECT RAISE(ABORT, 'no run ends today'); END"
        )
        handle = await h.start(Plan(["upload"]))
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
            await handle.result()  # old: never
        run = await h.ledger.backend.get_run(handle.id)  # before a look ends it (ADR 0119)
        db.execute("DROP TRIGGER no_end")
        db.close()
        ops = await h.ledger.backend.operations(handle.id)
        step = h.ledger.health.steps[END_RUN]
        nxt = await h.start(Plan(["upload"]))
        with anyio.fail_after(30):
            (answer,) = await nxt.result()
        receipt = await h.ledger.wait_settled(nxt.id, timeout=20)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "LedgerRefused", cause
    assert cause.non_retryable
    assert f"did not end its run {handle.id!r}" in cause.message, cause.message
    assert "no run ends today" in cause.message and "left as the ledger holds" in cause.message
    local = cause.cause  # the local activity's own failure
    if isinstance(local, ActivityError):
        local = local.cause
    assert isinstance(local, ApplicationError) and local.type == "LedgerRefused", local
    assert local.non_retryable  # old: retried without a bound
    assert (step.failures, step.retries) == (1, 0) and "LedgerRefused" in step.last_error
    assert run.state is RunState.RUNNING  # as the ledger holds it: its end was refused
    assert [op.status for op in ops] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.COMPLETED
    effects = h.provider.effects()
    assert len(effects) == len(set(effects)) == 2 and answer["id"] in effects  # each once


async def test_a_run_end_held_by_a_lock_is_retried_and_ends_once_released(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Another connection holds SQLite's write lock as the workflow ends: its run's end
    fails ``LedgerLocked`` at the ledger's ``busy_timeout``, is retried (counted as
    retrying in the ledger's health: old, unseen), and the run ends completed, once,
    when the lock is released."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}?busy_timeout=1"
    taken, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=hold_write_lock, args=(path, taken, release), daemon=True)
    async with harness(temporal_server, tmp_path, url=url) as h:
        try:
            handle = await h.start(Plan(["upload"], hold_after=True))
            with anyio.fail_after(30):
                await _committed(h, handle)
            thread.start()
            await anyio.to_thread.run_sync(taken.wait)
            await handle.signal("go")
            with anyio.fail_after(30):
                while END_RUN not in h.ledger.health.steps:
                    await h.ledger.health.changed()  # old: never
            release.set()
            with anyio.fail_after(30):
                (result,) = await handle.result()
        finally:
            release.set()
            if thread.is_alive():
                await anyio.to_thread.run_sync(thread.join)
        step = h.ledger.health.steps[END_RUN]
        receipt = await h.ledger.wait_settled(handle.id, timeout=20)
        ended = await _ended_events(h, handle.id)
    assert step.retries >= 1 and "LedgerLocked" in step.last_error
    assert ended == [RunState.COMPLETED.value]
    assert receipt.headline is Headline.COMPLETED
    assert h.provider.effects() == [result["id"]]


async def test_a_call_whose_intent_the_ledger_refuses_fails_at_once_and_sends_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An operator's trigger refuses every new call's intent. The activity fails at
    once, ``LedgerRefused``, non-retryable, nothing sent (old: retried by Temporal's
    default policy without a bound, each attempt refused the same, the workflow
    "running" for ever). Its workflow fails with it, and its run ends failed."""
    async with harness(temporal_server, tmp_path) as h:
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        db.execute(
            "CREATE TRIGGER no_call BEFORE INSERT ON operations"
            " BEGIN SELECT RAISE(ABORT, 'no new calls today'); END"
        )
        handle = await h.start(Plan(["upload"]))
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
            await handle.result()  # old: never
        db.close()
        run = await h.ledger.backend.get_run(handle.id)
        history = [e async for e in handle.fetch_history_events()]
    started = [
        e.activity_task_started_event_attributes.attempt
        for e in history
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    cause = failed.value.cause
    assert isinstance(cause, ActivityError), cause
    refused = cause.cause
    assert isinstance(refused, ApplicationError) and refused.type == "LedgerRefused", refused
    assert refused.non_retryable and "no new calls today" in refused.message
    assert started == [1]  # one attempt
    assert h.provider.effects() == []  # nothing sent
    assert run.state is RunState.FAILED


async def test_a_fence_the_ledger_refuses_fails_the_workflow_before_its_code_hears(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An operator's trigger refuses every run's cancel. A Temporal cancel of a workflow
    waiting for "go": its fence is refused, and the workflow fails at once,
    ``LedgerRefused``, its code never told of the cancel (R1: nothing it does
    afterwards could pass an unfenced gate), nothing sent (old: the fence retried
    without a bound, the workflow "running" for ever)."""
    async with harness(temporal_server, tmp_path) as h:
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        db.execute(
            "CREATE TRIGGER no_cancel BEFORE UPDATE ON runs WHEN NEW.cancelled_at IS NOT NULL"
            " BEGIN SELECT RAISE(ABORT, 'no cancel today'); END"
        )
        handle = await h.start(Plan(["upload"], wait_for_go=True))
        with anyio.fail_after(30):
            await _opened(h, handle)
        await handle.cancel()
        with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
            await handle.result()  # old: never
        db.close()
        step = h.ledger.health.steps[FENCE_RUN]
    cause = failed.value.cause
    refused = cause.cause if isinstance(cause, ActivityError) else cause
    assert isinstance(refused, ApplicationError) and refused.type == "LedgerRefused", refused
    assert refused.non_retryable and "no cancel today" in refused.message
    assert (step.failures, step.retries) == (1, 0)
    assert h.provider.effects() == []
