"""Two truth gaps of the Temporal integration, on a real Temporal dev server.

- **A cut call's horizon is at least its cut** (R13, ADR 0085 amendment). An activity
  whose tool states no horizon has its attempt's bound as its call's: a read-back that
  finds nothing before it proves nothing. A worker frozen (SIGSTOP) past that bound
  runs its code on when it is thawed, until Temporal's "not found" cuts it: what it
  sent until then may still land. The call's horizon was the bound, already past at
  the cut, and a read-back right after the cut settled "not committed" (old). It is
  now the cut plus the bound: "not yet" until then, and the effect that lands is found.
- **``temporal.cancel`` reaches a fenced child under its run id** (ADR 0085
  amendment). A child whose workflow id is derived (a tab, too long) or whose run is
  its execution's own (``ID@run:EXEC``) was asked to cancel under its run id, which
  Temporal does not know ("not found", taken as done): the child went on while the
  receipt said it was fenced. Its workflow is found among the pending children
  Temporal records for its parent.

Ground truth is the provider's file and Temporal's history; barriers, no sleeps but
where Temporal offers nothing to await (its timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

import stopline
from stopline import OpStatus, RunState
from stopline.domain.model import EventRecord
from stopline.integrations import temporal
from stopline.integrations.temporal import run_id_of
from stopline.integrations.temporal_server import TemporalDevServer
from tests.engines.temporal_harness import Harness, activities, harness, worker_process
from tests.engines.temporal_workflows import Plan
from tests.engines.test_engine_probe2_temporal import _own_server, impatient

BOUND = 4.0  # the activity's start_to_close_timeout: its attempt's bound, in seconds


async def _timed_out(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether Temporal has timed the activity's first attempt out (its history)."""
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            return True
    return False


async def _the_cut(h: Harness, run_id: str) -> EventRecord:
    """The event that recorded the call ``unknown`` (a barrier on the ledger)."""
    while True:
        cuts = [
            e
            for e in await h.ledger.backend.events(run_id)
            if e.op_id and e.to_state == OpStatus.UNKNOWN.value
        ]
        if cuts:
            return cuts[0]
        await h.ledger.wait_for_change(run_id)


async def test_a_call_cut_after_its_attempts_bound_is_not_yet_until_its_cut_plus_the_bound(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """``upload`` (no horizon declared: its attempt's bound, 4 s, is its call's) has its
    request on its way when the worker's process is frozen; Temporal times the attempt
    out, and the process is thawed after the bound. It is cut: ``unknown``, its horizon
    recorded at least the cut (the cut plus the bound; old: none, the bound being past).
    A read-back right after the cut that finds nothing leaves it ``unknown`` ("not yet";
    old: ``not_committed``), the receipt says until when; the request then lands, and
    the read-back finds it: completed, sent once."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        # this process reads back as the worker's does: by key, in the provider's file
        upload = activities(h.provider)[1]
        h.ledger.register_tool(h.provider.tool("upload", upload, "upload it", None))
        child = await worker_process(temporal_server, h, "remote")
        try:
            plan = Plan(["upload"], start_to_close=BOUND, maximum_attempts=1)
            handle = await h.start(plan)
            key = (await child.expect("reached received ")).split(" ", 2)[2]
            on_its_way = time.time()  # after the call's dispatch: its bound is before this
            os.kill(child.proc.pid, signal.SIGSTOP)  # frozen: its code stops, unaware
            try:
                with anyio.fail_after(30):
                    # Temporal offers nothing to await for a timeout, nor time for a bound
                    while not await _timed_out(handle) or time.time() < on_its_way + BOUND:  # noqa: ASYNC110
                        await anyio.sleep(0.1)
            finally:
                os.kill(child.proc.pid, signal.SIGCONT)  # it goes on, past its bound
            with anyio.fail_after(30):
                cut = await _the_cut(h, handle.id)
            op = await h.ledger.backend.get_operation(key)
            # the read-back right after the cut (the worker's process reads back too)
            looked = await h.ledger.verify(key)
            meanwhile = await h.ledger.receipt(handle.id)
            with h.provider.path.open("a") as log:  # the request lands, late
                log.write(json.dumps({"key": key, "payload": "landed"}) + "\n")
            found = await h.ledger.verify(key)
        finally:
            await child.kill()
    assert cut.data.get("cause") == "timeout", cut.data
    assert cut.at > on_its_way + BOUND  # cut after the attempt's bound
    assert op.horizon is not None  # old: none recorded (the bound had passed)
    assert op.horizon > cut.at  # never before the cut as recorded
    assert op.horizon > on_its_way + 2 * BOUND  # the cut (after the bound) plus the bound
    assert looked.status is OpStatus.UNKNOWN  # "not yet" (old: not_committed)
    assert " until " in meanwhile.text()  # R13: and the receipt says until when
    assert "did not happen" not in meanwhile.text()
    assert found.status is OpStatus.COMMITTED  # the late effect, found
    assert h.provider.effects() == [key]  # sent once


def _odd_parent(shape: str) -> str:
    base = uuid.uuid4().hex[:12]
    return {"tab": f"tab\there-{base}", "long": f"{'w' * 960}{base}"}.get(shape, f"wf-{base}")


@pytest.mark.parametrize("shape", ["tab", "long", "reused"])
async def test_temporal_cancel_with_no_worker_reaches_a_child_under_its_run_id(
    temporal_server: TemporalDevServer, tmp_path: Path, shape: str
) -> None:
    """A parent starts an exclusive child (``PARENT-exclusive-0``), both waiting; the
    child's run is derived (its id has a tab, or is too long) or, its id's run having
    completed before, its execution's own (``reused``). With no worker running,
    ``temporal.cancel`` of the parent fences both runs and Temporal's record of the
    child shows its cancel requested (old: asked under its run id, "not found")."""
    async with harness(temporal_server, tmp_path, worker=False) as h:
        parent_id = _odd_parent(shape)
        child_id = f"{parent_id}-exclusive-0"
        worker = await worker_process(temporal_server, h)
        try:
            if shape == "reused":  # the child's id ran before, to completion
                with anyio.fail_after(30):
                    await (await h.start(Plan([]), child_id)).result()
            handle = await h.start(Plan([], children=["exclusive"]), parent_id)
            parent_run = run_id_of(parent_id)
            with anyio.fail_after(30):
                kids = await _children(h, parent_run)
        finally:
            await worker.kill()  # no worker from here: nobody else asks Temporal
        child = h.client.get_workflow_handle(child_id)
        try:
            receipt = await temporal.cancel(
                h.ledger, h.client, parent_id, by="user:42", reason="pressed stop"
            )
            asked = {
                event.event_type
                async for event in child.fetch_history_events()
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
            }
            runs = {r.id: r for r in await h.ledger.backend.list_runs()}
        finally:
            for held in (handle, child):
                with contextlib.suppress(RPCError):
                    await held.terminate(reason="the test is over")
    (kid,) = kids  # the child's run: not its workflow id
    if shape == "reused":
        assert kid.startswith(f"{child_id}@run:")
    else:
        assert "#sha256:" in kid
    assert receipt.run_id == parent_run
    assert runs[kid].state is RunState.CANCELLED  # fenced
    assert asked == {EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED}  # old: not asked


async def test_temporal_cancel_with_the_service_down_fences_the_child_then_raises(
    tmp_path: Path,
) -> None:
    """The parent (an id with a tab) and its exclusive child wait; the Temporal service is
    killed. ``temporal.cancel`` from a process with no worker fences both runs (the stop
    is recorded), then raises Temporal's own error from the look-up of the child's
    workflow (its cancel was not requested); nothing hangs."""
    async with _own_server(tmp_path) as server:
        async with harness(server.dev, tmp_path, client=await impatient(server)) as h:
            parent_id = _odd_parent("tab")
            await h.start(Plan([], children=["exclusive"]), parent_id)
            with anyio.fail_after(30):
                (kid,) = await _children(h, run_id_of(parent_id))
        await server.kill()
        async with stopline.open(h.ledger_url) as elsewhere:
            with anyio.fail_after(60), pytest.raises(RPCError) as raised:
                await temporal.cancel(elsewhere, h.client, parent_id, by="user:42")
            runs = {r.id: r for r in await elsewhere.backend.list_runs()}
    assert raised.value.status is RPCStatusCode.UNAVAILABLE
    assert runs[run_id_of(parent_id)].state is RunState.CANCELLED
    assert runs[kid].state is RunState.CANCELLED
    assert h.provider.effects() == []


async def _children(h: Harness, run_id: str) -> list[str]:
    """The child runs of ``run_id``, once there is one (a barrier on the ledger)."""
    while True:
        kids = [r.id for r in await h.ledger.backend.list_runs() if r.parent_id == run_id]
        if kids:
            return kids
        await h.ledger.wait_for_change(run_id)
