"""A parent's children across a stop and a resume (R10, R14; ADR 0053).

A resumed parent runs its workflow from the start; the children it opens must be
the runs it opened before, or their completed actions are sent again under new
keys. A resume moves the tree its pause or cancel stopped.
"""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.errors import RunEnded

pytestmark = pytest.mark.timeout(30)


class Provider:
    def __init__(self) -> None:
        self.sent: list[str] = []

        async def send(ctx: stopline.CallContext, text: str) -> str:
            self.sent.append(ctx.key)
            return f"sent {text}"

        self.tool = stopline.Tool(send)


async def workflow(
    ledger: stopline.Ledger, provider: Provider, *, cancel: bool, extra: bool = False
) -> None:
    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        async with run.child("sub") as sub:
            assert await sub.call(provider.tool, "hello", key="send") == "sent hello"
            if extra:
                await sub.call(provider.tool, "more", key="more")
        if cancel:
            await ledger.cancel(run.id, by="user:1")
        await run.call(provider.tool, "summary", key="summary")


async def test_a_resumed_parent_reaches_the_child_it_opened_and_repeats_nothing(
    ledger: stopline.Ledger,
) -> None:
    """``run.child(name)`` took a random id: the parent's receipt said its child's send
    "is returned from the ledger, not repeated", and following it sent it again."""
    provider = Provider()
    await workflow(ledger, provider, cancel=True)
    receipt = await ledger.wait_settled("r", timeout=10)
    assert "1 completed action is returned from the ledger" in receipt.resume_rule
    assert (await ledger.backend.get_run("r:sub")).state is RunState.COMPLETED
    await ledger.resume("r", by="user:1")
    await workflow(ledger, provider, cancel=False)  # the same workflow, followed literally
    assert provider.sent == ["r:sub/send", "r/summary"]
    assert (await ledger.backend.get_run("r:sub")).state is RunState.COMPLETED
    assert (await ledger.receipt("r")).headline is stopline.Headline.COMPLETED


async def test_a_replayed_child_refuses_a_call_it_never_made_and_writes_nothing(
    ledger: stopline.Ledger,
) -> None:
    provider = Provider()
    await workflow(ledger, provider, cancel=True)
    await ledger.wait_settled("r", timeout=10)
    await ledger.resume("r", by="user:1")
    before = await ledger.backend.events("r:sub")
    with pytest.raises(RunEnded, match="'r:sub/more'"):
        await workflow(ledger, provider, cancel=False, extra=True)
    assert provider.sent == ["r:sub/send"]
    assert await ledger.backend.events("r:sub") == before


async def test_children_of_one_name_are_numbered_in_the_order_they_open(
    ledger: stopline.Ledger,
) -> None:
    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        ids = []
        for _ in range(3):
            async with run.child("step") as child:
                ids.append(child.id)
        async with run.child("other", run_id="mine") as named:
            ids.append(named.id)
        long_name = "n" * 1024
        async with run.child(long_name) as long:
            ids.append(long.id)
    assert ids[:4] == ["r:step", "r:step.2", "r:step.3", "mine"]
    assert len(ids[4]) <= 1024 and "#sha256:" in ids[4]  # fitted, stable


async def test_resuming_a_paused_parent_resumes_the_children_its_pause_stopped(
    ledger: stopline.Ledger,
) -> None:
    """A pause stops the tree; the resume moved only its root, and the child's next
    call waited for ever."""
    provider = Provider()
    async with ledger.run("parent", owner="user:1", run_id="r") as run, run.child("sub") as sub:
        await sub.call(provider.tool, "a", key="a")
        await ledger.pause("r", by="user:1")
        assert (await ledger.backend.get_run("r:sub")).state is RunState.PAUSED
        await ledger.resume("r", by="user:1")
        assert (await ledger.backend.get_run("r:sub")).state is RunState.RUNNING
        with anyio.fail_after(10):  # a hang fails, it is not a timing
            assert await sub.call(provider.tool, "b", key="b") == "sent b"
    assert provider.sent == ["r:sub/a", "r:sub/b"]


async def test_resuming_a_cancelled_parent_resumes_its_cancelled_children(
    ledger: stopline.Ledger,
) -> None:
    provider = Provider()

    async def tree(cancel: bool) -> None:
        async with ledger.run("parent", owner="user:1", run_id="r") as run, run.child("sub") as sub:
            await sub.call(provider.tool, "a", key="a")
            if cancel:
                await ledger.cancel("r", by="user:1")
            await sub.call(provider.tool, "b", key="b")

    await tree(cancel=True)
    await ledger.wait_settled("r", timeout=10)
    assert (await ledger.backend.get_run("r:sub")).state is RunState.CANCELLED
    await ledger.resume("r", by="user:1")
    assert (await ledger.backend.get_run("r:sub")).state is RunState.RUNNING
    await tree(cancel=False)
    assert provider.sent == ["r:sub/a", "r:sub/b"]  # a replayed, b sent once


async def test_a_tree_resumes_only_when_its_childrens_operations_are_resolved(
    ledger: stopline.Ledger,
) -> None:
    """R10 over the tree: a child's operation in review blocks the parent's resume,
    and nothing of the tree moves. The child ended on its own before the cancel: its
    parent goes to review with it (ADR 0058), and says what to do first."""

    async def lost(ctx: stopline.CallContext) -> str:
        raise ConnectionResetError("the answer was lost")  # no verifier: review

    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        async with run.child("sub") as sub:
            with pytest.raises(ConnectionResetError):
                await sub.call(stopline.Tool(lost), key="pay")
        await ledger.cancel("r", by="user:1")
    await ledger.wait_settled("r", timeout=10)
    op = await ledger.backend.get_operation("r:sub/pay")
    assert op.status is OpStatus.NEEDS_REVIEW
    assert (await ledger.backend.get_run("r")).state is RunState.NEEDS_REVIEW
    with pytest.raises(RunEnded, match="resolve its review items"):
        await ledger.resume("r", by="user:1")
    assert (await ledger.backend.get_run("r")).state is RunState.NEEDS_REVIEW
    assert (await ledger.backend.get_run("r:sub")).state is RunState.COMPLETED


async def test_no_name_reads_as_another_childs_number_or_a_grandchild(
    ledger: stopline.Ledger,
) -> None:
    """A child named ``a.2`` took the id of the second child named ``a`` and replayed
    its record (a message reported sent was never sent); a child named ``a:b`` met the
    grandchild ``b`` of ``a``. Names are written so that no two children meet."""
    provider = Provider()
    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        for name in ("a", "a"):
            async with run.child(name) as child, child.child("b") as grandchild:
                await grandchild.call(provider.tool, "to b", key="send")
        async with run.child("a.2") as dotted, run.child("a:b") as coloned:
            assert not dotted.replaying and not coloned.replaying
            await dotted.call(provider.tool, "hello", key="send")
            await coloned.call(provider.tool, "hello", key="send")
        long = "n" * 1020
        async with run.child(long) as named:  # its calls' keys still fit
            await named.call(provider.tool, "long", key="send")
    assert len(provider.sent) == 5 == len(set(provider.sent))
    assert provider.sent[:4] == ["r:a:b/send", "r:a.2:b/send", "r:a%2E2/send", "r:a%3Ab/send"]


async def test_a_paused_parents_resume_leaves_a_child_cancelled_on_its_own(
    ledger: stopline.Ledger,
) -> None:
    """The pause stopped only what was running: a child cancelled before it came back
    to ``running`` with the resume, and a queued redelivery of its refused call went
    through (R1)."""
    provider = Provider()
    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        async with run.child("worker") as worker:
            await worker.call(provider.tool, "one", key="one")
            await ledger.cancel(worker.id, by="user:1")
        await ledger.wait_settled("r:worker", timeout=10)
        await ledger.pause("r", by="user:1")
        await ledger.resume("r", by="user:1")
        assert (await ledger.backend.get_run("r:worker")).state is RunState.CANCELLED
        with pytest.raises(stopline.RunFenced):  # a queue's redelivery, after the resume
            await ledger.dispatch("r:worker", provider.tool, "two", key="two")
    assert provider.sent == ["r:worker/one"]


async def test_a_replayed_child_opens_no_new_child(ledger: stopline.Ledger) -> None:
    provider = Provider()
    await workflow(ledger, provider, cancel=True)
    await ledger.wait_settled("r", timeout=10)
    await ledger.resume("r", by="user:1")
    async with ledger.run("parent", owner="user:1", run_id="r") as run, run.child("sub") as sub:
        assert sub.replaying
        with pytest.raises(RunEnded, match="another child"):
            async with sub.child("extra"):
                pass
    assert provider.sent == ["r:sub/send"]


async def tree_with_an_ended_child(
    ledger: stopline.Ledger, provider: Provider, *, cancel: bool, fails: bool
) -> None:
    """A parent whose child ends on its own (``fails``: the child's block raises after
    its provider refused a call; else the child catches the refusal and completes),
    then goes on and is cancelled."""

    async def refuse(ctx: stopline.CallContext, text: str) -> str:
        raise stopline.Rejected("not now")  # nothing was done

    refusing = stopline.Tool(refuse, name="refuse")
    async with ledger.run("parent", owner="user:1", run_id="r") as run:
        try:
            async with run.child("sub") as sub:
                await sub.call(provider.tool, "hello", key="send")
                try:
                    await sub.call(refusing, "x", key="refused")
                except stopline.Rejected:
                    if fails:
                        raise
        except stopline.Rejected:
            pass
        if cancel:
            await ledger.cancel(run.id, by="user:1")
        await run.call(provider.tool, "summary", key="summary")


async def test_a_failed_childs_actions_are_not_counted_as_sent_or_returned_on_resume(
    ledger: stopline.Ledger,
) -> None:
    """A resumed parent's re-entry of a child that failed raises ``RunEnded``: the
    recovery line counted the child's refused call as "sent when the workflow reaches
    it" and its send as "returned from the ledger", and neither happens."""
    provider = Provider()
    await tree_with_an_ended_child(ledger, provider, cancel=True, fails=True)
    assert (await ledger.backend.get_run("r:sub")).state is RunState.FAILED
    receipt = await ledger.wait_settled("r", timeout=10)
    rule = receipt.resume_rule
    assert "0 completed actions are returned" in rule
    assert "1 action that never happened is sent" in rule  # the summary, fenced
    assert "2 actions of child runs that ended on their own are not sent again" in rule
    assert "entering a child run that failed ('r:sub') raises RunEnded" in rule
    # the same line on every receipt path
    assert (await ledger.receipts(["r"]))["r"].resume_rule == rule
    listed = {run.id: r for run, r in await ledger.runs_with_receipts()}
    assert listed["r"].resume_rule == rule
    # followed: the re-entry meets RunEnded at the child, whose message sends nothing again
    await ledger.resume("r", by="user:1")
    with pytest.raises(RunEnded, match="none of its actions is sent again") as ended:
        await tree_with_an_ended_child(ledger, provider, cancel=False, fails=True)
    assert "start a new run" not in str(ended.value)
    assert provider.sent == ["r:sub/send"]


async def test_a_completed_childs_call_that_never_happened_is_not_counted_as_sent(
    ledger: stopline.Ledger,
) -> None:
    """A completed child replays: its send is returned from the ledger, and its refused
    call, reached again, raises ``RunEnded`` (the line said it would be sent)."""
    provider = Provider()
    await tree_with_an_ended_child(ledger, provider, cancel=True, fails=False)
    assert (await ledger.backend.get_run("r:sub")).state is RunState.COMPLETED
    rule = (await ledger.wait_settled("r", timeout=10)).resume_rule
    assert "1 completed action is returned" in rule
    assert "1 action that never happened is sent" in rule  # the summary, fenced
    assert "1 action of child runs that ended on their own is not sent again" in rule
    assert "a call that never happened in a child run that completed ('r:sub')" in rule
    await ledger.resume("r", by="user:1")
    with pytest.raises(RunEnded, match="'r:sub/refused'"):
        await tree_with_an_ended_child(ledger, provider, cancel=False, fails=False)
    assert provider.sent == ["r:sub/send"]


async def test_a_grandchilds_actions_under_a_failed_child_are_not_counted_as_returned(
    ledger: stopline.Ledger,
) -> None:
    """Entering a failed child raises ``RunEnded``: nothing under it is reached, its
    completed grandchild's send included (read through the chain of runs)."""
    provider = Provider()

    async def tree(cancel: bool) -> None:
        async with ledger.run("parent", owner="user:1", run_id="r") as run:
            try:
                async with run.child("sub") as sub:
                    async with sub.child("deep") as deep:
                        await deep.call(provider.tool, "hello", key="send")
                    raise LookupError("the child fails after its grandchild completed")
            except LookupError:
                pass
            if cancel:
                await ledger.cancel(run.id, by="user:1")

    await tree(cancel=True)
    assert (await ledger.backend.get_run("r:sub:deep")).state is RunState.COMPLETED
    rule = (await ledger.wait_settled("r", timeout=10)).resume_rule
    assert "0 completed actions are returned" in rule
    assert "1 action of child runs that ended on their own is not sent again" in rule
    assert "entering a child run that failed ('r:sub')" in rule
    await ledger.resume("r", by="user:1")
    with pytest.raises(RunEnded, match="'r:sub'"):
        await tree(cancel=False)
    assert provider.sent == ["r:sub:deep/send"]
