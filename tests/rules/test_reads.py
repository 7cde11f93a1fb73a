"""R11 on reads: ``ledger.reads`` answers a run another tenant may not see as unknown."""

from __future__ import annotations

import pytest

import stopline
from stopline import OpStatus, Principal
from stopline.testing import FakeProvider

OUTSIDER = Principal("user:9", tenant="other")
COLLEAGUE = Principal("user:7", tenant="acme")


async def test_r11_reads_hide_a_run_from_another_tenant(ledger: stopline.Ledger) -> None:
    send = FakeProvider("send")
    async with ledger.run("refund", owner="user:1", tenant="acme") as run:
        await run.call(send.tool, "hello")
    op_id = (await ledger.reads.operations(run.id))[0].id

    # the same tenant (and this process itself, without ``by``) reads everything
    assert (await ledger.reads.run(run.id, by=COLLEAGUE)).id == run.id
    ops = await ledger.reads.operations(run.id, by=COLLEAGUE)
    assert [op.status for op in ops] == [OpStatus.COMMITTED]
    assert (await ledger.reads.operation(op_id, by=COLLEAGUE)).run_id == run.id
    events = await ledger.reads.events(run.id, by=COLLEAGUE)
    assert events[0].kind == "run_created"
    assert run.id in {r.id for r in await ledger.reads.runs(by=COLLEAGUE)}

    # another tenant is told the run does not exist, by every read
    with pytest.raises(stopline.UnknownRun):
        await ledger.reads.run(run.id, by=OUTSIDER)
    with pytest.raises(stopline.UnknownRun):
        await ledger.reads.operations(run.id, by=OUTSIDER)
    with pytest.raises(stopline.UnknownRun):
        await ledger.reads.events(run.id, by=OUTSIDER)
    with pytest.raises(stopline.UnknownOperation):
        await ledger.reads.operation(op_id, by=OUTSIDER)
    assert run.id not in {r.id for r in await ledger.reads.runs(by=OUTSIDER)}
    assert await ledger.reads.trees([run.id], by=OUTSIDER) == {}
    assert await ledger.receipts([run.id], by=OUTSIDER) == {}
    assert list(await ledger.receipts([run.id], by=COLLEAGUE)) == [run.id]


async def test_receipts_of_a_page_are_each_runs_receipt(ledger: stopline.Ledger) -> None:
    """``ledger.receipts`` (a page of runs, read at once): each run's receipt as
    ``receipt`` builds it, a parent's with its child's operations; an unknown run is
    left out; an id that cannot be one is refused, naming it, before anything is read."""
    send = FakeProvider("send")
    async with ledger.run("parent", owner="user:1", tenant="acme") as parent:
        await parent.call(send.tool, "one")
        async with parent.child("child") as child:
            await child.call(send.tool, "two")
    async with ledger.run("alone", owner="user:1", tenant="acme") as alone:
        await alone.call(send.tool, "three")
    asked = [alone.id, "run_nothing", parent.id, child.id]
    found = await ledger.receipts(asked)
    assert list(found) == [alone.id, parent.id, child.id]
    for run_id, receipt in found.items():
        assert receipt == await ledger.receipt(run_id)
    assert len(found[parent.id].lines) == 2 and len(found[child.id].lines) == 1
    with pytest.raises(stopline.InvalidInput, match="run_id"):
        await ledger.receipts([alone.id, "x" * 10_000])
    with pytest.raises(stopline.InvalidInput, match="run_ids"):
        await ledger.receipts(alone.id)
