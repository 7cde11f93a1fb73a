"""Compensation (S3's correction, S8, R7) on a real SQLite ledger."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

import stopline
from stopline import Cancellable, EvidenceKind, Headline, OpStatus, PhaseKind, Policy, RunState
from stopline.runtime.tool import Compensation
from stopline.testing import FakeProvider
from tests.scenarios.workflows import Started, calls, start
from tests.truth.helpers import Remote, quiesce


async def test_s03_cancel_after_commit_correction_queued(ledger: stopline.Ledger) -> None:
    """Unknown -> verified committed; the tool corrects on cancel: queued, then corrected."""
    notify = FakeProvider("notify", cancellable=Cancellable.NEVER)
    notify.tool.compensation = Compensation.ALWAYS
    corrected: list[str] = []
    go_on = anyio.Event()

    @notify.tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        corrected.append(getattr(ctx, "compensates", ""))
        await go_on.wait()
        return "retracted"

    held = notify.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(notify, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    while not corrected:
        await ledger.wait_for_change(started.run_id)
    queued = await ledger.receipt(started.run_id)
    assert queued.headline is Headline.CORRECTION_QUEUED
    assert queued.message == "Action had already completed; correction queued."
    original, correction = queued.lines
    assert original.status is OpStatus.COMPENSATING
    assert correction.op_id == f"{original.op_id}~compensate"
    go_on.set()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.CORRECTED
    assert [line.status for line in receipt.lines] == [OpStatus.COMPENSATED, OpStatus.COMMITTED]
    assert corrected == [original.op_id]  # the correction knew what it corrected
    op = await ledger.backend.get_operation(original.op_id)
    assert EvidenceKind.READ_BACK in {e.kind for e in op.evidence}  # verified before corrected
    assert notify.effects == [original.op_id]  # nothing was sent twice


async def test_s03_ask_policy_proposes_and_waits(ledger: stopline.Ledger) -> None:
    remote = Remote(compensation=Compensation.ASK)
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, _book_then_wait(remote))
        await started.ready.wait()
        while not remote.committed:
            await ledger.wait_for_change(started.run_id)
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.lines[0].recovery == "can be corrected by its compensation"
    kinds = [e.kind for e in await ledger.backend.events(started.run_id)]
    assert "compensation_proposed" in kinds  # asked, not done
    assert remote.corrected == {}


def _book_then_wait(remote: Remote) -> Callable[[stopline.Run, Started], Awaitable[None]]:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.THINKING):
            await run.call(remote.tool, "room 12", key="book")
            await anyio.sleep_forever()

    return body


async def test_s08_cancel_while_compensation_runs(ledger: stopline.Ledger) -> None:
    """The workflow corrects a step; a cancel lands meanwhile; the correction finishes."""
    remote = Remote()

    async def body(run: stopline.Run, started: Started) -> None:
        await run.call(remote.tool, "room 12", key="book")
        await ledger.compensate(f"{run.id}/book", by=run.owner, reason="plan changed")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await remote.correcting.wait()
        first = await ledger.cancel(started.run_id, by="user:1", reason="stop everything")
        again = await ledger.cancel(started.run_id, by="user:1")  # R7: one cancellation
        assert first.headline is again.headline is Headline.CORRECTION_QUEUED
        remote.let_correct.set()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CORRECTED
    booking, correction = receipt.lines
    assert booking.status is OpStatus.COMPENSATED
    assert correction.status is OpStatus.COMMITTED and correction.what == "correct: book"
    assert list(remote.corrected.values()) == [booking.op_id]
    events = await ledger.backend.events(started.run_id)
    assert [e.kind for e in events].count("cancel") == 1
    assert started.error is None


async def test_r7_stop_compensation_only_on_explicit_ask(ledger: stopline.Ledger) -> None:
    remote = Remote()
    async with ledger.run("trip", owner="user:1") as run:
        await run.call(remote.tool, "room 12", key="book")
    op_id = f"{run.id}/book"
    await ledger.compensate(op_id, by="user:1", wait=False)
    await remote.correcting.wait()
    with pytest.raises(stopline.NotPermitted):
        await ledger.stop_compensation(op_id, by="user:mallory")
    assert await ledger.stop_compensation(op_id, by="user:1", reason="wrong refund")
    await quiesce(ledger)
    correction = await ledger.backend.get_operation(f"{op_id}~compensate")
    # interrupted: unknown, and its read-back found nothing yet, so a human decides
    assert correction.status is OpStatus.NEEDS_REVIEW
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.COMPENSATING
    receipt = await ledger.receipt(run.id)
    assert receipt.headline is Headline.NEEDS_REVIEW
    kinds = [e.kind for e in await ledger.backend.events(run.id)]
    assert "compensation_stop_asked" in kinds


async def test_failed_correction_goes_to_review_then_again(ledger: stopline.Ledger) -> None:
    remote = Remote(refuse_correction=True)
    remote.let_correct.set()
    async with ledger.run("trip", owner="user:1") as run:
        await run.call(remote.tool, "room 12", key="book")
    op_id = f"{run.id}/book"
    after = await ledger.compensate(op_id, by="user:1")
    await quiesce(ledger)
    assert after.status in (OpStatus.COMPENSATION_FAILED, OpStatus.NEEDS_REVIEW)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    assert (await ledger.receipt(run.id)).headline is Headline.NEEDS_REVIEW
    remote.refuse_correction = False
    receipt = await ledger.resolve_review(op_id, "compensate", by="user:1", note="try again")
    await quiesce(ledger)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.COMPENSATED
    ids = [c.id for c in await ledger.backend.compensations(op_id)]
    assert ids == [f"{op_id}~compensate", f"{op_id}~compensate.2"]
    assert receipt.lines[0].op_id == op_id


async def test_compensate_refuses_what_cannot_be_corrected(ledger: stopline.Ledger) -> None:
    plain = FakeProvider("plain")
    async with ledger.run("job", owner="user:1") as run:
        await run.call(plain.tool, "x", key="one")
    with pytest.raises(stopline.NotPermitted, match="declares no compensator"):
        await ledger.compensate(f"{run.id}/one", by="user:1")
    remote = Remote()
    async with ledger.run("job", owner="user:1") as run2:
        await run2.call(remote.tool, "x", key="one")
    remote.let_correct.set()
    await ledger.compensate(f"{run2.id}/one", by="user:1")
    with pytest.raises(stopline.IllegalTransition):  # compensated already
        await ledger.compensate(f"{run2.id}/one", by="user:1")
    with pytest.raises(stopline.NotPermitted, match="itself a correction"):
        await ledger.compensate(f"{run2.id}/one~compensate", by="user:1")


async def test_closing_the_ledger_under_a_correction_records_why_its_answer_is_lost(
    ledger_url: str,
) -> None:
    """A service shuts down while a refund runs: the correction was left ``requested``
    and the next open called it a crash. Its answer is lost because the ledger closed:
    recorded so, ``unknown``, and read back at the next open (R3, R5)."""
    started = anyio.Event()

    async def book(ctx: stopline.CallContext) -> str:
        return "booked"

    tool = stopline.Tool(book, compensation=Compensation.ASK)

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with stopline.open(ledger_url, tools=[tool]) as ledger:
        async with ledger.run("trip", owner="user:1", run_id="r") as run:
            await run.call(tool, key="room")
        await ledger.compensate("r/room", by="user:1", wait=False)
        await started.wait()
    async with stopline.open(ledger_url, verify=stopline.VerifyBudget(first_delay=1e6)) as ledger:
        comp = await ledger.backend.get_operation("r/room~compensate")
        assert comp.status is OpStatus.UNKNOWN and comp.cause is stopline.Cause.LOCAL_ERROR
        assert "the ledger closed while the correction ran" in comp.evidence[-1].detail


async def test_a_cancelled_run_whose_correction_waits_for_review_settles_in_review(
    ledger: stopline.Ledger,
) -> None:
    """A cancel corrects a committed call (``compensation=always``); the correction's
    answer is lost (its code raised after it acted) and it has no read-back, so it waits
    for a reviewer, and the original, being corrected, with it. The run stayed
    ``settling`` for ever (the original counted as a correction under way) and
    ``wait_settled`` never returned, while its receipt said review already. It settles
    in review; the reviewer's answer on the correction closes it."""
    notify = FakeProvider("notify", cancellable=Cancellable.NEVER)
    notify.tool.compensation = Compensation.ALWAYS
    corrected: list[str] = []

    @notify.tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        corrected.append(getattr(ctx, "compensates", ""))
        raise RuntimeError("retracted, then the connection dropped")

    held = notify.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(notify, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=30)  # a guard: it never did
    assert receipt.run_state is RunState.NEEDS_REVIEW
    assert receipt.headline is Headline.NEEDS_REVIEW
    original, correction = receipt.lines
    assert (original.status, correction.status) == (OpStatus.COMPENSATING, OpStatus.NEEDS_REVIEW)
    assert "its correction waits for human review" in original.recovery
    assert corrected == [original.op_id] and notify.effects == [original.op_id]
    await ledger.resolve_review(correction.op_id, "committed", by="user:1", note="retracted")
    closed = await ledger.wait_settled(started.run_id, timeout=30)
    assert [line.status for line in closed.lines] == [OpStatus.COMPENSATED, OpStatus.COMMITTED]
    assert closed.headline is Headline.CORRECTED
    assert closed.run_state is not RunState.NEEDS_REVIEW
