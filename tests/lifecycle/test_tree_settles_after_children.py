"""A cancelled run settles after its tree (R6, R13, R14).

A parent's receipt counts the operations of the runs it owns exclusively: while
a child's call was in doubt, the parent showed ``cancelled`` (settled, its
Cancel gone in the console) beside the headline "verifying". Now a parent
stays ``settling`` until every run of its tree has settled, goes to review
with a child that does, and is stepped again when a child moves.
"""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import Headline, PhaseKind, Policy, ReadBack, RunState, Verdict

pytestmark = pytest.mark.timeout(30)


class InDoubt:
    """A child's call in doubt, whose read-back answers when told: cut by the cancel
    (in flight till then), or (``lost``) its connection dropped once it was sent."""

    def __init__(self, verdict: Verdict | None, *, lost: bool = False) -> None:
        self.sent, self.reading, self.answer = anyio.Event(), anyio.Event(), anyio.Event()

        async def deploy(ctx: stopline.CallContext) -> None:
            self.sent.set()
            if lost:
                raise ConnectionResetError("the connection dropped after the request was sent")
            await anyio.sleep_forever()

        self.tool = stopline.Tool(deploy, name="deploy")
        if verdict is not None:

            @self.tool.verifier
            async def read(ctx: stopline.CallContext) -> ReadBack:
                self.reading.set()
                await self.answer.wait()
                return ReadBack(verdict, "deploy:log", "read from its log", ended=True)


async def cancelled_tree(ledger: stopline.Ledger, provider: InDoubt) -> None:
    """A parent whose child's call is in flight, cancelled."""

    async def child(run: stopline.Run) -> None:
        async with (
            run.child("deployer") as sub,
            sub.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),
        ):
            await sub.call(provider.tool, key="deploy")

    async with anyio.create_task_group() as tg:

        async def parent() -> None:
            async with ledger.run("parent", owner="user:1", run_id="p") as run:
                await child(run)

        tg.start_soon(parent)
        await provider.sent.wait()
        await ledger.cancel("p", by="user:1")


async def test_a_cancelled_parent_settles_after_its_childs_call_in_doubt(
    ledger: stopline.Ledger,
) -> None:
    provider = InDoubt(Verdict.NOT_COMMITTED)
    await cancelled_tree(ledger, provider)
    await provider.reading.wait()  # the child's call is being read back: in doubt
    parent = await ledger.receipt("p")
    assert parent.headline is Headline.VERIFYING
    assert parent.run_state is RunState.SETTLING  # not cancelled beside "verifying"
    assert (await ledger.backend.get_run("p:deployer")).state is RunState.SETTLING
    provider.answer.set()
    settled = await ledger.wait_settled("p", timeout=20)
    assert settled.run_state is RunState.CANCELLED
    assert settled.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    verified = max(e.seq for e in await ledger.backend.events("p:deployer"))
    (done,) = [e for e in await ledger.backend.events("p") if e.kind == "settled"]
    assert done.seq > verified  # the parent settled after its child


async def test_a_cancelled_parent_goes_to_review_with_its_child(ledger: stopline.Ledger) -> None:
    """A child's call with no read-back goes to human review: so does its parent (its
    receipt says a reviewer decides), and it settles once the review is resolved."""
    provider = InDoubt(None)
    await cancelled_tree(ledger, provider)
    receipt = await ledger.wait_settled("p", timeout=20)
    assert receipt.run_state is RunState.NEEDS_REVIEW
    assert receipt.headline is Headline.NEEDS_REVIEW
    (item,) = await ledger.review_items()
    await ledger.resolve_review(item.op.id, "not_committed", by="user:1")
    settled = await ledger.wait_settled("p", timeout=20)
    assert settled.run_state is RunState.CANCELLED
    assert (await ledger.backend.get_run("p:deployer")).state is RunState.CANCELLED


async def ended_child_then_cancel(ledger: stopline.Ledger, provider: InDoubt) -> None:
    """A child that ended on its own (completed) with its call in doubt; then its parent
    is cancelled."""
    parent_ready = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def parent() -> None:
            async with ledger.run("parent", owner="user:1", run_id="p") as run:
                async with run.child("deployer") as sub:
                    with pytest.raises(ConnectionResetError):
                        await sub.call(provider.tool, key="deploy")
                parent_ready.set()
                await anyio.sleep_forever()

        tg.start_soon(parent)
        await parent_ready.wait()
        assert (await ledger.backend.get_run("p:deployer")).state is RunState.COMPLETED
        await ledger.cancel("p", by="user:1")


async def test_a_cancelled_parent_settles_after_a_child_that_ended_with_a_call_in_doubt(
    ledger: stopline.Ledger,
) -> None:
    """The child completed before the cancel, its call in doubt and being read back: the
    parent stays settling (its receipt says "verifying") until the read-back answers."""
    provider = InDoubt(Verdict.COMMITTED, lost=True)
    await ended_child_then_cancel(ledger, provider)
    await provider.reading.wait()
    while (await ledger.backend.get_run("p")).state is RunState.CANCELLING:
        await ledger.wait_for_change("p")  # the parent's first step after the cancel
    parent = await ledger.receipt("p")
    assert parent.headline is Headline.VERIFYING
    assert parent.run_state is RunState.SETTLING  # not cancelled beside "verifying"
    provider.answer.set()
    settled = await ledger.wait_settled("p", timeout=20)
    assert settled.run_state is RunState.CANCELLED
    assert settled.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    verified = max(e.seq for e in await ledger.backend.events("p:deployer"))
    (done,) = [e for e in await ledger.backend.events("p") if e.kind == "settled"]
    assert done.seq > verified  # the parent settled after its child's call was read back


async def test_a_cancelled_parent_goes_to_review_with_a_child_that_ended_in_doubt(
    ledger: stopline.Ledger,
) -> None:
    """The ended child's call has no read-back: it goes to review, and so does the
    parent, until the review is resolved."""
    provider = InDoubt(None, lost=True)
    await ended_child_then_cancel(ledger, provider)
    receipt = await ledger.wait_settled("p", timeout=20)
    assert receipt.run_state is RunState.NEEDS_REVIEW
    assert receipt.headline is Headline.NEEDS_REVIEW
    (item,) = await ledger.review_items()
    await ledger.resolve_review(item.op.id, "not_committed", by="user:1")
    settled = await ledger.wait_settled("p", timeout=20)
    assert settled.run_state is RunState.CANCELLED
    assert (await ledger.backend.get_run("p:deployer")).state is RunState.COMPLETED


async def test_a_cancelled_parent_goes_to_review_with_an_ended_childs_correction_in_review(
    ledger: stopline.Ledger,
) -> None:
    """The ended child's call committed and was corrected by hand; the correction acted,
    then its code raised (no read-back): it waits for a reviewer, and the original,
    being corrected, with it (``transitions.awaits_review``). The parent's cancel read
    the child's ``compensating`` original as a correction under way and stayed
    ``settling`` for ever; it goes to review, as its receipt says."""
    corrected: list[str] = []

    async def deploy(ctx: stopline.CallContext) -> str:
        return "deployed"

    tool = stopline.Tool(deploy, name="deploy")

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        corrected.append("rollback")
        raise RuntimeError("rolled back, then the connection dropped")

    parent_ready = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def parent() -> None:
            async with ledger.run("parent", owner="user:1", run_id="p") as run:
                async with run.child("deployer") as sub:
                    await sub.call(tool, key="deploy")
                parent_ready.set()
                await anyio.sleep_forever()

        tg.start_soon(parent)
        await parent_ready.wait()
        (op,) = await ledger.backend.operations("p:deployer")
        await ledger.compensate(op.id, by="user:1", reason="roll it back")
        assert (await ledger.backend.get_operation(op.id)).status.value == "compensating"
        await ledger.cancel("p", by="user:1")
    receipt = await ledger.wait_settled("p", timeout=20)  # a guard: it never settled
    assert receipt.run_state is RunState.NEEDS_REVIEW
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert corrected == ["rollback"]
    (item,) = await ledger.review_items()
    await ledger.resolve_review(item.op.id, "committed", by="user:1", note="rolled back")
    settled = await ledger.wait_settled("p", timeout=20)
    assert settled.run_state is RunState.CANCELLED
