"""R11 on reads: ``ledger.reads`` answers a run another tenant may not see as unknown."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import stopline
from stopline import EvidenceKind, Headline, OpStatus, Principal, RunState
from stopline.domain.model import Evidence, LazyEvidence
from stopline.domain.receipt import build_receipt
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


async def _parent_and_child(
    ledger: stopline.Ledger, send: FakeProvider
) -> tuple[stopline.Run, stopline.Run]:
    """A run of tenant acme with one call, and its child with one call of its own."""
    async with ledger.run("parent", owner="user:1", tenant="acme") as parent:
        await parent.call(send.tool, "one")
        async with parent.child("child") as child:
            await child.call(send.tool, "two")
    return parent, child


async def test_receipts_of_a_page_are_each_runs_receipt(ledger: stopline.Ledger) -> None:
    """``ledger.receipts`` (a page of runs, read at once): each run's receipt as
    ``receipt`` builds it, a parent's with its child's operations; an unknown run is
    left out; an id that cannot be one is refused, naming it, before anything is read."""
    send = FakeProvider("send")
    parent, child = await _parent_and_child(ledger, send)
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


async def test_runs_with_receipts_are_the_listing_each_with_its_receipt(
    ledger: stopline.Ledger,
) -> None:
    """``ledger.runs_with_receipts`` (the console's page, ``stopline runs``): the runs
    ``reads.runs`` lists with the same filters, newest first, each beside the receipt
    ``receipt`` builds for it (a parent's with its child's operations), the run's row
    from the same read (its state is the receipt's); R11 leaves out what ``by`` may not
    see. A bad filter is refused before anything is read."""
    send = FakeProvider("send")
    parent, child = await _parent_and_child(ledger, send)
    async with ledger.run("other", owner="user:2", tenant="beta") as other:
        await other.call(send.tool, "three")
    async with ledger.run("held", owner="user:1", tenant="acme") as held:
        await held.call(send.tool, "four")
        await ledger.cancel(held.id, by=Principal("user:1", tenant="acme"))
        await ledger.wait_settled(held.id)
        await ledger.wait_idle()  # nothing moves under the comparisons
        for state, owner, limit in ((None, None, 100), (None, "user:1", 100), (None, None, 2)):
            listed = await ledger.reads.runs(state=state, owner=owner, limit=limit)
            found = await ledger.runs_with_receipts(state=state, owner=owner, limit=limit)
            assert [run for run, _ in found] == listed
            for run, receipt in found:
                assert receipt == await ledger.receipt(run.id)
                assert receipt.run_state is run.state
        cancelled = await ledger.runs_with_receipts(state=stopline.RunState.CANCELLED)
        assert [run.id for run, _ in cancelled] == [held.id]
    everything = await ledger.runs_with_receipts()
    assert [run.id for run, _ in everything] == [held.id, other.id, child.id, parent.id]
    assert [len(r.lines) for _, r in everything] == [1, 1, 1, 2]
    seen = await ledger.runs_with_receipts(by=COLLEAGUE)
    assert [run.id for run, _ in seen] == [held.id, child.id, parent.id]
    assert await ledger.runs_with_receipts(by=OUTSIDER) == []


async def test_a_bad_limit_is_refused_naming_it_before_anything_is_read(
    ledger: stopline.Ledger,
) -> None:
    """A listing's ``limit`` is a number of rows, 0 or more: a negative one (SQLite reads
    it as no limit: the whole ledger for a page), one past 64 bits, a string or a bool
    is ``InvalidInput`` naming it, never a storage error; 0 reads nothing, the largest
    reads everything. A state is a member or its word,
    an owner an id; anything else is refused the same way."""
    async with ledger.run("job", owner="user:1") as run:
        pass
    reads: tuple[Callable[..., Awaitable[list[Any]]], ...] = (
        ledger.reads.runs,
        ledger.runs_with_receipts,
        ledger.review_items,
    )
    for read in reads:
        for bad in (-1, "10", True, 2.5, 2**63):  # 2**63: OverflowError, "out of range"
            with pytest.raises(stopline.InvalidInput, match="limit"):
                await read(limit=bad)
        assert await read(limit=0) == []
        assert len(await read(limit=2**63 - 1)) == (read != ledger.review_items)
        if read != ledger.review_items:
            with pytest.raises(stopline.InvalidInput, match="state"):
                await read(state="finished")
            with pytest.raises(stopline.InvalidInput, match="owner"):
                await read(owner=5)
            with pytest.raises(stopline.InvalidInput, match="owner"):
                await read(owner="u" * 5_000)
            assert len(await read(state="completed")) == len(await read(state=RunState.COMPLETED))
    assert [r.id for r in await ledger.reads.runs(limit=1)] == [run.id]


async def test_a_receipts_evidence_is_decoded_only_when_read(
    ledger: stopline.Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receipt's lines keep each operation's evidence as read (``LazyEvidence``): its
    headline, message and whether it is settled (a page, ``wait_settled``) decode none
    of it. A line read for its evidence decodes that operation's alone, and the receipt
    is equal to, and hashes as, one built from the same records with the evidence
    decoded first. Counted, not timed."""
    send = FakeProvider("send")
    async with ledger.run("job", owner="user:1") as run:
        for n in range(3):
            await run.call(send.tool, n)
    decoded: list[str] = []
    real = LazyEvidence._decoded

    def counted(self: LazyEvidence) -> tuple[Evidence, ...]:
        decoded.append(self._raw)
        return real(self)

    monkeypatch.setattr(LazyEvidence, "_decoded", counted)
    receipt = await ledger.receipt(run.id)
    [(_, listed)] = await ledger.runs_with_receipts()
    assert (receipt.headline, receipt.settled, listed.message) == (
        Headline.COMPLETED,
        True,
        receipt.message,
    )
    assert decoded == []
    assert receipt.lines[1].evidence[0].kind is EvidenceKind.LOCAL
    assert len(decoded) == 1
    found, ops = await ledger.reads.run_and_operations(run.id)
    eager = build_receipt(
        found, [dataclasses.replace(op, evidence=tuple(op.evidence)) for op in ops]
    )
    assert all(isinstance(line.evidence, tuple) for line in eager.lines)
    assert eager == receipt == listed
    assert hash(eager) == hash(receipt)
    assert receipt.text() == eager.text() and receipt.to_json() == eager.to_json()
