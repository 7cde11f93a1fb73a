"""The eleventh probe of the Temporal integration, on a real dev server (ADR 0105).

- **A retry that meets its call still in flight** (``requested``: the worker of an
  earlier attempt froze or died mid-call, and recovery has not taken the call yet)
  failed at once with a retryable ``OperationInDoubt``, spending the retry policy's
  attempts at its pace; the last one failed the activity, though the call committed.
  It now waits in place, its beats going on, until the call answers or recovery
  takes it (then the read-back decides), a stopline cancel ending the wait, and no
  longer than its own timeout.
- **A heartbeat's look at the fence held by the ledger** (a lock another connection
  holds: PostgreSQL's table lock, SQLite's write lock; a connection the server
  terminated) held the heartbeats back, and the call's answer behind it: Temporal
  timed the attempt out, and the committed call's answer was lost (the workflow
  failed). The beats and the watch on the fence are now apart, and the answer goes
  to Temporal at once; the read's fault is logged, typed.

Ground truth is the provider's own file; a worker in a process of its own is killed
mid-call, and the test's ledger sweeps for dead workers only when the test says so.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from stopline import Headline, OpStatus, RunState
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import (
    Harness,
    harness,
    hold_write_lock,
    killed_after_commit,
    worker_for,
)
from tests.engines.temporal_workflows import Plan
from tests.postgres.server import server_url

pytestmark = pytest.mark.timeout(120)


async def _attempt_waits(handle: WorkflowHandle[Any, Any], attempt: int) -> bool:
    """Until Temporal has started ``attempt`` of the workflow's activity: True if it is
    running then (it waits), False if the workflow closed first (it failed at once)."""
    while True:  # Temporal offers nothing to await for an attempt's start
        described = await handle.describe()
        if described.status is not WorkflowExecutionStatus.RUNNING:
            return False
        for pending in described.raw_description.pending_activities:
            started = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
            if pending.attempt >= attempt and started:
                return True
        await anyio.sleep(0.05)


async def _killed_after_commit(
    server: TemporalDevServer, h: Harness, plan: Plan
) -> tuple[WorkflowHandle[Any, Any], str]:
    """The workflow started on a worker of a process of its own, SIGKILLed once its
    provider committed the first effect, before it answered: its call ``requested``.
    This process's ledger sweeps for dead workers no more (its lease made long before
    its first sweep): the call stays ``requested`` until the test recovers it, as the
    call of a worker whose death the ledger has not seen yet (its lease not lapsed)."""
    h.ledger.lease = 3600.0  # before its first renewal's sweep: none in the test
    return await killed_after_commit(server, h, plan)


async def test_a_retry_meeting_its_call_in_flight_waits_for_recovery_and_sends_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Two attempts allowed. The first commits at the provider, and its worker dies
    before answering; the second, on another worker, meets the call ``requested`` (the
    death not yet seen) and waits (old: failed at once, ``OperationInDoubt``, and the
    workflow with it). Recovery takes the call, the waiting attempt reads it back:
    committed, nothing sent again, the workflow completes."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        plan = Plan(["upload"], maximum_attempts=2)
        handle, key = await _killed_after_commit(temporal_server, h, plan)
        async with worker_for(h):
            with anyio.fail_after(30):
                waits = await _attempt_waits(handle, 2)
            await h.ledger.recover()  # what the ledger's sweep does for a dead worker
            with anyio.fail_after(30):
                (result,) = await handle.result()  # old: failed, in doubt
        receipt = await h.ledger.wait_settled(handle.id, timeout=10)
    assert waits  # old: the second attempt failed at once
    assert result == {"id": key, "found": True}  # the read-back's
    assert h.provider.effects() == [key]  # sent once
    assert receipt.headline is Headline.COMPLETED
    assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]


async def test_a_stopline_cancel_ends_the_wait_for_a_call_in_flight(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The second attempt waits for the first's call, left ``requested`` by a dead
    worker; a stopline cancel of the run ends the wait as the gate refuses
    (``RunFenced``: nothing sent), or Temporal's cancel of the workflow reaches it
    first (old: the attempt had failed in doubt before the cancel). Recovery then
    reads the call back: the run settles, the call kept as it happened (once)."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        plan = Plan(["upload"], maximum_attempts=2)
        handle, key = await _killed_after_commit(temporal_server, h, plan)
        async with worker_for(h):
            with anyio.fail_after(30):
                waits = await _attempt_waits(handle, 2)
            await h.ledger.cancel(handle.id, by="user:42", reason="pressed stop")
            with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
                await handle.result()  # the wait ended: the workflow closed
        await h.ledger.recover()
        receipt = await h.ledger.wait_settled(handle.id, timeout=20)
        run = await h.ledger.backend.get_run(handle.id)
    assert waits
    cause = failed.value.cause
    if isinstance(cause, ActivityError):  # the attempt's own end reached the workflow first
        refused = cause.cause
        assert isinstance(refused, ApplicationError) and refused.type == "RunFenced", refused
    else:  # Temporal's cancel of the workflow first
        assert isinstance(cause, CancelledError), cause
    assert run.state is RunState.CANCELLED and run.cancel_reason == "pressed stop"
    assert h.provider.effects() == [key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_wait_for_a_call_in_flight_ends_with_its_attempts_own_timeout(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The call stays ``requested`` (its worker's death not seen): the second attempt,
    the last, waits no longer than its own ``start_to_close_timeout`` and fails in
    doubt saying so and that no attempt is left (old: at once, "verify or review
    it"); nothing is sent. Recovery then reads the call back: committed."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        plan = Plan(["upload"], maximum_attempts=2, start_to_close=3)
        handle, key = await _killed_after_commit(temporal_server, h, plan)
        async with worker_for(h):
            with anyio.fail_after(30):
                waits = await _attempt_waits(handle, 2)
            with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
        await h.ledger.recover()
        receipt = await h.ledger.wait_settled(handle.id, timeout=20)
    assert waits
    cause = failed.value.cause
    assert isinstance(cause, ActivityError)
    doubt = cause.cause
    assert isinstance(doubt, ApplicationError) and doubt.type == "OperationInDoubt"
    assert "still in flight in an earlier attempt" in doubt.message, doubt.message
    assert "no attempt of the activity is left" in doubt.message
    assert h.provider.effects() == [key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


# -- a heartbeat's look at the fence that the ledger holds ------------------------------


async def _beats_after(handle: WorkflowHandle[Any, Any], moment: float) -> bool:
    """Until Temporal records a heartbeat of the activity's first attempt after
    ``moment``: True; False when the attempt ended first (timed out)."""
    while True:  # Temporal offers nothing to await for a heartbeat
        described = await handle.describe()
        pending = list(described.raw_description.pending_activities)
        if not pending or pending[0].attempt != 1:
            return False
        beat = pending[0].last_heartbeat_time
        if beat.seconds + beat.nanos / 1e9 > moment:
            return True
        await anyio.sleep(0.1)


async def _closing_event(handle: WorkflowHandle[Any, Any]) -> int:
    """Until the activity's attempt ends in Temporal's history: how (its event type)."""
    ends = {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    }
    while True:  # Temporal offers nothing to await for an activity's end
        async for event in handle.fetch_history_events():
            if event.event_type in ends:
                return event.event_type
        await anyio.sleep(0.1)


def _held(lock: Any, taken: threading.Event, release: threading.Event) -> threading.Thread:
    """``lock()`` run in a thread of its own, holding the ledger until ``release``."""
    thread = threading.Thread(target=lock, args=(taken, release), daemon=True)
    thread.start()
    return thread


def _typed_warning(caplog: pytest.LogCaptureFixture) -> str:
    """The watch's warning about its read of the fence, once logged."""
    for record in caplog.records:
        if "fence failed" in record.getMessage():
            return record.getMessage()
    return ""


async def _held_ledger_keeps_the_answer(
    h: Harness,
    lock: Any,
    caplog: pytest.LogCaptureFixture,
    fault: Any = None,
) -> None:
    """One attempt allowed, heartbeats every third of a second. Its request held at the
    provider; the ledger locked by another connection (``lock``), ``fault`` done to the
    waiting read: Temporal records heartbeats two heartbeat timeouts on (old: it timed
    the attempt out), the watch's read fails typed, logged; the provider answers while
    the ledger is still locked, and the answer reaches Temporal then (old: held behind
    the read). The workflow completes with that answer, sent once."""
    caplog.set_level(logging.WARNING, logger="stopline.integrations.temporal")
    hold = h.provider.barriers.hold("received")
    taken, release = threading.Event(), threading.Event()
    thread = None
    try:
        async with worker_for(h):
            handle = await h.start(Plan(["upload"], maximum_attempts=1))
            with anyio.fail_after(30):
                await hold.reached.wait()
            thread = _held(lock, taken, release)
            await anyio.to_thread.run_sync(taken.wait)
            since = time.time()
            if fault is not None:
                await fault()
            with anyio.fail_after(30):
                beats = await _beats_after(handle, since + 2)  # two heartbeat timeouts
            with anyio.fail_after(30):
                while beats and not _typed_warning(caplog):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            hold.release()
            with anyio.fail_after(30):
                ended = await _closing_event(handle)  # the ledger still locked
            release.set()
            with anyio.fail_after(30):
                (result,) = await handle.result()
    finally:
        release.set()
        hold.release()
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)
    receipt = await h.ledger.wait_settled(handle.id, timeout=20)
    history = [e async for e in handle.fetch_history_events()]
    attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in history
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    assert beats  # old: no heartbeat reached Temporal while the read waited
    assert "LedgerLocked" in _typed_warning(caplog), _typed_warning(caplog)
    assert ended == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    assert attempts == [1]
    assert result == {"id": result["id"], "payload": f"upload of {handle.id}"}  # its own
    assert h.provider.effects() == [result["id"]]
    assert receipt.headline is Headline.COMPLETED


async def test_a_beats_look_at_the_fence_held_by_a_postgresql_lock_loses_nothing(
    temporal_server: TemporalDevServer,
    tmp_path: Path,
    pg_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL: another session holds ``runs`` locked (ACCESS EXCLUSIVE); the
    server terminates the connection whose read of the fence waits on it
    (``pg_terminate_backend``); the retry waits again, and fails ``LedgerLocked`` at
    the ledger's ``retry_for``."""
    schema = pg_url.rsplit("schema=", 1)[1]
    app = f"probe11_{schema}"

    def lock(taken: threading.Event, release: threading.Event) -> None:
        with psycopg.connect(server_url()) as conn:
            conn.execute(f'LOCK TABLE "{schema}".runs IN ACCESS EXCLUSIVE MODE')
            taken.set()
            release.wait(60)
            conn.rollback()

    def terminate_waiting() -> int:
        with psycopg.connect(server_url(), autocommit=True) as admin:
            return len(
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s AND wait_event_type = 'Lock'",
                    (app,),
                ).fetchall()
            )

    async def fault() -> None:
        with anyio.fail_after(30):
            # the server offers nothing to await for a session waiting on a lock
            while not await anyio.to_thread.run_sync(terminate_waiting):  # noqa: ASYNC110
                await anyio.sleep(0.05)

    url = f"{pg_url}&retry_for=2&application_name={app}"
    async with harness(temporal_server, tmp_path, worker=False, url=url) as h:
        await _held_ledger_keeps_the_answer(h, lock, caplog, fault)


async def test_a_beats_look_at_the_fence_held_by_an_sqlite_lock_loses_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite: another connection holds the file's write lock (``BEGIN IMMEDIATE``, as
    ``sqlite3`` at a prompt would); the ledger's reads wait for it too (one writer
    thread), and fail ``LedgerLocked`` at its ``busy_timeout``."""
    path = tmp_path / "ledger.db"

    url = f"sqlite:///{path}?busy_timeout=1"
    async with harness(temporal_server, tmp_path, worker=False, url=url) as h:
        await _held_ledger_keeps_the_answer(h, functools.partial(hold_write_lock, path), caplog)
