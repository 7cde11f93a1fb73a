"""Probe 7: a cancelled tree follows a change of a call below its root made after the
run holding that call had settled (a correction ends or fails, a review is decided, a
late result comes). A real ledger, SQLite and PostgreSQL.

P owns a, which owns b. A correction runs in a second process on the same ledger
(``stopline.open`` of the same URL): the process running the tree is then idle while
it runs, so what each process stepped, and when, is known (one process counts its own
running correction as work under way)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

import stopline
from stopline import OpStatus, ReadBack, RunState, Verdict
from stopline.domain.vocab import Headline
from tests.conftest import FAST_VERIFY
from tests.truth.helpers import quiesce

ROOT, CHILD, GRANDCHILD = "P", "P:a", "P:a:b"
GUARD = 30  # seconds: a hang guard, not a timing (a loaded machine is slow)


class Held:
    """A tool whose calls commit, then wait for the test; so do its corrections. Cut
    meanwhile, a call has committed all the same (its read-back finds it), unless
    ``verifiable`` is off: then it goes to review. One that ``drops`` commits nothing,
    and loses its connection once let go."""

    def __init__(
        self,
        name: str,
        *,
        refuse_correction: bool = False,
        verifiable: bool = True,
        drops: bool = False,
    ) -> None:
        self.called = anyio.Event()
        self.let_call = anyio.Event()
        self.correcting = anyio.Event()
        self.let_correct = anyio.Event()
        self.refuse_correction = refuse_correction
        self.drops = drops
        self.committed: set[str] = set()
        self.tool: stopline.Tool[Any] = stopline.Tool(self._call, name=name, description=name)
        self.tool.wants_context = True
        if verifiable:
            self.tool.verify_fn = self._verify
        self.tool.compensate_fn = self._correct

    def let_go(self) -> None:
        """Every held call and correction goes on (a failing test ends)."""
        self.let_call.set()
        self.let_correct.set()

    async def _call(self, ctx: stopline.CallContext) -> str:
        if not self.drops:
            self.committed.add(ctx.key)
        self.called.set()
        await self.let_call.wait()
        if self.drops:
            raise ConnectionResetError("connection dropped before the response")
        return "sent"

    async def _verify(self, ctx: stopline.CallContext) -> ReadBack:
        if ctx.key in self.committed:
            return ReadBack(Verdict.COMMITTED, ctx.key, "found by key")
        return ReadBack(Verdict.NOT_COMMITTED, detail="no such key")

    async def _correct(self, ctx: stopline.CallContext) -> str:
        self.correcting.set()
        await self.let_correct.wait()
        if self.refuse_correction:
            raise stopline.Rejected("too late to recall", ref=f"recall:{ctx.key}")
        return "recalled"


async def _state(ledger: stopline.Ledger, run_id: str) -> RunState:
    return (await ledger.backend.get_run(run_id)).state


async def _until(ledger: stopline.Ledger, run_id: str, *states: RunState) -> None:
    with anyio.fail_after(GUARD):
        while await _state(ledger, run_id) not in states:
            await ledger.wait_for_change(run_id)


async def _root_settled(
    ledger: stopline.Ledger, headline: Headline, op_id: str, status: OpStatus
) -> None:
    """P is ``cancelled``, its receipt settled with ``headline``, the mail's line
    ``status``."""
    assert await _state(ledger, ROOT) is RunState.CANCELLED
    receipt = await ledger.receipt(ROOT)
    assert receipt.settled
    assert receipt.headline is headline
    assert {line.op_id: line.status for line in receipt.lines}[op_id] is status


async def _review_keeps_the_mail(ledger: stopline.Ledger, op_id: str, root: RunState) -> None:
    """The mail is in review, P in ``root`` with a receipt saying review; a reviewer
    decides the mail was sent."""
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    assert await _state(ledger, ROOT) is root
    assert (await ledger.receipt(ROOT)).headline is Headline.NEEDS_REVIEW
    assert [item.op.id for item in await ledger.review_items()] == [op_id]
    await ledger.resolve_review(op_id, "committed", by="me", note="the mail was sent")
    await quiesce(ledger)


@asynccontextmanager
async def _cancelled_tree(
    ledger: stopline.Ledger, mail: Held, own: Held | None = None
) -> AsyncIterator[str]:
    """P (with ``own``: its own call, held past the cancel) owns a, which owns b, whose
    mail is held; P is cancelled, then the mail let go. Yields the mail's operation id
    once b has settled; every held call is let go on leaving."""
    ledger.register_tool(mail.tool)

    async def below(run: stopline.Run) -> None:
        calling = stopline.PhaseKind.CALLING_EXTERNAL
        async with run.child("a") as a, a.child("b") as b, b.phase(calling):
            await b.call(mail.tool, key="mail")

    async def body() -> None:
        async with (
            ledger.run("p", owner="me", run_id=ROOT) as run,
            anyio.create_task_group() as tree,
        ):
            tree.start_soon(below, run)
            if own is not None:  # a cancel waits for the call of this phase
                async with run.phase(stopline.PhaseKind.WAITING_CALLBACK):
                    await run.call(own.tool, key="own")

    async with anyio.create_task_group() as tg:
        try:
            tg.start_soon(body)
            with anyio.fail_after(GUARD):
                await mail.called.wait()
                if own is not None:
                    await own.called.wait()
            await ledger.cancel(ROOT, by="me")
            mail.let_call.set()
            await _until(ledger, GRANDCHILD, RunState.CANCELLED, RunState.NEEDS_REVIEW)
            yield f"{GRANDCHILD}/mail"
        finally:
            for held in (mail, own):
                if held is not None:
                    held.let_go()


async def _correct_elsewhere(ledger: stopline.Ledger, url: str, mail: Held, own: Held) -> None:
    """While P waits for its own call, another process starts the correction of b's
    mail (b and a have settled); then P's call ends: P waits for the correction."""
    async with stopline.open(url, verify=FAST_VERIFY, tools=[mail.tool]) as other:
        await _until(ledger, CHILD, RunState.CANCELLED)
        assert await _state(ledger, ROOT) is RunState.CANCELLING  # its own call runs
        op_id = f"{GRANDCHILD}/mail"
        await other.compensate(op_id, by="me", wait=False)
        with anyio.fail_after(GUARD):
            await mail.correcting.wait()
        own.let_call.set()
        await _until(ledger, ROOT, RunState.SETTLING)
        await quiesce(ledger)  # every step of P's process done: it waits for the correction
        assert await _state(ledger, ROOT) is RunState.SETTLING
        mail.let_correct.set()
        await quiesce(other)
    await quiesce(ledger)


async def test_a_correction_ending_in_a_settled_grandchild_settles_the_cancelled_root(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """A correction started in a settled grandchild while its cancelled root still
    settled: its end was never carried up (a settled run's step woke no owner), and the
    root stayed ``settling`` for ever beside a receipt that said "corrected"."""
    mail, own = Held("mail"), Held("own")
    async with _cancelled_tree(ledger, mail, own) as op_id:
        await _correct_elsewhere(ledger, ledger_url, mail, own)
    assert await _state(ledger, CHILD) is RunState.CANCELLED
    # P's own call completed: the headline is that, the mail's line says corrected
    await _root_settled(
        ledger, Headline.STOPPED_WITH_COMPLETED_ACTIONS, op_id, OpStatus.COMPENSATED
    )


async def test_a_correction_failing_in_a_settled_grandchild_sends_the_root_to_review(
    ledger: stopline.Ledger, ledger_url: str
) -> None:
    """The same correction refused by the provider: the mail goes to review, and so
    does the root (it stayed ``settling``, its receipt saying review). The reviewer's
    decision then settles the root: ``cancelled``, with the mail kept as completed."""
    mail, own = Held("mail", refuse_correction=True), Held("own")
    async with _cancelled_tree(ledger, mail, own) as op_id:
        await _correct_elsewhere(ledger, ledger_url, mail, own)
        await _review_keeps_the_mail(ledger, op_id, RunState.NEEDS_REVIEW)
    await _root_settled(ledger, Headline.STOPPED_WITH_COMPLETED_ACTIONS, op_id, OpStatus.COMMITTED)


async def test_a_review_decided_in_a_grandchild_after_the_cancel_settles_the_root(
    ledger: stopline.Ledger,
) -> None:
    """b's mail, cut by the cancel, has no read-back: b, a and P go to review; the
    reviewer's decision on b's mail settles all three (``cancelled``), and P's receipt
    says what was decided."""
    mail = Held("mail", verifiable=False)
    async with _cancelled_tree(ledger, mail) as op_id:
        pass  # b settled: in review
    await quiesce(ledger)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NEEDS_REVIEW
    for run_id in (GRANDCHILD, CHILD, ROOT):
        assert await _state(ledger, run_id) is RunState.NEEDS_REVIEW
    await ledger.resolve_review(op_id, "not_committed", by="me", note="never sent")
    await quiesce(ledger)
    for run_id in (GRANDCHILD, CHILD):
        assert await _state(ledger, run_id) is RunState.CANCELLED
    await _root_settled(
        ledger, Headline.CANCELED_BEFORE_EXTERNAL_ACTION, op_id, OpStatus.NOT_COMMITTED
    )


@pytest.mark.parametrize("root_waits", [True, False], ids=["root-waits", "root-settled"])
async def test_a_late_result_in_a_settled_grandchild_reaches_the_root(
    ledger: stopline.Ledger, root_waits: bool
) -> None:
    """b's mail lost its answer and was read back as never sent (b settles); a late
    response then says it was sent: the mail goes to review. While P waits for its
    own call, P goes to review with it, and the reviewer's decision settles P (a
    settled run's step woke no owner: P stayed in review, its receipt saying the mail
    completed). Once P has settled, b, a and P go back to review with the mail (ADR
    0093: a settled cancel is reopened by its evidence)."""
    mail, own = Held("mail", drops=True), Held("own") if root_waits else None
    async with _cancelled_tree(ledger, mail, own) as op_id:
        await _until(ledger, CHILD, RunState.CANCELLED)
        await quiesce(ledger)
        assert (await ledger.backend.get_operation(op_id)).status is OpStatus.NOT_COMMITTED
        root = RunState.CANCELLING if root_waits else RunState.CANCELLED
        assert await _state(ledger, ROOT) is root
        await ledger.late_response(op_id, Verdict.COMMITTED, result="sent", ref="mail:late")
        await quiesce(ledger)
        assert await _state(ledger, GRANDCHILD) is RunState.NEEDS_REVIEW  # reopened
        if own is not None:
            own.let_call.set()
            await _until(ledger, ROOT, RunState.NEEDS_REVIEW)
            await quiesce(ledger)
        await _review_keeps_the_mail(ledger, op_id, RunState.NEEDS_REVIEW)
    await _root_settled(ledger, Headline.STOPPED_WITH_COMPLETED_ACTIONS, op_id, OpStatus.COMMITTED)


async def test_a_correction_made_as_a_cancelled_tree_settles_settles_its_root(
    ledger: stopline.Ledger,
) -> None:
    """What a user did, in one process: cancel P, and once every call of the tree is
    resolved, correct b's mail. The correction ended while P still settled, or after:
    P stayed ``settling`` (most runs: the order is the settler's, not the user's), its
    receipt saying "corrected"."""
    mail = Held("mail")
    mail.let_correct.set()
    async with _cancelled_tree(ledger, mail) as op_id:
        with anyio.fail_after(GUARD):
            await ledger.compensate(op_id, by="me")
        receipt = await ledger.wait_settled(ROOT, timeout=GUARD)
    assert (await ledger.backend.get_operation(op_id)).status is OpStatus.COMPENSATED
    assert receipt.run_state is RunState.CANCELLED
    assert receipt.headline is Headline.CORRECTED
