"""What the engines probe found (issue: F3, F5), on a real Temporal dev server.

F3 (R13): a cut activity whose request already reached a remote provider is not
"did not happen" while Temporal may still be waiting for its attempt: a tool
that declares no ``settles_within`` has the activity's own timeout as its
horizon. F5: a workflow Temporal terminates runs none of its code again; the
worker that held its activity fences the run, so the run settles (by
"temporal", "terminated"); with no activity running, the documented
``ledger.cancel`` settles it. Barriers and events, no sleeps.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import anyio
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import Worker

import stopline
from stopline import Headline, OpStatus, ReadBack, RunState, Verdict
from stopline.domain.model import OperationRecord
from stopline.integrations.temporal import StoplinePlugin, call_context
from stopline.integrations.temporal_server import TemporalDevServer
from stopline.runtime.context import CallContext
from tests.conftest import FAST_VERIFY
from tests.engines.temporal_harness import harness
from tests.engines.temporal_workflows import Pipeline, Plan


class RemoteSide:
    """A provider on the far side of a connection: a request it has received lands
    when the test says (``lands``), whatever became of the activity that sent it."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.stored: list[str] = []  # the ground truth: what really happened
        self.on_wire = anyio.Event()
        self.second_look = anyio.Event()  # a read-back looked again after "not found"
        self.answer_it = anyio.Event()
        self.reads = 0

    def lands(self) -> None:
        self.stored.extend(self.received)

    async def upload(self, payload: str) -> str:
        self.received.append(call_context().key)
        self.on_wire.set()
        await anyio.Event().wait()  # the response never comes back before the cut
        return "stored"  # pragma: no cover - cut

    async def read_back(self, ctx: CallContext) -> ReadBack:
        """Reads only. Its second look waits for the test (which checks the receipt in
        between): a first "not found" settles nothing before the horizon."""
        self.reads += 1
        if self.reads == 2:
            self.second_look.set()
            await self.answer_it.wait()
        found = ctx.key in self.stored
        verdict = Verdict.COMMITTED if found else Verdict.NOT_COMMITTED
        return ReadBack(verdict, f"remote:{ctx.key}", "found" if found else "not found")


@dataclasses.dataclass
class CutOnTheWire:
    """What ``cut_on_the_wire`` saw: the receipt after the first "not found", the
    operation then, the settled receipt, and the remote side's truth."""

    meanwhile: stopline.Receipt
    op: OperationRecord
    receipt: stopline.Receipt
    remote: RemoteSide


async def cut_on_the_wire(
    server: TemporalDevServer, tmp_path: Path, settles_within: float | None = None
) -> CutOnTheWire:
    """``upload`` (TRY_CANCEL, a verifier) is cut by stopline's cancel after its request
    reached the remote side; the read-back finds nothing, and must not settle the run;
    then the effect lands and the read-back finds it."""
    remote = RemoteSide()

    @activity.defn(name="upload")
    async def upload(payload: str) -> str:
        return await remote.upload(payload)

    tool: stopline.Tool[Any] = stopline.Tool(
        upload, name="upload", description="upload it", settles_within=settles_within
    )
    tool.verifier(remote.read_back)
    client = await Client.connect(server.address, namespace=server.namespace)
    queue = f"q-{uuid.uuid4().hex[:12]}"
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with stopline.open(url, verify=FAST_VERIFY) as ledger:
        plugin = StoplinePlugin(ledger, tools=[tool], owner="user:42")
        async with Worker(
            client, task_queue=queue, workflows=[Pipeline], activities=[upload], plugins=[plugin]
        ):
            handle = await client.start_workflow(
                Pipeline.run, Plan(["upload"]), id=f"wf-{uuid.uuid4().hex[:12]}", task_queue=queue
            )
            await remote.on_wire.wait()
            await ledger.cancel(handle.id, by="user:42", reason="pressed stop")
            settled_first: list[stopline.Receipt] = []
            async with anyio.create_task_group() as tg:

                async def settles() -> None:
                    settled_first.append(await ledger.wait_settled(handle.id, timeout=20))
                    tg.cancel_scope.cancel()

                tg.start_soon(settles)
                await remote.second_look.wait()
                tg.cancel_scope.cancel()
            assert settled_first == [], settled_first[0].text()  # old: "did not happen"
            meanwhile = await ledger.receipt(handle.id)
            (op,) = await ledger.backend.operations(handle.id)
            remote.lands()
            remote.answer_it.set()
            receipt = await ledger.wait_settled(handle.id, timeout=20)
    return CutOnTheWire(meanwhile, op, receipt, remote)


async def test_f3_r13_a_cut_activity_is_not_yet_until_its_timeout_then_read_back(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """TRY_CANCEL (the default), a verifier and no ``settles_within``: stopline's cancel
    cuts the activity after its request reached the remote side. A read-back that finds
    nothing is "not yet" (the activity's ``start_to_close_timeout`` is its horizon): the
    receipt says verifying, until when, offers nothing to send again; the effect then
    lands, and the read-back finds it: completed, kept, sent once."""
    cut = await cut_on_the_wire(temporal_server, tmp_path)
    meanwhile, receipt, remote = cut.meanwhile, cut.receipt, cut.remote
    assert meanwhile.headline is Headline.VERIFYING
    assert [line.status for line in meanwhile.lines] == [OpStatus.UNKNOWN]
    assert " until " in meanwhile.text()  # R13: and the receipt says until when
    assert "did not happen" not in meanwhile.text()
    assert remote.stored == remote.received  # one request, landed once
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS


async def test_f5_a_terminate_during_an_activity_fences_the_run_and_it_settles(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """Temporal terminates the workflow while ``upload`` has committed and not answered:
    the worker's next heartbeat learns Temporal no longer knows the activity, finds the
    workflow terminated and fences its run (by "temporal", "terminated"). The run settles:
    the upload read back and kept, ``notify`` never sent."""
    async with harness(temporal_server, tmp_path) as h:
        hold = h.provider.barriers.hold("committed")
        handle = await h.start(Plan(["upload", "notify"]))
        await hold.reached.wait()
        await handle.terminate(reason="ops terminated it")
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
        status = (await handle.describe()).status
    assert status is WorkflowExecutionStatus.TERMINATED
    assert h.provider.effects() == [hold.key]
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert (receipt.cancelled_by, receipt.cancel_reason) == ("temporal", "terminated")
    assert "the workflow's code" not in receipt.text()  # the cut is not told as its own cancel


async def test_f5_a_terminate_with_no_activity_running_is_settled_by_ledger_cancel(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    """No activity runs (the workflow waits for a signal): no worker hears of the
    terminate. What docs/engines/temporal.md says to do, ``ledger.cancel`` of the
    workflow's run, settles it truthfully: nothing was sent, and it is cancelled."""
    async with harness(temporal_server, tmp_path) as h:
        handle = await h.start(Plan(["upload"], wait_for_go=True))
        while not await h.ledger.backend.list_runs(limit=10):  # the workflow opened its run
            await h.ledger.wait_for_change(handle.id)
        await handle.terminate(reason="ops terminated it")
        await h.ledger.cancel(handle.id, by="user:42", reason="terminated in Temporal")
        receipt = await h.ledger.wait_settled(handle.id, timeout=15)
    assert h.provider.effects() == []
    assert receipt.lines == ()
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert (receipt.cancelled_by, receipt.cancel_reason) == ("user:42", "terminated in Temporal")
