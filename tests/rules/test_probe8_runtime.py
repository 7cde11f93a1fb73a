"""Probe 8: a run's state after its operations' truth moves on, on a real ledger
(SQLite and PostgreSQL).

A run that settled ``cancelled`` kept that state when later evidence contradicted an
operation's recorded outcome (a late response, a read-back): the operation went to
review, the run stayed ``cancelled``, so ``runs --state needs_review`` did not list it
and the run's state said "settled" while a human had something to decide. It goes to
review now, and back to ``cancelled`` once the review is decided (ADR 0093). A run
that ended on its own keeps ``completed`` / ``failed``: that is what its workflow did;
the receipt's headline says review (R8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest

import stopline
from stopline import Cancellable, Headline, OpStatus, RunState, Verdict
from stopline.domain.model import CancelState, Evidence, OperationRecord
from stopline.domain.receipt import headline_for
from stopline.domain.vocab import EvidenceKind, OpEvent
from stopline.ledger.backend import OutcomeUpdate
from stopline.runtime.tool import Compensation
from stopline.testing import CancelBehaviour, FakeProvider
from tests.conftest import FAST_VERIFY
from tests.domain.test_receipt import op, run_record
from tests.rules.test_probe7_tree_settle import (
    CHILD,
    GRANDCHILD,
    ROOT,
    Held,
    _cancelled_tree,
    _until,
)
from tests.scenarios.workflows import calls, start
from tests.truth.helpers import Remote, quiesce

pytestmark = pytest.mark.timeout(60)

GUARD = 30  # seconds: a hang guard, not a timing


class Psp:
    """A payment provider whose answers get lost (``drops``) or arrive, and whose
    search index answers what it is told to."""

    def __init__(self, *, drops: bool = True) -> None:
        self.drops = drops
        self.sent: list[str] = []
        self.search: dict[str, Verdict] = {}
        self.tool: stopline.Tool[Any] = stopline.Tool(self._pay, name="pay")
        self.tool.wants_context = True
        self.tool.verify_fn = self._find

    async def _pay(self, ctx: stopline.CallContext, amount: int) -> str:
        self.sent.append(ctx.key)
        if self.drops:
            raise ConnectionResetError("connection dropped before the response")
        return f"paid {amount}"

    async def _find(self, ctx: stopline.CallContext) -> stopline.ReadBack:
        return stopline.ReadBack(self.search.get(ctx.key, Verdict.NOT_COMMITTED), ref=ctx.key)


async def _state(ledger: stopline.Ledger, run_id: str) -> RunState:
    return (await ledger.backend.get_run(run_id)).state


async def _cancelled_lost(ledger: stopline.Ledger, psp: Psp, run_id: str) -> str:
    """A run whose one payment lost its answer, cancelled, read back as never made:
    settled ``cancelled``."""
    async with ledger.run("pay", owner="user:1", run_id=run_id) as run:
        with pytest.raises(ConnectionResetError):
            await run.call(psp.tool, 25, key="pay")
        await ledger.cancel(run.id, by="user:1")
    receipt = await ledger.wait_settled(run_id, timeout=GUARD)
    op_id = f"{run_id}/pay"
    assert receipt.run_state is RunState.CANCELLED
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NOT_COMMITTED
    return op_id


async def _in_review(ledger: stopline.Ledger) -> list[str]:
    return [run.id for run, _ in await ledger.runs_with_receipts(state=RunState.NEEDS_REVIEW)]


async def test_a_late_contradiction_sends_a_settled_cancelled_run_to_review(
    ledger: stopline.Ledger,
) -> None:
    """A late response says the payment went through after a read-back said it did not:
    the payment is in review, and so is its run (it said ``cancelled``, settled, and
    ``runs --state needs_review`` left it out). The reviewer's decision settles it
    ``cancelled`` again, the payment kept as completed."""
    psp = Psp()
    op_id = await _cancelled_lost(ledger, psp, "late-yes")

    late = await ledger.late_response(op_id, Verdict.COMMITTED, ref="psp-1", result="paid")
    await quiesce(ledger)

    assert late.status is OpStatus.NEEDS_REVIEW
    assert await _state(ledger, "late-yes") is RunState.NEEDS_REVIEW
    receipt = await ledger.receipt("late-yes")
    assert (receipt.run_state, receipt.headline) == (RunState.NEEDS_REVIEW, Headline.NEEDS_REVIEW)
    assert receipt.settled  # a reviewer, not time, changes it
    assert await _in_review(ledger) == ["late-yes"]
    with pytest.raises(stopline.RunEnded, match="resolve its review items"):
        await ledger.resume("late-yes", by="user:1")  # R10: nothing resumes over a doubt
    kinds = [e.kind for e in await ledger.backend.events("late-yes") if e.op_id is None]
    assert kinds[-1] == "escalate"

    await ledger.resolve_review(op_id, "committed", by="user:1", note="the PSP paid it")
    await quiesce(ledger)

    final = await ledger.receipt("late-yes")
    assert final.run_state is RunState.CANCELLED
    assert final.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert final.settled
    assert psp.sent == [op_id]  # sent once: nothing restarted (R4)


async def test_a_late_refusal_of_a_committed_call_of_a_cancelled_run(
    ledger: stopline.Ledger,
) -> None:
    """The other direction: a call the cancel let finish (committed), then a late
    refusal from the provider ("it did not go through") contradicts it: the run goes to
    review; decided "not committed", it is ``cancelled`` before any external action."""
    psp = Psp(drops=False)
    async with ledger.run("pay", owner="user:1", run_id="late-no") as run:
        await run.call(psp.tool, 25, key="pay")
        await ledger.cancel(run.id, by="user:1")
    settled = await ledger.wait_settled("late-no", timeout=GUARD)
    assert settled.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    op_id = "late-no/pay"

    late = await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="psp-void")
    await quiesce(ledger)

    assert late.status is OpStatus.NEEDS_REVIEW
    assert await _state(ledger, "late-no") is RunState.NEEDS_REVIEW
    await ledger.resolve_review(op_id, "not_committed", by="user:1", note="voided")
    await quiesce(ledger)
    final = await ledger.receipt("late-no")
    assert (final.run_state, final.headline) == (
        RunState.CANCELLED,
        Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
    )


async def test_a_completed_run_keeps_its_state_and_its_receipt_says_review(
    ledger: stopline.Ledger,
) -> None:
    """A run that ended on its own is not reopened by a contradiction in its calls: it
    was never cancelled (``needs_review`` is a cancel's state: who cancelled it would be
    its story), and ``completed`` is what its workflow did. The doubt is the receipt's
    headline and the review queue's item, which names the run's state."""
    psp = Psp(drops=False)
    async with ledger.run("pay", owner="user:1", run_id="done") as run:
        await run.call(psp.tool, 25, key="pay")
    op_id = "done/pay"
    assert await _state(ledger, "done") is RunState.COMPLETED

    await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="psp-void")
    await quiesce(ledger)

    assert await _state(ledger, "done") is RunState.COMPLETED
    receipt = await ledger.receipt("done")
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert receipt.cancelled_by is None
    items = await ledger.review_items()
    assert [(i.op.id, i.run.state) for i in items] == [(op_id, RunState.COMPLETED)]
    await ledger.resolve_review(op_id, "committed", by="user:1", note="it went through")
    await quiesce(ledger)
    assert (await ledger.receipt("done")).headline is Headline.COMPLETED
    assert await _state(ledger, "done") is RunState.COMPLETED


async def test_a_late_contradiction_in_a_settled_tree_sends_the_tree_to_review(
    ledger: stopline.Ledger,
) -> None:
    """P owns a, which owns b; all three settled ``cancelled``, b's mail read back as
    never sent. A late answer says it was sent: b, a and P go to review (P's receipt
    counts the mail, and said review beside ``cancelled``); the reviewer's decision
    settles all three ``cancelled`` again."""
    mail = Held("mail", drops=True)
    async with _cancelled_tree(ledger, mail) as op_id:
        await _until(ledger, ROOT, RunState.CANCELLED)
        await quiesce(ledger)
        assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NOT_COMMITTED
        await ledger.late_response(op_id, Verdict.COMMITTED, result="sent", ref="mail:late")
        await quiesce(ledger)
        for run_id in (GRANDCHILD, CHILD, ROOT):
            assert await _state(ledger, run_id) is RunState.NEEDS_REVIEW, run_id
        assert (await ledger.receipt(ROOT)).headline is Headline.NEEDS_REVIEW
        await ledger.resolve_review(op_id, "committed", by="me", note="the mail was sent")
        await quiesce(ledger)
    for run_id in (GRANDCHILD, CHILD, ROOT):
        assert await _state(ledger, run_id) is RunState.CANCELLED, run_id
    receipt = await ledger.receipt(ROOT)
    assert (receipt.headline, receipt.settled) == (Headline.STOPPED_WITH_COMPLETED_ACTIONS, True)


# -- R14: "waiting for vendor confirmation" only when the vendor was asked -------------
async def _silent(ctx: stopline.CallContext) -> bool:
    """A canceller whose provider never answers."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("cancellable", "canceller", "asked", "at_cancel"),
    [
        # not declared cancellable (every tool's default): nobody asks its provider
        (Cancellable.NEVER, "none", CancelState.NOT_ASKED, Headline.VERIFYING),
        # declared cancellable until accepted, and accepted: not asked
        (Cancellable.UNTIL_ACCEPTED, "refuses", CancelState.NOT_ASKED, Headline.VERIFYING),
        # declared cancellable, but its interface offers no way to ask
        (Cancellable.AFTER_ACCEPTED, "none", CancelState.NOT_SUPPORTED, Headline.VERIFYING),
        # asked, and its provider refused (S10): it waits for the vendor's word
        (
            Cancellable.AFTER_ACCEPTED,
            "refuses",
            CancelState.REFUSED,
            Headline.AWAITING_CONFIRMATION,
        ),
        # asked, and its provider never answers the cancel
        (
            Cancellable.AFTER_ACCEPTED,
            "silent",
            CancelState.UNANSWERED,
            Headline.AWAITING_CONFIRMATION,
        ),
    ],
    ids=["never", "past-acceptance", "no-way-to-ask", "refused", "unanswered"],
)
async def test_awaiting_confirmation_only_when_the_provider_was_asked(
    ledger: stopline.Ledger,
    cancellable: Cancellable,
    canceller: str,
    asked: CancelState,
    at_cancel: Headline,
) -> None:
    """A call in flight when its run is cancelled, accepted by its provider. The
    headline said "Cancellation requested; waiting for vendor confirmation." whether
    or not the provider was asked to cancel (its line said "not asked"): a wait for a
    confirmation nobody asked for. A call nobody asks runs to its end and may already
    have happened: "verifying" until its outcome is in."""
    ledger.cancel_answer_timeout = 0.2  # an unanswered cancel is called so this soon
    deploy = FakeProvider("deploy", cancellable=cancellable, on_cancel=CancelBehaviour.REFUSE)
    deploy.tool.cancel_fn = {"none": None, "silent": _silent}.get(canceller, deploy.tool.cancel_fn)
    accepted = deploy.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(deploy))
        with anyio.fail_after(GUARD):
            await accepted.reached.wait()
            await ledger.cancel(started.run_id, by="user:1")
            while (
                op := (await ledger.backend.operations(started.run_id))[0]
            ).cancel_state != asked:
                await ledger.wait_for_change(started.run_id, poll=0.05)
        receipt = await ledger.receipt(started.run_id)
        assert op.status is OpStatus.ACCEPTED
        assert receipt.headline is at_cancel, receipt.text()
        accepted.release()
    final = await ledger.wait_settled(started.run_id, timeout=GUARD)
    assert final.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert len(deploy.cancel_requests) == (asked is CancelState.REFUSED)  # asked: once


def _in_flight(cancel_state: CancelState, cancellable: Cancellable) -> OperationRecord:
    return op(OpStatus.ACCEPTED, cancellable=cancellable, cancel_state=cancel_state)


@pytest.mark.parametrize(
    ("cancel_state", "cancellable", "headline"),
    [
        (CancelState.NOT_ASKED, Cancellable.NEVER, Headline.VERIFYING),
        (CancelState.NOT_ASKED, Cancellable.UNTIL_ACCEPTED, Headline.VERIFYING),  # accepted
        (CancelState.NOT_SUPPORTED, Cancellable.AFTER_ACCEPTED, Headline.VERIFYING),
        # not asked yet, and it still can be: the worker sending it asks on the cancel
        (CancelState.NOT_ASKED, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
        (CancelState.ASKED, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
        # a cut that sent the provider a cancel though the tool is not declared cancellable
        (CancelState.ASKED, Cancellable.NEVER, Headline.AWAITING_CONFIRMATION),
        (CancelState.REFUSED, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
        (CancelState.UNANSWERED, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
        (CancelState.ERROR, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
        (CancelState.ACKNOWLEDGED, Cancellable.AFTER_ACCEPTED, Headline.AWAITING_CONFIRMATION),
    ],
)
def test_the_headline_of_a_call_in_flight_says_what_was_asked(
    cancel_state: CancelState, cancellable: Cancellable, headline: Headline
) -> None:
    """Pure: R8 over R14, for one call in flight in a cancelled run; with a second call
    nobody asked, the worse headline wins (R8's precedence: verifying)."""
    run = run_record(RunState.SETTLING)
    one = _in_flight(cancel_state, cancellable)
    assert headline_for(run, [one]) is headline
    other = dataclasses.replace(
        _in_flight(CancelState.NOT_ASKED, Cancellable.NEVER), id="r/2", status=OpStatus.REQUESTED
    )
    assert headline_for(run, [one, other]) is Headline.VERIFYING


# -- later evidence, as it may come: corrections, contradicting answers, odd payloads ----
async def test_a_correction_whose_original_never_happened_reopens_its_run(
    ledger: stopline.Ledger,
) -> None:
    """A cancelled run's booking was corrected (``compensation=always``); then the
    provider says the booking never happened. The booking goes to review and so does
    the run (it said ``cancelled``, "corrected"); decided "not committed", the run is
    ``cancelled`` again, the correction kept as an action of its own (R8), nothing
    sent again."""
    remote = Remote(compensation=Compensation.ALWAYS)
    remote.let_correct.set()
    async with ledger.run("trip", owner="user:1", run_id="fixed") as run:
        await run.call(remote.tool, "room 12", key="book")
        await ledger.cancel(run.id, by="user:1")
    assert (await ledger.wait_settled("fixed", timeout=GUARD)).headline is Headline.CORRECTED
    op_id = "fixed/book"

    await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="declined")
    await quiesce(ledger)

    assert await _state(ledger, "fixed") is RunState.NEEDS_REVIEW
    await ledger.resolve_review(op_id, "not_committed", by="user:1", note="never booked")
    await quiesce(ledger)
    final = await ledger.receipt("fixed")
    assert (final.run_state, final.headline) == (
        RunState.CANCELLED,
        Headline.STOPPED_WITH_COMPLETED_ACTIONS,
    )
    assert [line.status for line in final.lines] == [OpStatus.NOT_COMMITTED, OpStatus.COMMITTED]
    assert remote.sent == [op_id, f"{op_id}~compensate"]  # nothing sent again


async def test_late_answers_that_contradict_each_other_are_all_kept(
    ledger: stopline.Ledger,
) -> None:
    """Three late answers for one payment of a settled cancelled run: "paid" (with a
    result the ledger cannot keep), "declined", "paid" again. The first settles it,
    the second sends it (and its run) to review, the third is one more voice in that
    dispute: kept for the reviewer, nothing decided by it. Every answer is in the
    ledger; the receipt says review until a person decides."""
    psp = Psp()
    psp.search["late3/pay"] = Verdict.UNKNOWN  # the read-backs cannot tell: it waits
    async with ledger.run("pay", owner="user:1", run_id="late3") as run:
        with pytest.raises(ConnectionResetError):
            await run.call(psp.tool, 25, key="pay")
        await ledger.cancel(run.id, by="user:1")
    op_id = "late3/pay"  # unknown, or in review for want of an answer: the first settles it
    first = await ledger.late_response(op_id, Verdict.COMMITTED, ref="a", result=object())
    assert first.status is OpStatus.COMMITTED
    assert (await ledger.wait_settled("late3", timeout=GUARD)).run_state is RunState.CANCELLED

    second = await ledger.late_response(op_id, Verdict.NOT_COMMITTED, ref="b")
    third = await ledger.late_response(op_id, Verdict.COMMITTED, ref="c", result={"id": 7})
    await quiesce(ledger)

    assert (second.status, third.status) == (OpStatus.NEEDS_REVIEW, OpStatus.NEEDS_REVIEW)
    receipt = await ledger.receipt("late3")
    assert (receipt.run_state, receipt.headline) == (RunState.NEEDS_REVIEW, Headline.NEEDS_REVIEW)
    events = [e for e in await ledger.backend.events("late3") if e.op_id == op_id]
    refs = {ev["ref"] for e in events for ev in e.data.get("evidence", ())}
    assert {"a", "b", "c"} <= refs  # every answer kept, by its provider's reference
    assert any(
        ev["ref"] == "result_not_replayable" for e in events for ev in e.data.get("evidence", ())
    )  # the result the ledger could not keep, said so
    assert psp.sent == [op_id]


async def test_a_reopening_lost_with_its_worker_is_taken_up_on_open(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """The contradiction is written, and the worker that wrote it stops before its step
    moves the run (the write and the move are two transactions): the call is in review,
    the run still ``cancelled``. The next open steps the runs of the review queue, as it
    steps cancelled runs left settling."""
    psp = Psp()
    op_id = await _cancelled_lost(ledger, psp, "lost-step")
    said = Evidence(EvidenceKind.PROVIDER_RECEIPT, "psp-1", "late")
    await ledger.backend.record(op_id, OutcomeUpdate(OpEvent.CONFLICT, [said], late=True))
    assert await _state(ledger, "lost-step") is RunState.CANCELLED  # its step never ran

    async with stopline.open(ledger_url, verify=FAST_VERIFY) as after:
        with anyio.fail_after(GUARD):
            while await _state(after, "lost-step") is not RunState.NEEDS_REVIEW:
                await after.wait_for_change("lost-step", poll=0.05)
        await ledger.resolve_review(op_id, "committed", by="user:1", note="paid")
        await quiesce(ledger)
    assert await _state(ledger, "lost-step") is RunState.CANCELLED
