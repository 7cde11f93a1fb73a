"""What settles an operation in review (ADR 0052), on a real ledger.

A read-back settles an item in review only when it went there for want of an
answer; a contradiction, or a failed correction of a proven commit, waits for a
reviewer whatever a later read finds. Evidence that a corrected action never
happened goes to review as it does for a committed one, the correction kept on
record. A cancelled run's ``compensation=always`` applies to an outcome a
reviewer or later evidence settles as committed, as to one a read-back proved.
"""

from __future__ import annotations

from typing import Any

import pytest

import stopline
from stopline import Cancellable, Headline, OpStatus, RunState, Verdict, errors
from stopline.runtime.tool import Compensation
from stopline.testing import FakeProvider
from tests.truth.helpers import Remote, quiesce

pytestmark = pytest.mark.timeout(60)


class Psp:
    """A payment provider whose answers get lost and whose search index answers what it
    is told to (it lags behind its own records)."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # every payment that reached it
        self.search: dict[str, Verdict] = {}  # what a read-back by key finds now
        self.tool: stopline.Tool[Any] = stopline.Tool(self._pay, name="pay")
        self.tool.wants_context = True
        self.tool.verify_fn = self._find

    async def _pay(self, ctx: stopline.CallContext, amount: int) -> str:
        self.sent.append(ctx.key)
        raise ConnectionResetError("connection dropped before the response")

    async def _find(self, ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(self.search.get(ctx.key, Verdict.NOT_COMMITTED), ref=ctx.key)


async def _lost(ledger: stopline.Ledger, psp: Psp, run_id: str, key: str) -> str:
    """A run whose one payment lost its answer, then cancelled and settled."""
    async with ledger.run("pay", owner="user:1", run_id=run_id) as run:
        with pytest.raises(ConnectionResetError):
            await run.call(psp.tool, 25, key=key)
        await ledger.cancel(run.id, by="user:1")
    await ledger.wait_settled(run_id, timeout=30)
    return f"{run_id}/{key}"


async def test_a_read_back_settles_a_review_only_when_it_went_there_for_want_of_an_answer(
    ledger: stopline.Ledger,
) -> None:
    """p24: a read-back found nothing (past the horizon), then the provider's own late
    answer said it committed: a contradiction, in review. One more lagging read-back
    recorded "did not happen" over the provider's receipt, and a resume sent the
    payment again. Now it stays for a reviewer; an item in review because no read-back
    could answer is still settled by the first one that does."""
    psp = Psp()
    op_id = await _lost(ledger, psp, "r-conflict", "pay")
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NOT_COMMITTED
    late = await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-991", result="paid")
    assert late.status is OpStatus.NEEDS_REVIEW
    await quiesce(ledger)  # the run goes back to review with it (ADR 0093)
    events_before = len(await ledger.backend.events("r-conflict"))

    op = await ledger.verify(op_id)  # the search index still finds nothing

    assert op.status is OpStatus.NEEDS_REVIEW
    assert len(await ledger.backend.events("r-conflict")) == events_before  # nothing recorded
    receipt = await ledger.receipt("r-conflict")
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert receipt.resume_rule.startswith("a reviewer decides 1 operation in review")
    with pytest.raises(stopline.RunEnded, match="resolve its review items"):
        await ledger.resume("r-conflict", by="user:1")  # in review with it (ADR 0093)
    assert psp.sent == [op_id]  # sent once, never again

    # the other kind of review item: the read-back budget was spent without an answer
    psp.search["r-unanswered/unanswered"] = Verdict.UNKNOWN
    waiting = await _lost(ledger, psp, "r-unanswered", "unanswered")
    assert (await ledger.backend.get_operation(waiting)).status is OpStatus.NEEDS_REVIEW
    psp.search[waiting] = Verdict.COMMITTED  # the destination can answer now
    assert (await ledger.verify(waiting)).status is OpStatus.COMMITTED


async def test_a_read_back_does_not_settle_a_failed_correction(ledger: stopline.Ledger) -> None:
    """The correction of a proven commit failed: the item asks what to do now, which no
    read of the original answers. A read-back left it ``committed`` (or, finding nothing,
    ``not_committed`` against the proof), out of the queue."""
    remote = Remote(refuse_correction=True)
    remote.let_correct.set()
    async with ledger.run("trip", owner="user:1", run_id="r-failed") as run:
        await run.call(remote.tool, "room 12", key="book")
    op_id = "r-failed/book"
    await ledger.compensate(op_id, by="user:1")
    await quiesce(ledger)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW

    op = await ledger.verify(op_id)  # the booking is there: it agrees with the commit

    assert op.status is OpStatus.NEEDS_REVIEW
    assert [item.op.id for item in await ledger.review_items()] == [op_id]


async def _corrected_then_contradicted(ledger: stopline.Ledger, run_id: str) -> tuple[str, Remote]:
    """A cancelled run whose one booking was corrected (``compensation=always``), then
    the provider's late answer says it never happened: (its op id, the remote)."""
    remote = Remote(compensation=Compensation.ALWAYS)
    remote.let_correct.set()
    async with ledger.run("trip", owner="user:1", run_id=run_id) as run:
        await run.call(remote.tool, "room 12", key="book")
        await ledger.cancel(run.id, by="user:1")
    assert (await ledger.wait_settled(run_id, timeout=30)).headline is Headline.CORRECTED
    op_id = f"{run_id}/book"
    detail = "card declined, never charged"
    await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="psp-declined", detail=detail)
    await quiesce(ledger)  # the run goes back to review with it (ADR 0093)
    return op_id, remote


async def test_evidence_that_a_corrected_action_never_happened_goes_to_review(
    ledger: stopline.Ledger,
) -> None:
    """p06: the late "never happened" was kept as a note and the receipt still said "it
    was corrected", settled, nothing in the queue; on a plain committed operation the
    same answer goes to review. The correction of an action that never happened is an
    effect a person must look at; its own record stays."""
    op_id, remote = await _corrected_then_contradicted(ledger, "r-corrected")

    receipt = await ledger.receipt("r-corrected")
    assert receipt.headline is Headline.NEEDS_REVIEW
    original, correction = receipt.lines
    assert original.status is OpStatus.NEEDS_REVIEW
    assert (correction.op_id, correction.status) == (f"{op_id}~compensate", OpStatus.COMMITTED)
    assert [item.op.id for item in await ledger.review_items()] == [op_id]
    assert remote.sent == [op_id, f"{op_id}~compensate"]  # nothing new was sent


async def test_a_reviewer_who_finds_a_corrected_action_happened_leaves_it_corrected(
    ledger: stopline.Ledger,
) -> None:
    op_id, remote = await _corrected_then_contradicted(ledger, "r-happened")

    receipt = await ledger.resolve_review(op_id, "committed", by="user:1", note="it was charged")
    await quiesce(ledger)

    assert receipt.lines[0].status is OpStatus.COMPENSATED
    assert (await ledger.receipt("r-happened")).headline is Headline.CORRECTED
    assert list(remote.corrected) == [f"{op_id}~compensate"]  # not corrected a second time
    assert await ledger.review_items() == []


async def test_a_reviewer_who_finds_a_corrected_action_never_happened_keeps_the_correction(
    ledger: stopline.Ledger,
) -> None:
    """R8: the correction ran, so the run did something; its headline never says it was
    cancelled before any external action."""
    op_id, _ = await _corrected_then_contradicted(ledger, "r-never")

    receipt = await ledger.resolve_review(op_id, "not_committed", by="user:1")

    original, correction = receipt.lines
    assert original.status is OpStatus.NOT_COMMITTED
    assert correction.status is OpStatus.COMMITTED
    assert "did not happen" in correction.recovery
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.message == "Stopped. 1 action had already completed and was kept."


async def test_a_corrected_action_in_review_is_not_corrected_twice(
    ledger: stopline.Ledger,
) -> None:
    op_id, remote = await _corrected_then_contradicted(ledger, "r-twice")
    events_before = len(await ledger.backend.events("r-twice"))

    with pytest.raises(errors.NotCorrectable, match="corrected already"):
        await ledger.resolve_review(op_id, "compensate", by="user:1")

    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    assert len(await ledger.backend.events("r-twice")) == events_before
    assert list(remote.corrected) == [f"{op_id}~compensate"]


async def test_a_contradiction_during_a_correction_waits_for_its_outcome(
    ledger: stopline.Ledger,
) -> None:
    """ "Never happened" arrives while the correction runs: the item goes to review at
    once, the correction's outcome does not take it out, and a reviewer decides once
    that outcome is in."""
    remote = Remote()
    async with ledger.run("trip", owner="user:1", run_id="r-during") as run:
        await run.call(remote.tool, "room 12", key="book")
    op_id = "r-during/book"
    await ledger.compensate(op_id, by="user:1", wait=False)
    await remote.correcting.wait()
    late = await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="psp-declined")
    assert late.status is OpStatus.NEEDS_REVIEW
    with pytest.raises(stopline.NotPermitted, match="has an outcome"):
        await ledger.resolve_review(op_id, "committed", by="user:1")
    remote.let_correct.set()
    await quiesce(ledger)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    correction = await ledger.backend.get_operation(f"{op_id}~compensate")
    assert correction.status is OpStatus.COMMITTED
    receipt = await ledger.resolve_review(op_id, "committed", by="user:1")
    assert receipt.lines[0].status is OpStatus.COMPENSATED


def _booking_nobody_can_read() -> FakeProvider:
    """Commits, loses its answer, has no read-back, corrects with ``always``."""
    book = FakeProvider(
        "book",
        cancellable=Cancellable.NEVER,
        verifiable=False,
        drop_response=True,
        compensable=True,
    )
    book.tool.compensation = Compensation.ALWAYS
    return book


async def _in_review(ledger: stopline.Ledger, book: FakeProvider, run_id: str) -> str:
    async with ledger.run("trip", owner="user:1", run_id=run_id) as run:
        with pytest.raises(ConnectionResetError):
            await run.call(book.tool, "room 12", key="book")
        await ledger.cancel(run.id, by="user:1")
    receipt = await ledger.wait_settled(run_id, timeout=30)
    assert receipt.run_state is RunState.NEEDS_REVIEW
    return f"{run_id}/book"


async def test_compensation_always_applies_when_a_reviewer_finds_it_happened(
    ledger: stopline.Ledger,
) -> None:
    """p23: with a read-back proving the commit the booking was corrected; with a
    reviewer deciding the same, it was kept."""
    book = _booking_nobody_can_read()
    op_id = await _in_review(ledger, book, "r-always-review")

    await ledger.resolve_review(op_id, "committed", by="user:1", note="the hotel has it")
    receipt = await ledger.wait_settled("r-always-review", timeout=30)

    assert receipt.headline is Headline.CORRECTED
    assert receipt.run_state is RunState.CANCELLED
    assert book.compensated == [op_id]


async def test_compensation_always_applies_when_late_evidence_settles_a_review(
    ledger: stopline.Ledger,
) -> None:
    book = _booking_nobody_can_read()
    op_id = await _in_review(ledger, book, "r-always-late")

    await ledger.late_response(op_id, Verdict.COMMITTED, ref="hotel-1")
    receipt = await ledger.wait_settled("r-always-late", timeout=30)

    assert receipt.headline is Headline.CORRECTED
    assert book.compensated == [op_id]


@pytest.mark.parametrize("verdict", [Verdict.COMMITTED, Verdict.NOT_COMMITTED])
async def test_a_late_answer_does_not_settle_a_dispute_a_reviewer_holds(
    ledger: stopline.Ledger, verdict: Verdict
) -> None:
    """A provider's late answer settled any item in review, a contradicted one too: a
    redelivered webhook repeating one side of the dispute decided it. It is kept as
    evidence for the reviewer, and the item stays in review."""
    psp = Psp()
    op_id = await _lost(ledger, psp, "r-dispute", "pay")
    late = await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-991", result="paid")
    assert late.status is OpStatus.NEEDS_REVIEW  # the dispute: read-back vs the provider

    again = await ledger.late_response(op_id, verdict, ref="psp-991", detail="redelivered")

    assert again.status is OpStatus.NEEDS_REVIEW
    kept = [e for e in await ledger.backend.events("r-dispute") if e.kind == "late_response"]
    assert kept and "redelivered" in str(kept[-1].data)
