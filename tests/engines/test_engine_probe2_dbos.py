"""What the second engines probe found on a real DBOS (P2): a step whose provider may
commit after the step was cut declares ``settles_within`` (R13), and a read-back that
finds nothing before then proves nothing. ``gate.step`` took no horizon: a DBOS cancel
that preempted a step whose request was already at a remote service read it back at
once, found nothing, and the receipt said "Canceled before external action." while
the request could still land. Ground truth on the remote side; barriers, no sleeps."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from dbos import DBOS, SetWorkflowID

from stopline import Headline, InvalidInput, OpStatus, ReadBack
from stopline.integrations.dbos import StoplineDBOS
from stopline.runtime.context import CallContext
from tests.engines import dbos_app
from tests.engines.dbos_harness import harness
from tests.engines.test_temporal_horizon import RemoteSide

_remote: list[RemoteSide] = []


async def _read_back(ctx: CallContext) -> ReadBack:
    return await _remote[0].read_back(ctx)


@DBOS.step(preemptible=True)  # DBOS's cancel cuts it
@dbos_app.gate.step(description="upload it", verify=_read_back, settles_within=600)
async def remote_upload(payload: str) -> str:
    return await _remote[0].upload(payload)


@DBOS.workflow()
@dbos_app.gate.workflow()
async def remote_flow() -> str:
    return await remote_upload("the report")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_p2_r13_a_cut_step_is_verifying_until_its_declared_horizon(
    backend: str, tmp_path: Path
) -> None:
    """``DBOS.cancel_workflow`` preempts the step after its request reached the remote
    side. The read-back finds nothing: "not yet" (the step's ``settles_within``), the
    receipt says verifying until when and offers nothing to send again; the effect
    then lands, and the read-back finds it: completed, kept, sent once."""
    remote = RemoteSide()
    _remote[:] = [remote]
    async with harness(backend, tmp_path) as h:
        workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(remote_flow)
        await remote.on_wire.wait()
        await DBOS.cancel_workflow_async(workflow_id)
        with pytest.raises(BaseException, match="cancelled"):  # DBOS: awaited, cancelled
            await handle.get_result()
        await remote.second_look.wait()  # read back once: "not found" (not yet)
        meanwhile = await h.ledger.receipt(workflow_id)
        remote.lands()
        remote.answer_it.set()
        receipt = await h.ledger.wait_settled(workflow_id, timeout=20)
    assert meanwhile.headline is Headline.VERIFYING  # old: canceled before external action
    assert [line.status for line in meanwhile.lines] == [OpStatus.UNKNOWN]
    assert " until " in meanwhile.text()
    assert "did not happen" not in meanwhile.text()
    assert remote.stored == remote.received  # one request, landed once
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10"])
def test_p2_a_step_horizon_that_is_no_number_of_seconds_is_refused(bad: object) -> None:
    with pytest.raises(InvalidInput, match="settles_within"):
        StoplineDBOS().step(settles_within=bad)  # type: ignore[arg-type]
