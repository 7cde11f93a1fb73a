"""Probe 3 (compensation, reconciliation, review) from outside: a real ledger, SQLite
and PostgreSQL, what a user does and what the receipt then says."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
from anyio import wait_all_tasks_blocked

import stopline
from stopline import EvidenceKind, OpStatus, ReadBack, RunState, Verdict
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpEvent
from stopline.errors import LedgerUnavailable, NotInReview, UnknownOperation
from stopline.ledger.backend import Backend, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY
from tests.support.observed import open_observed
from tests.truth.helpers import Remote, quiesce


async def _in_review_in_a_paused_run(
    ledger: stopline.Ledger, undone: list[str], tg: anyio.abc.TaskGroup, go_on: anyio.Event
) -> str:
    """A running run whose post lost its answer (no read-back: in review), then paused."""

    async def post(ctx: stopline.CallContext) -> str:
        raise RuntimeError("the connection dropped after the post was sent")

    tool = stopline.Tool(post, name="post")

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        undone.append(ctx.key)
        return "deleted"

    ledger.register_tool(tool)
    posted = anyio.Event()

    async def body() -> None:
        async with ledger.run("job", owner="user:1", run_id="r") as run:
            with pytest.raises(RuntimeError):
                await run.call(tool, key="k")
            posted.set()
            await go_on.wait()

    tg.start_soon(body)
    await posted.wait()
    with anyio.fail_after(30):  # a hang guard
        while (await ledger.backend.get_operation("r/k")).status is not OpStatus.NEEDS_REVIEW:
            await ledger.wait_for_change("r")
    assert (await ledger.pause("r", by="user:1")).run_state is RunState.PAUSED
    return "r/k"


async def test_a_review_compensate_refused_in_a_paused_run_records_nothing(
    ledger: stopline.Ledger,
) -> None:
    """A reviewer finds the post happened and asks to correct it while its run is paused.
    The correction may not start (a paused run passes no gate) and the reviewer was told
    so ("resume it to correct"), but the decision had been recorded first: the post left
    review as ``committed`` with no correction, and the same decision after the resume
    was refused as "not in review". A refused decision records nothing."""
    undone: list[str] = []
    go_on = anyio.Event()
    async with anyio.create_task_group() as tg:
        op_id = await _in_review_in_a_paused_run(ledger, undone, tg, go_on)
        before = await ledger.backend.events("r")
        with pytest.raises(stopline.NotPermitted, match="is paused; resume it"):
            await ledger.resolve_review(op_id, "compensate", by="user:1", note="delete it")
        assert await ledger.backend.events("r") == before  # nothing recorded
        assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
        assert [item.op.id for item in await ledger.review_items()] == [op_id]
        # following the refusal's advice: resume, then decide again; the correction runs once
        await ledger.resume("r", by="user:1")
        await ledger.resolve_review(op_id, "compensate", by="user:1", note="delete it")
        await quiesce(ledger)
        assert (await ledger.backend.get_operation(op_id)).status is OpStatus.COMPENSATED
        assert undone == [f"{op_id}~compensate"]
        go_on.set()


class BothDecide(ForwardingBackend):
    """Holds a reviewer's decision until a second one reaches the ledger too."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.deciding = 0
        self.both = anyio.Event()

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        if update.event in _DECISIONS:
            self.deciding += 1
            if self.deciding == 2:
                self.both.set()
            await self.both.wait()
        return await self.inner.record(op_id, update)


_DECISIONS = frozenset(
    {OpEvent.REVIEWED_COMMITTED, OpEvent.REVIEWED_NOT_COMMITTED, OpEvent.REVIEWED_CORRECTED}
)


async def test_the_second_of_two_reviewers_at_once_is_told_the_item_is_decided(
    ledger_url: str,
) -> None:
    """Two reviewers decide one item at once: the one whose decision lands second got a
    bare ``IllegalTransition`` ("event 'reviewed_committed' in state 'committed'"),
    where one a moment later gets ``NotInReview`` saying what the item is now and that
    nothing was recorded. One decision stands; nothing is corrected."""
    undone: list[str] = []

    async def post(ctx: stopline.CallContext) -> str:
        raise RuntimeError("the connection dropped after the post was sent")

    tool = stopline.Tool(post, name="post")

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        undone.append(ctx.key)
        return "deleted"

    async with open_observed(ledger_url, BothDecide) as (ledger, observer):
        ledger.register_tool(tool)
        async with ledger.run("job", owner="user:1", run_id="r") as run:
            with pytest.raises(RuntimeError):
                await run.call(tool, key="k")
        await quiesce(ledger)
        assert (await ledger.backend.get_operation("r/k")).status is OpStatus.NEEDS_REVIEW
        decided: list[str] = []
        refused: list[NotInReview] = []

        async def decide(verdict: str) -> None:
            try:
                await ledger.resolve_review("r/k", verdict, by="user:1", note=verdict)
                decided.append(verdict)
            except NotInReview as exc:
                refused.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(decide, "committed")
            tg.start_soon(decide, "compensate")
        await quiesce(ledger)
        final = await ledger.backend.get_operation("r/k")
    assert observer.deciding == 2  # both passed the check "in review" before either landed
    (lost,) = refused
    (won,) = decided
    assert final.status is (OpStatus.COMPENSATED if won == "compensate" else OpStatus.COMMITTED)
    # what the item is once the first decision landed: committed, or being corrected
    assert lost.state in (OpStatus.COMMITTED, OpStatus.COMPENSATING, OpStatus.COMPENSATED)
    assert "is not in review" in str(lost) and "nothing recorded" in str(lost)
    assert [e.detail for e in final.evidence if e.kind is EvidenceKind.REVIEW] == [f"{won}: {won}"]
    assert undone == ([] if won == "committed" else ["r/k~compensate"])


class ReadsFail(ForwardingBackend):
    """A ledger whose reads of operations fail once ``down`` (its server went away)."""

    down = False

    async def get_operations(
        self, op_ids: Sequence[str]
    ) -> list[OperationRecord | UnknownOperation]:
        if self.down:
            raise LedgerUnavailable("probe", "the server went away")
        return await self.inner.get_operations(op_ids)


async def test_a_reconcile_whose_ledger_fails_raises_the_typed_error(ledger_url: str) -> None:
    """Two calls lost their answers; a reconcile reads them back while the ledger fails
    under it. ``ledger.reconcile`` raised an ``ExceptionGroup`` of two ``LedgerUnavailable``
    (its reads run side by side), which ``except stopline.LedgerUnavailable`` does not
    catch; it raises the typed error, and a reconcile after the ledger is back proves
    both without sending anything."""
    sent: list[str] = []

    async def post(ctx: stopline.CallContext) -> str:
        sent.append(ctx.key)
        raise RuntimeError("the connection dropped after the post was sent")

    tool = stopline.Tool(post, name="post")

    @tool.verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED if ctx.key in sent else Verdict.NOT_COMMITTED, ctx.key)

    later = stopline.VerifyBudget(attempts=1, first_delay=1e6)  # a reconcile reads them
    async with (
        stopline.open(ledger_url, tools=[tool], verify=later) as first,
        first.run("job", owner="user:1", run_id="r") as run,
    ):
        for key in ("a", "b"):
            with pytest.raises(RuntimeError):
                await run.call(tool, key=key)
    async with open_observed(ledger_url, ReadsFail) as (ledger, backend):
        backend.down = True
        with pytest.raises(stopline.LedgerUnavailable, match="the server went away"):
            await ledger.reconcile(tools=[tool], budget=FAST_VERIFY)
        backend.down = False
        summary = await ledger.reconcile(tools=[tool], budget=FAST_VERIFY)
    assert summary.committed == ("r/a", "r/b")
    assert sent == ["r/a", "r/b"]  # read back, never sent again


async def test_a_correction_is_stopped_by_its_own_id(ledger: stopline.Ledger) -> None:
    """The receipt shows a correction running as its own line, ``r/book~compensate``.
    ``stop_compensation`` of that id returned False ("not running here") while it ran
    here, and the correction went on; the id of its line stops it as the corrected
    operation's does (R7's explicit ask): unknown, read back, in review."""
    remote = Remote()
    async with ledger.run("trip", owner="user:1", run_id="r") as run:
        await run.call(remote.tool, "room 12", key="book")
    await ledger.compensate("r/book", by="user:1", wait=False)
    await remote.correcting.wait()
    line = (await ledger.receipt("r")).lines[1]
    assert line.op_id == "r/book~compensate"
    assert await ledger.stop_compensation(line.op_id, by="user:1", reason="wrong refund")
    await quiesce(ledger)
    assert not await ledger.stop_compensation(line.op_id, by="user:1")  # it ran; it ended
    correction = await ledger.backend.get_operation(line.op_id)
    assert correction.status is OpStatus.NEEDS_REVIEW
    assert ("user_cancel", "stopped on request") in [(e.ref, e.detail) for e in correction.evidence]
    assert remote.corrected == {}  # interrupted before it corrected anything
    assert remote.sent == ["r/book", line.op_id]  # sent once each, nothing again


async def test_a_decided_correction_returns_the_receipt_of_its_outcome(
    ledger: stopline.Ledger,
) -> None:
    """A correction whose answer was lost waits for a reviewer, who finds it happened.
    The receipt ``resolve_review`` returned still said of the corrected operation
    "correction in progress; next: correction queued; its outcome is verified before
    this run closes" (the link to it was settled later, in the background) while the
    line below said the correction had completed. It says corrected."""
    refunds: list[str] = []

    async def book(ctx: stopline.CallContext) -> str:
        return "booked"

    tool = stopline.Tool(book, name="book")

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        refunds.append(ctx.key)
        raise RuntimeError("the refund was sent; its answer was lost")

    ledger.register_tool(tool)
    async with ledger.run("trip", owner="user:1", run_id="r") as run:
        await run.call(tool, key="room")
    await ledger.compensate("r/room", by="user:1")
    await quiesce(ledger)
    assert [item.op.id for item in await ledger.review_items()] == ["r/room~compensate"]
    receipt = await ledger.resolve_review(
        "r/room~compensate", "committed", by="user:1", note="refund seen in the bank"
    )
    original, correction = receipt.lines
    assert (original.status, correction.status) == (OpStatus.COMPENSATED, OpStatus.COMMITTED)
    assert "correction queued" not in receipt.text()
    assert refunds == ["r/room~compensate"]


async def test_a_verdict_of_the_wrong_kind_is_invalid_input(ledger: stopline.Ledger) -> None:
    """``resolve_review(op, None)`` (or any word but the three) raised a bare
    ``ValueError``: not a ``StoplineError``, so a surface catching those did not say
    what was wrong. It is ``InvalidInput`` naming the verdict; nothing is recorded."""

    async def post(ctx: stopline.CallContext) -> str:
        raise RuntimeError("lost")

    tool = stopline.Tool(post, name="post")
    async with ledger.run("job", owner="user:1", run_id="r") as run:
        with pytest.raises(RuntimeError):
            await run.call(tool, key="k")
    await quiesce(ledger)
    before = await ledger.backend.events("r")
    for verdict in (None, "maybe", 1):
        with pytest.raises(stopline.InvalidInput, match=r"verdict.*is not one of"):
            await ledger.resolve_review("r/k", verdict, by="user:1")  # type: ignore[arg-type]
    assert await ledger.backend.events("r") == before
    assert (await ledger.backend.get_operation("r/k")).status is OpStatus.NEEDS_REVIEW


class HeldAfterEscalation(ForwardingBackend):
    """Holds whoever records a failed correction's escalation, once it has landed."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.escalated = anyio.Event()
        self.go_on = anyio.Event()
        self.went_on = anyio.Event()

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        recorded = await self.inner.record(op_id, update)
        if update.event is OpEvent.ESCALATED and not self.escalated.is_set():
            self.escalated.set()
            await self.go_on.wait()
            self.went_on.set()
        return recorded


async def test_a_second_correction_asked_as_the_first_ends_can_still_be_stopped(
    ledger_url: str,
) -> None:
    """The first refund is refused; its runner escalates the booking to review, and a
    reviewer asks to correct it again before that runner has ended. The first runner's
    end removed what the second had registered under the same booking: a stop of the
    second returned False ("not running here") while it ran here, and a wait for it
    returned at once. Each runner ends only its own."""
    remote = Remote(refuse_correction=True)
    async with open_observed(ledger_url, HeldAfterEscalation) as (ledger, held):
        ledger.register_tool(remote.tool)
        async with ledger.run("trip", owner="user:1", run_id="r") as run:
            await run.call(remote.tool, "room 12", key="book")
        remote.let_correct.set()
        await ledger.compensate("r/book", by="user:1", wait=False)
        await held.escalated.wait()  # the first runner has escalated; it has not ended
        remote.refuse_correction = False
        remote.let_correct = anyio.Event()  # the second waits, running
        remote.correcting = anyio.Event()
        await ledger.resolve_review("r/book", "compensate", by="user:1", note="again")
        await remote.correcting.wait()
        held.go_on.set()
        await held.went_on.wait()
        await wait_all_tasks_blocked()  # the first runner has ended; the second still runs
        second = await ledger.backend.get_operation("r/book~compensate.2")
        assert second.status is OpStatus.REQUESTED
        assert await ledger.stop_compensation("r/book", by="user:1", reason="hold on")
        with anyio.fail_after(30):  # a hang guard
            while second.status is OpStatus.REQUESTED:
                await ledger.wait_for_change("r")
                second = await ledger.backend.get_operation("r/book~compensate.2")
    assert second.status is OpStatus.UNKNOWN  # stopped: its read-back follows (R3)
    assert ("user_cancel", "stopped on request") in [(e.ref, e.detail) for e in second.evidence]
    assert remote.corrected == {}


async def test_an_action_whose_correction_failed_says_it_can_be_corrected_again(
    ledger: stopline.Ledger,
) -> None:
    """The refund of a proven booking is refused; the booking goes to review. Its line
    said "a reviewer decides committed or not committed", as for an outcome nobody
    knows, where the same item a moment before (``compensation_failed``) offered the
    third way, the one the reviewer needs: correct it again. Followed, it corrects once
    more and sends nothing else."""
    remote = Remote(refuse_correction=True)
    remote.let_correct.set()
    ledger.register_tool(remote.tool)
    async with ledger.run("trip", owner="user:1", run_id="r") as run:
        await run.call(remote.tool, "room 12", key="book")
    await ledger.compensate("r/book", by="user:1")
    await quiesce(ledger)
    booking, refused = (await ledger.receipt("r")).lines
    assert (booking.status, refused.status) == (OpStatus.NEEDS_REVIEW, OpStatus.NOT_COMMITTED)
    assert booking.recovery == "a reviewer decides: committed, not committed, or correct it again"
    remote.refuse_correction = False
    await ledger.resolve_review("r/book", "compensate", by="user:1", note="refund again")
    await quiesce(ledger)
    assert (await ledger.backend.get_operation("r/book")).status is OpStatus.COMPENSATED
    assert remote.sent == ["r/book", "r/book~compensate", "r/book~compensate.2"]
