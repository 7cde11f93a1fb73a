"""R14: guidance is provable. For every headline a cancelled run can show, follow
the receipt's recovery line to the letter (wait, let a reviewer decide, resume and
re-enter the run) and check that it repeated no effect and did what it said: the
completed actions it named were replayed, the ones it said never happened were
sent, each exactly once."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import anyio
import pytest

import stopline
from stopline import Cancellable, Headline, PhaseKind, Policy, ReadBack, Verdict
from stopline.runtime.tool import Compensation
from stopline.testing import CancelBehaviour, FakeProvider

pytestmark = pytest.mark.timeout(30)
Workflow = Callable[[stopline.Run], Awaitable[None]]


def calling(*providers: FakeProvider, policy: Policy = Policy.VERIFY) -> Workflow:
    async def workflow(run: stopline.Run) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
            for p in providers:
                await run.call(p.tool, p.name, key=p.name)

    return workflow


async def follow(
    ledger: stopline.Ledger,
    run_id: str,
    workflow: Workflow,
    providers: list[FakeProvider],
    *,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Do what the receipt says, then check the effects against what it said."""
    receipt = await ledger.receipt(run_id)
    rule = receipt.resume_rule
    assert "A new run would send every action again." in rule
    if rule.startswith("wait until it settles"):
        if settle is not None:
            await settle()  # what the provider and the verifier do meanwhile
        receipt = await ledger.wait_settled(run_id, timeout=10)
        rule = receipt.resume_rule
    if rule.startswith("a reviewer decides"):
        for item in await ledger.review_items():
            done = any(item.op.id in p.committed for p in providers)
            await ledger.resolve_review(
                item.op.id, "committed" if done else "not_committed", by="user:1"
            )
        receipt = await ledger.wait_settled(run_id, timeout=10)
        rule = receipt.resume_rule
    said = re.match(
        r"resume with ledger\.resume\(run_id, by=\.\.\.\), then re-enter the run with the same "
        r"run id: (\d+) completed actions? (?:is|are) returned from the ledger, not repeated; "
        r"(\d+) actions? that never happened (?:is|are) sent",
        rule,
    )
    assert said, rule
    replayed, sent = int(said.group(1)), int(said.group(2))
    recorded = {op.id for op in await ledger.backend.operations(run_id) if not op.compensates}
    before = {p.name: len(p.requests) for p in providers}
    await ledger.resume(run_id, by="user:1")
    async with ledger.run("job", owner="user:1", run_id=run_id) as run:
        await workflow(run)
    resent = [
        key
        for p in providers
        for key in p.requests[before[p.name] :]
        if key in recorded  # the calls the receipt spoke of (others were never reached)
    ]
    assert len(resent) == sent  # what it said would be sent, and nothing else
    assert replayed + sent == len(recorded)
    for p in providers:  # no effect happened twice
        assert len(p.effects) == len(set(p.effects))


async def cancel_at(
    ledger: stopline.Ledger, workflow: Workflow, point: anyio.Event, run_id: str
) -> None:
    async def main() -> None:
        async with ledger.run("job", owner="user:1", run_id=run_id) as run:
            await workflow(run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        await point.wait()
        await ledger.cancel(run_id, by="user:1")


async def test_r14_canceled_before_external_action(ledger: stopline.Ledger) -> None:
    refund = FakeProvider("refund")
    workflow = calling(refund)
    async with ledger.run("job", owner="user:1", run_id="g1") as run:
        await ledger.cancel(run.id, by="user:1")
        await workflow(run)
    receipt = await ledger.wait_settled("g1", timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    await follow(ledger, "g1", workflow, [refund])


async def test_r14_stopped_with_completed_actions(ledger: stopline.Ledger) -> None:
    pay, notify = FakeProvider("pay"), FakeProvider("notify", cancellable=Cancellable.NEVER)
    held = notify.hold("received")
    workflow = calling(pay, notify, policy=Policy.IMMEDIATE)
    await cancel_at(ledger, workflow, held.reached, "g2")
    held.release()
    receipt = await ledger.wait_settled("g2", timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    await follow(ledger, "g2", workflow, [pay, notify])


async def test_r14_corrected_and_correction_queued(ledger: stopline.Ledger) -> None:
    book = FakeProvider("book", compensable=True)
    book.tool.compensation = Compensation.ALWAYS
    correcting = anyio.Event()
    go_on = anyio.Event()
    compensate = book.tool.compensate_fn
    assert compensate is not None

    async def slow_correction(ctx: stopline.CallContext) -> object:
        correcting.set()
        await go_on.wait()
        return await compensate(ctx)

    book.tool.compensate_fn = slow_correction
    workflow = calling(book)
    async with ledger.run("job", owner="user:1", run_id="g3") as run:
        await workflow(run)
        await ledger.cancel(run.id, by="user:1")
    await correcting.wait()
    queued = await ledger.receipt("g3")
    assert queued.headline is Headline.CORRECTION_QUEUED

    async def correction_done() -> None:
        go_on.set()

    await follow(ledger, "g3", workflow, [book], settle=correction_done)
    assert (await ledger.receipt("g3")).run_state is stopline.RunState.COMPLETED


async def test_r14_awaiting_confirmation(ledger: stopline.Ledger) -> None:
    deploy = FakeProvider(
        "deploy", cancellable=Cancellable.AFTER_ACCEPTED, on_cancel=CancelBehaviour.REFUSE
    )
    held = deploy.hold("accepted")
    workflow = calling(deploy)
    ended = anyio.Event()

    async def main() -> None:
        async with ledger.run("job", owner="user:1", run_id="g4") as run:
            await workflow(run)
        ended.set()

    async def provider_finishes() -> None:
        held.release()
        await ended.wait()  # the workflow stops at the boundary after the response

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        await held.reached.wait()
        await ledger.cancel("g4", by="user:1")
        # still in flight, and the provider may still cancel or refuse
        assert (await ledger.receipt("g4")).headline is Headline.AWAITING_CONFIRMATION
        await follow(ledger, "g4", workflow, [deploy], settle=provider_finishes)


async def test_r14_verifying(ledger: stopline.Ledger) -> None:
    post = FakeProvider("post", drop_response=True)
    reading = anyio.Event()
    may_read = anyio.Event()
    verify = post.tool.verify_fn
    assert verify is not None

    async def slow_read(ctx: stopline.CallContext) -> ReadBack | Verdict:
        reading.set()
        await may_read.wait()
        return await verify(ctx)

    post.tool.verify_fn = slow_read
    workflow = calling(post)
    async with ledger.run("job", owner="user:1", run_id="g5") as run:
        with pytest.raises(ConnectionResetError):
            await workflow(run)
        await ledger.cancel(run.id, by="user:1")
    await reading.wait()
    assert (await ledger.receipt("g5")).headline is Headline.VERIFYING

    async def read_allowed() -> None:
        may_read.set()

    await follow(ledger, "g5", workflow, [post], settle=read_allowed)


async def test_r14_needs_review(ledger: stopline.Ledger) -> None:
    blind = FakeProvider("notify", cancellable=Cancellable.NEVER, verifiable=False)
    held = blind.hold("committed")
    workflow = calling(blind, policy=Policy.IMMEDIATE)
    await cancel_at(ledger, workflow, held.reached, "g6")
    held.release()
    receipt = await ledger.wait_settled("g6", timeout=10)
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert receipt.resume_rule.startswith("a reviewer decides 1 operation in review")
    await follow(ledger, "g6", workflow, [blind])
