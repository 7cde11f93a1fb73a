"""The eleventh probe of the Temporal integration: a standalone activity's run end (ADR 0105).

- **The worker of the last attempt died, and nothing ended its run**: "Running." for
  ever, ``wait_settled`` never returned (a documented limit). The next worker's look
  as it starts, and every worker's look at its ledger's sweeps for dead workers,
  now ask Temporal what became of the execution and close the run as it says: timed
  out, the run fenced "timed out" and settled by the read-back of its call.
- **The run's end met the ledger's trouble.** The activity's answer waited for the
  end: a ledger slow to write it (the file locked by another connection) held the
  answer past the heartbeat timeout, and Temporal timed the attempt out: the answer
  was lost. A fault that may clear was then retried by a loop of the plugin's own,
  unseen (``ledger.health`` clean); a write the ledger refuses (an operator's
  trigger) was retried by it for ever, against ADR 0079; and a retry the ledger's
  close dropped left the run open for good. The end is now waited for a beat at
  most, its retry is the ledger's error boundary's (seen in ``health``; a refusal
  logged and not retried), and a look ends what was left: once, the activity's own
  answer kept.

Ground truth is the provider's own file; a worker in a process of its own is killed
mid-call.
"""

from __future__ import annotations

import dataclasses
import functools
import sqlite3
import threading
import uuid
from pathlib import Path

import anyio
import pytest
from temporalio.client import ActivityExecutionStatus, ActivityFailureError
from temporalio.worker import Worker

import stopline
from stopline import Headline, OpStatus, RunState
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import (
    Harness,
    activities,
    harness,
    hold_write_lock,
    plugin,
    standalone_worker,
    start_standalone,
    worker_process,
)
from tests.engines.test_probe10_temporal import _runs_of

pytestmark = pytest.mark.timeout(120)


async def _last_attempts_worker_killed(
    server: TemporalDevServer, h: Harness, activity_id: str
) -> str:
    """``upload`` started by the client, one attempt allowed, run by a worker of a
    process of its own that is SIGKILLed once its provider committed (before it
    answered, before its run could end); Temporal times the activity out. Its key."""
    child = await worker_process(server, h)
    try:
        handle = await start_standalone(h, activity_id, attempts=1)
        committed = await child.expect("committed ")
    finally:
        await child.kill()
    with anyio.fail_after(30), pytest.raises(ActivityFailureError):
        await handle.result()  # heartbeat timeout: no attempt follows
    assert (await handle.describe()).status is ActivityExecutionStatus.TIMED_OUT
    return committed.split(" ", 1)[1]


async def _ended_events(h: Harness, run_id: str) -> list[str]:
    """The run's own moves to an end (completed, failed, cancelled), in order."""
    ends = {RunState.COMPLETED.value, RunState.FAILED.value, RunState.CANCELLED.value}
    return [
        str(e.to_state)
        for e in await h.ledger.backend.events(run_id)
        if e.op_id is None and e.to_state in ends
    ]


async def test_a_standalone_activity_whose_last_worker_died_is_ended_by_the_next_worker(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The worker of the only attempt dies after its provider committed; Temporal times
    the activity out. Recovery reads the call back (committed), but nothing ended the
    run (old: "Running." for ever). The next worker's look as it starts asks Temporal,
    and fences the run "timed out", as a live worker would have: it settles, the call
    kept, sent once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        key = await _last_attempts_worker_killed(temporal_server, h, activity_id)
        await h.ledger.recover()  # what the restarted worker's ledger does as it opens
        (run_id,) = await _runs_of(h, activity_id)
        async with standalone_worker(h):
            with anyio.fail_after(30):
                receipt = await h.ledger.wait_settled(run_id)  # old: never
        run = await h.ledger.backend.get_run(run_id)
    assert run.state is RunState.CANCELLED
    assert run.cancel_reason == "timed out" and run.cancelled_by is not None
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert "read_back" in [e.kind.value for e in receipt.lines[0].evidence]
    assert h.provider.effects() == [key]


async def test_a_running_workers_look_ends_a_run_recovery_took_from_a_dead_one(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A worker runs (on a queue of its own) before the activity starts; the activity's
    only attempt runs on another worker, which dies after its provider committed. The
    ledger's sweep takes the dead worker's call, and the running worker's look at that
    sweep closes the run as Temporal says (timed out), without a worker starting."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        h.ledger.lease = 1.0  # its sweeps (and the plugin's looks): every third of a second
        elsewhere = dataclasses.replace(h, task_queue=f"q-{uuid.uuid4().hex[:12]}")
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        async with standalone_worker(h):
            key = await _last_attempts_worker_killed(temporal_server, elsewhere, activity_id)
            (run_id,) = await _runs_of(h, activity_id)
            with anyio.fail_after(30):
                receipt = await h.ledger.wait_settled(run_id)  # old: never
        run = await h.ledger.backend.get_run(run_id)
        ended = await _ended_events(h, run_id)
    assert run.cancel_reason == "timed out"
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert h.provider.effects() == [key]
    assert ended == [RunState.CANCELLED.value]


async def test_a_run_end_the_ledger_cannot_write_now_is_retried_by_its_error_boundary(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """The provider answers while another connection holds the SQLite file's write
    lock: the activity completes with that answer at once, the ledger still locked
    (old: the answer waited behind the end's read of the locked ledger, past the
    heartbeat timeout: Temporal timed the attempt out, and the answer was lost). The
    run's end, ``LedgerLocked``, is retried in the ledger's background by its error
    boundary (seen in ``ledger.health``) and ends the run once the lock is gone, once."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}?busy_timeout=1"
    async with harness(temporal_server, tmp_path, worker=False, url=url) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        hold = h.provider.barriers.hold("received")
        taken, release = threading.Event(), threading.Event()

        lock = functools.partial(hold_write_lock, path, taken, release)
        thread = threading.Thread(target=lock, daemon=True)
        try:
            async with standalone_worker(h):
                handle = await start_standalone(h, activity_id, attempts=1)
                with anyio.fail_after(30):
                    await hold.reached.wait()
                thread.start()
                await anyio.to_thread.run_sync(taken.wait)
                hold.release()
                with anyio.fail_after(30):
                    result = await handle.result()  # the ledger still locked
                    while "end_activity_run" not in h.ledger.health.steps:
                        await h.ledger.health.changed()  # old: never
                release.set()
                (run_id,) = await _runs_of(h, activity_id)
                receipt = await h.ledger.wait_settled(run_id, timeout=30)
        finally:
            release.set()
            hold.release()
            if thread.is_alive():
                await anyio.to_thread.run_sync(thread.join)
        step = h.ledger.health.steps["end_activity_run"]
        ended = await _ended_events(h, run_id)
    assert result == {"id": result["id"], "payload": "the report"}  # its own answer
    assert step.retries >= 1 and "LedgerLocked" in step.last_error
    assert receipt.headline is Headline.COMPLETED
    assert ended == [RunState.COMPLETED.value]  # once
    assert h.provider.effects() == [result["id"]]


async def test_a_run_end_the_ledger_refuses_is_left_to_the_next_workers_look(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """An operator's trigger refuses every run's completion. The activity completes
    with its own answer; its run's end, ``LedgerRefused``, is logged in ``health`` and
    not retried (ADR 0079; old: retried for ever, unseen). The worker and its ledger
    close; the trigger is dropped; the next worker's look ends the run completed
    (old: "Running." for ever), once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        db = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        db.execute(
            "CREATE TRIGGER no_end BEFORE UPDATE OF state ON runs"
            " WHEN NEW.state = 'completed' BEGIN SELECT RAISE(ABORT, 'no run ends today'); END"
        )
        async with stopline.open(h.ledger_url) as first:  # the first worker's, closed with it
            acts = activities(h.provider)
            async with Worker(
                h.client,
                task_queue=h.task_queue,
                activities=acts,
                plugins=[plugin(first, h.provider, acts)],
            ):
                handle = await start_standalone(h, activity_id, attempts=1)
                with anyio.fail_after(30):
                    result = await handle.result()
                    while "end_activity_run" not in first.health.steps:
                        await first.health.changed()  # old: never
            refused = dataclasses.replace(first.health.steps["end_activity_run"])
        db.execute("DROP TRIGGER no_end")
        db.close()
        (run_id,) = await _runs_of(h, activity_id)
        left = (await h.ledger.backend.get_run(run_id)).state
        async with standalone_worker(h):  # the next worker: its look as it starts
            with anyio.fail_after(30):
                receipt = await h.ledger.wait_settled(run_id)  # old: never
        ended = await _ended_events(h, run_id)
    assert "LedgerRefused" in refused.last_error and refused.retries == 0
    assert left is RunState.RUNNING
    assert result == {"id": result["id"], "payload": "the report"}
    assert receipt.headline is Headline.COMPLETED
    assert ended == [RunState.COMPLETED.value]
    assert h.provider.effects() == [result["id"]]
