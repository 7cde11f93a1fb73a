"""The ninth probe of the Temporal integration, from a user's side, on a real dev server.

- **A standalone activity's first attempt failed on its own heartbeat.** An activity
  started by a client (``Client.start_activity``: no workflow) is a run of its own,
  made by its first gated call. The plugin's first heartbeat read that run's fence
  before the call had made it: ``UnknownRun`` ended the heartbeats, and re-raised as
  the heartbeats stopped it replaced the call's outcome. The attempt failed though its
  effect had committed: with ``maximum_attempts=1`` the client was told the activity
  failed (a retry would have returned the recorded result). A run not made yet is not
  fenced; a fence the ledger cannot read now is read at the next beat.
- **"Not yet" on the last attempt gave up, and promised a retry** (R13). A retry of a
  call in doubt whose read-back finds nothing before the horizon sends nothing and
  raises a retryable ``OperationInDoubt`` ("not yet, retried after its horizon"),
  Temporal's next attempt scheduled at the horizon. On an attempt that none follows
  (``maximum_attempts`` spent) the activity failed with that message, though no retry
  came, and the workflow failed, though the horizon fell within the attempt's own
  timeout. Such an attempt now waits for the horizon in place (its heartbeats go on:
  a cancel still reaches it) and looks again: found, its result; not found, sent once.
  When the horizon lies past its own timeout, it fails saying no attempt is left to
  look then; the call stays ``unknown`` (never "did not happen") until the read-back
  after the horizon decides.
- **A client's cancel of a standalone activity** was recorded as "the workflow's
  code" cancelling it: it has no workflow.

Held (no change): a workflow cancel while Temporal waits for the horizon between
attempts sends nothing and the read-back after the horizon settles the run; a
``next_retry_delay`` past the retry policy's ``maximum_interval`` is honoured.
Ground truth is the provider's own file; barriers, events and the ledger's changes.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio import activity
from temporalio.client import (
    ActivityFailureError,
    WorkflowExecutionStatus,
    WorkflowFailureError,
)
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

import stopline
from stopline import Headline, OpStatus, ReadBack
from stopline.integrations.temporal import activity_run_id, call_context
from stopline.integrations.temporal_server import TemporalDevServer
from stopline.runtime.context import CallContext
from tests.engines.temporal_harness import (
    Harness,
    harness,
    standalone_worker,
    start_standalone,
    worker_for,
)
from tests.engines.temporal_workflows import Plan
from tests.engines.test_temporal_truth_gaps import _the_cut

pytestmark = pytest.mark.timeout(120)


async def test_a_standalone_activitys_first_attempt_is_not_failed_by_its_run_not_made_yet(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """One attempt allowed: the activity's first gated call makes its run, and the
    plugin's first heartbeat reads it before. Old: the attempt failed with
    ``UnknownRun`` after its effect committed; now it returns its result, sent once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        async with standalone_worker(h):
            handle = await start_standalone(h, activity_id, attempts=1)
            with anyio.fail_after(30):
                result = await handle.result()  # old: ActivityFailureError (UnknownRun)
        assert handle.run_id is not None
        receipt = await h.ledger.receipt(activity_run_id(activity_id, handle.run_id))
    assert h.provider.effects() == [result["id"]]  # sent once
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


def _flaky(h: Harness, ran: list[int]) -> Any:
    """``flaky``: attempt 1 loses its connection after dispatch, before any effect; a
    later attempt whose code runs sends through the provider. ``ran``: the attempts
    whose code ran (a retry the gate answers from the ledger runs none)."""

    @activity.defn(name="flaky")
    async def flaky(payload: str) -> Any:
        ran.append(activity.info().attempt)
        if activity.info().attempt == 1:
            raise ConnectionError("connection reset: the request did not arrive")
        return await h.provider.send(call_context().key, payload)

    return flaky


async def test_the_last_attempts_not_yet_waits_for_the_horizon_and_sends_once(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """``flaky`` (a remote provider's tool: no ``settles_within``, its horizon the 2 s
    ``start_to_close_timeout``), two attempts allowed. Attempt 2 reads back "not found"
    before the horizon: not yet, and no attempt follows it. Old: the workflow failed
    ("retried after its horizon", no retry came). Now attempt 2 waits for the horizon
    in place, reads back again, finds nothing, and sends once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        ran: list[int] = []
        flaky = _flaky(h, ran)
        tool = h.provider.tool("flaky", flaky, "upload it remotely", None)
        async with worker_for(h, flaky, tools=[tool]):
            handle = await h.start(Plan(["flaky"], maximum_attempts=2, start_to_close=2))
            with anyio.fail_after(30):
                (result,) = await handle.result()  # old: WorkflowFailureError
            receipt = await h.ledger.wait_settled(handle.id, timeout=15)
    assert h.provider.effects() == [result["id"]]  # sent once, after the horizon
    assert ran == [1, 2]
    assert receipt.headline is Headline.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


async def test_a_last_attempt_whose_horizon_is_past_its_timeout_says_no_retry_comes(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """``flaky`` declares its provider may land a request up to 4 s after it left
    (``settles_within``), past the attempts' 1 s timeout; two attempts allowed. Attempt 2
    cannot wait for the horizon: it fails in doubt, saying no attempt is left to look
    then (old: "retried after its horizon"), and sends nothing. Until the horizon the
    call is ``unknown``, never "did not happen"; the read-back after it decides."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        ran: list[int] = []
        flaky = _flaky(h, ran)
        tool = h.provider.tool("flaky", flaky, "upload it remotely", 4.0)
        async with worker_for(h, flaky, tools=[tool]):
            handle = await h.start(Plan(["flaky"], maximum_attempts=2, start_to_close=1))
            with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
            receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        (op,) = await h.ledger.backend.operations(handle.id)
        events = [e for e in await h.ledger.backend.events(handle.id) if e.op_id == op.id]
    cause = failed.value.cause
    assert isinstance(cause, ActivityError)
    in_doubt = cause.cause
    assert isinstance(in_doubt, ApplicationError) and in_doubt.type == "OperationInDoubt"
    assert "no attempt of the activity is left" in in_doubt.message, in_doubt.message
    assert "the next attempt" not in in_doubt.message
    assert h.provider.effects() == [] and ran == [1]  # nothing sent
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]
    # R13: "not found" said "did not happen" only once the horizon had passed
    (decided,) = [e for e in events if e.to_state == OpStatus.NOT_COMMITTED.value]
    assert op.horizon is not None and decided.at >= op.horizon


async def test_a_cancel_while_the_last_attempt_waits_for_its_horizon_sends_nothing(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """As above, two attempts, the horizon within attempt 2's timeout: attempt 2 has
    read back "not found" and waits for the horizon. The user cancels the workflow:
    the cancel reaches the waiting attempt (its heartbeats go on), nothing is sent, and
    the read-back after the horizon settles the run before any external action."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        ran: list[int] = []
        looked = anyio.Event()  # attempt 2 read the call back ("not found", not yet)
        flaky = _flaky(h, ran)

        async def read_back(ctx: CallContext) -> ReadBack:
            read = await h.provider.verify(ctx)
            if activity.in_activity() and activity.info().attempt == 2:
                looked.set()
            return read

        tool: stopline.Tool[Any] = stopline.Tool(
            flaky, name="flaky", description="upload it remotely", settles_within=None
        )
        tool.verify_fn = read_back
        async with worker_for(h, flaky, tools=[tool]):
            handle = await h.start(Plan(["flaky"], maximum_attempts=2, start_to_close=3))
            with anyio.fail_after(30):
                await looked.wait()
            await handle.cancel()
            with anyio.fail_after(30), pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
            receipt = await h.ledger.wait_settled(handle.id, timeout=15)
            status = (await handle.describe()).status
    assert isinstance(failed.value.cause, CancelledError)  # old: the activity's failure
    assert status is WorkflowExecutionStatus.CANCELED
    assert h.provider.effects() == [] and ran == [1]  # nothing sent
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED]


async def test_a_client_cancel_of_a_standalone_activity_is_no_workflows_code(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """A client cancels a standalone activity while its request is with the provider:
    the call is ``unknown`` (never "not sent", R3), and its evidence says a client
    cancelled it (old: "the workflow's code", of an activity that has no workflow)."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        activity_id = f"act-{uuid.uuid4().hex[:8]}"
        hold = h.provider.barriers.hold("received")
        try:
            async with standalone_worker(h):
                handle = await start_standalone(h, activity_id)
                with anyio.fail_after(30):
                    await hold.reached.wait()
                assert handle.run_id is not None
                run_id = activity_run_id(activity_id, handle.run_id)
                await handle.cancel(reason="not needed")
                with anyio.fail_after(30):
                    cut = await _the_cut(h, run_id)
                    with pytest.raises(ActivityFailureError):
                        await handle.result()
        finally:
            hold.release()
    (evidence,) = cut.data["evidence"]
    assert "a client cancelled the activity" in evidence["detail"], evidence
    assert "workflow's code" not in evidence["detail"]
    assert h.provider.effects() == []
