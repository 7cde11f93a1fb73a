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
