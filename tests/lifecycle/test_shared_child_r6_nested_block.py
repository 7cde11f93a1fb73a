"""R6: an owner's cancel that interrupts a shared child's block does not end the child
while another owner holds it (ADR 0065, 3).

A shared child ``S`` (created by ``A``, shared with ``B``) whose ``async with`` sits
inside ``A``'s block is interrupted by ``A``'s cancel: anyio cancels every scope inside
a cancelled one (documented, kept: stopline shields no block). Before, the ledger then
recorded ``S`` ``failed`` ("CancelledError: Cancelled via cancel scope ...") although
``A``'s cancel had let it go to ``B``, and ``B`` could not go on with it (``RunEnded``).
Now ``S`` stays ``running`` for ``B``, which re-enters it by its id. Decided: only a
run's cancel, delivered to a block around it, leaves it so; an outside cancellation
(the application's own scope) ends it as before, and so does ``A``'s cancel when no
owner that can go on holds it, or when the ledger cannot say.
"""

from __future__ import annotations

import logging

import anyio
import pytest

import stopline
from stopline import PhaseKind, Policy, ReadBack, RunState, Verdict
from stopline.errors import LedgerIOError, RunEnded
from stopline.ledger.forwarding import ForwardingBackend
from tests.conftest import FAST_VERIFY

pytestmark = pytest.mark.trio_too


@stopline.tool
async def note(ctx: stopline.CallContext, text: str) -> str:
    return text


async def _kinds(ledger: stopline.Ledger, run_id: str) -> list[str]:
    return [e.kind for e in await ledger.backend.events(run_id)]


async def _a_cancelled_around_s(
    ledger: stopline.Ledger, b_id: str, *, in_a_task: bool = False
) -> list[str]:
    """``A``'s block holding shared ``S``'s block (shared with ``b_id``), directly or in
    a task of a task group opened inside it (``in_a_task``), and ``A`` cancelled while
    ``S``'s code waits: what ``S``'s code saw."""
    seen: list[str] = []
    waiting = anyio.Event()

    async def shared(a_id: str) -> None:
        async with ledger.run("s", owner="u", run_id="S", parent_id=a_id, shared=True) as s:
            await ledger.share(s.id, with_owner=b_id, by="u")
            await s.call(note, "before")
            waiting.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                seen.append("interrupted")
                raise

    async def owner_a() -> None:
        async with ledger.run("a", owner="u", run_id="A") as a:
            if not in_a_task:
                await shared(a.id)
                return
            async with anyio.create_task_group() as inside:
                inside.start_soon(shared, a.id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(owner_a)
        await waiting.wait()
        await ledger.cancel("A", by="u")
    return seen


@pytest.mark.parametrize("in_a_task", [False, True], ids=["in_its_block", "in_a_task_of_it"])
async def test_an_owners_cancel_leaves_the_nested_shared_child_to_its_other_owner(
    ledger: stopline.Ledger, in_a_task: bool
) -> None:
    async with ledger.run("b", owner="u", run_id="B") as b:
        cut = await _a_cancelled_around_s(ledger, b.id, in_a_task=in_a_task)
        assert cut == ["interrupted"]  # its code was cut
        assert (await ledger.reads.run("A")).state is RunState.CANCELLED
        assert (await ledger.reads.run("S")).state is RunState.RUNNING  # was: failed
        assert "fail" not in await _kinds(ledger, "S")
        async with ledger.run("s", owner="u", run_id="S", parent_id="A", shared=True) as s:
            assert await s.call(note, "after", key="after") == "after"  # B goes on
    assert (await ledger.reads.run("S")).state is RunState.COMPLETED
    receipt = await ledger.receipt("S")
    assert [line.status.value for line in receipt.lines] == ["committed", "committed"]


async def test_its_interrupted_call_is_read_back_and_its_provider_not_asked(
    ledger_url: str,
) -> None:
    """A call of ``S`` in flight when ``A``'s cancel cuts its block: recorded as it was
    (in doubt, then read back), and no cancel asked of its provider (``S`` was not
    cancelled); ``S`` stays ``running``."""
    sent, asked = anyio.Event(), []

    async def deploy(ctx: stopline.CallContext) -> None:
        sent.set()
        await anyio.sleep_forever()

    tool = stopline.Tool(deploy, name="deploy")

    @tool.verifier
    async def read(ctx: stopline.CallContext) -> ReadBack:
        return ReadBack(Verdict.COMMITTED, "deploy:log", "deployed", ended=True)

    @tool.canceller
    async def cancel_deploy(ctx: stopline.CallContext) -> None:
        asked.append(ctx.op_id)

    async with stopline.open(ledger_url, verify=FAST_VERIFY) as ledger:
        async with ledger.run("b", owner="u", run_id="B") as b:

            async def owner_a() -> None:
                async with (
                    ledger.run("a", owner="u", run_id="A") as a,
                    ledger.run("s", owner="u", run_id="S", parent_id=a.id, shared=True) as s,
                ):
                    await ledger.share(s.id, with_owner=b.id, by="u")
                    async with s.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
                        await s.call(tool, key="deploy")

            async with anyio.create_task_group() as tg:
                tg.start_soon(owner_a)
                await sent.wait()
                await ledger.cancel("A", by="u")
            await ledger.wait_idle()
            (op,) = await ledger.backend.operations("S")
            assert op.status.value == "committed"  # read back
            assert asked == []
            assert (await ledger.reads.run("S")).state is RunState.RUNNING
            await ledger.cancel(b.id, by="u")  # the last owner: S fenced with it
        settled = await ledger.wait_settled("S", timeout=30)
        assert settled.run_state is RunState.CANCELLED


async def test_with_no_owner_left_that_can_go_on_it_ends_as_before(
    ledger: stopline.Ledger,
) -> None:
    """``B`` completed before ``A``'s cancel: nobody can go on with ``S``, so its block's
    end ends it (``failed``, as any block an outside cancellation interrupts)."""
    async with ledger.run("b", owner="u", run_id="B") as b:
        pass
    assert (await ledger.reads.run(b.id)).state is RunState.COMPLETED
    assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
    assert (await ledger.reads.run("S")).state is RunState.FAILED


async def test_the_applications_own_cancellation_ends_it_as_before(
    ledger: stopline.Ledger,
) -> None:
    """Decided: only a run's cancel delivered to a block around it leaves the shared
    run to its other owners. The application's own scope cancelling the block (its
    timeout, its task group) is its decision about that run: ended, as before."""
    async with ledger.run("b", owner="u", run_id="B") as b, ledger.run("a", owner="u") as a:
        with anyio.CancelScope() as outside:
            async with ledger.run("s", owner="u", run_id="S", parent_id=a.id, shared=True) as s:
                await ledger.share(s.id, with_owner=b.id, by="u")
                outside.cancel()
                await anyio.sleep_forever()
        assert (await ledger.reads.run("S")).state is RunState.FAILED
        with pytest.raises(RunEnded):
            async with ledger.run("s", owner="u", run_id="S"):
                pass


class OwnersUnreadable(ForwardingBackend):
    async def leave_to_owners(self, run_id: str, *, cut_by: str) -> list[str]:
        raise LedgerIOError(self.location, "the owners' read failed (injected)")


async def test_where_the_ledger_cannot_say_who_holds_it_it_ends_as_before(
    ledger_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The owners cannot be read at the block's end: the run is ended, as before the
    change (never a run left ``running`` that nobody may hold), and the log says why."""
    async with (
        stopline.open(ledger_url, observers=[OwnersUnreadable]) as ledger,
        ledger.run("b", owner="u", run_id="B") as b,
    ):
        with caplog.at_level(logging.WARNING, logger="stopline.runs"):
            assert await _a_cancelled_around_s(ledger, b.id) == ["interrupted"]
        assert (await ledger.reads.run("S")).state is RunState.FAILED
        assert any("owners could not be read" in r.getMessage() for r in caplog.records)
