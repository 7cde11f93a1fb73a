"""R13 where a horizon comes from: a peek at a long-accepted call, a provider's stated
bound across a crash, a correction's lost answer, and a read-back that never answers.

Each provider here commits on its own after the first read found nothing; a
read-back before the horizon must prove nothing, whatever path took it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Compensation, OpStatus, ReadBack, Verdict, VerifyBudget
from stopline.errors import InvalidInput
from tests.rules.horizon_worker import HORIZON_TOOL

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


class Deploy:
    """A provider that accepts a job and finishes it on its own, later."""

    def __init__(self, settles_within: float | None) -> None:
        self.done: set[str] = set()
        self.accepted = anyio.Event()
        self.finish = anyio.Event()
        self.reads = 0

        async def deploy(ctx: stopline.CallContext) -> str:
            await ctx.accepted("job-1")
            self.accepted.set()
            await self.finish.wait()
            self.done.add(ctx.key)
            return "deployed"

        self.tool = stopline.Tool(deploy, settles_within=settles_within)

        @self.tool.verifier
        async def _(ctx: stopline.CallContext) -> ReadBack:
            self.reads += 1
            found = ctx.key in self.done
            return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, ref=ctx.key)


@pytest.mark.parametrize("settles_within", [60.0, None])
async def test_r13_a_peek_at_a_long_accepted_call_before_its_horizon_proves_nothing(
    ledger: stopline.Ledger, settles_within: float | None
) -> None:
    """``reconcile`` peeks at calls accepted long ago; a "not found" while the provider
    may still finish (before the declared horizon; or, with none declared, while the
    call is still in flight) left them ``not_committed``, and the receipt told the
    user to send them again."""
    provider = Deploy(settles_within)
    async with anyio.create_task_group() as tg:

        async def work() -> None:
            async with ledger.run("ship", owner="user:1", run_id="r") as run:
                await run.call(provider.tool, key="deploy")

        tg.start_soon(work)
        await provider.accepted.wait()
        summary = await ledger.reconcile(tools=[provider.tool], accepted_after=0)
        assert provider.reads == 1  # it looked, and found nothing yet
        assert summary.still_accepted == ("r/deploy",) and not summary.not_committed
        assert (await ledger.backend.get_operation("r/deploy")).status is OpStatus.ACCEPTED
        provider.finish.set()
    op = await ledger.backend.get_operation("r/deploy")
    assert op.status is OpStatus.COMMITTED and provider.done == {"r/deploy"}


async def test_r13_a_peek_after_the_horizon_proves_not_committed(
    ledger: stopline.Ledger,
) -> None:
    """Past its horizon, a call still accepted that the provider does not have never
    will be: the peek proves it (the rule the guard above must not weaken)."""
    provider = Deploy(settles_within=0.0)
    async with anyio.create_task_group() as tg:

        async def work() -> None:
            with pytest.raises(stopline.errors.StoplineError):
                async with ledger.run("ship", owner="user:1", run_id="r") as run:
                    await run.call(provider.tool, key="deploy")

        tg.start_soon(work)
        await provider.accepted.wait()
        summary = await ledger.reconcile(tools=[provider.tool], accepted_after=0)
        assert summary.not_committed == ("r/deploy",)
        tg.cancel_scope.cancel()


def _kill_after_statement(url: str, at: float) -> None:
    """Run the worker until its tool has stated the horizon, then SIGKILL it."""
    with subprocess.Popen(
        [sys.executable, "-m", "tests.rules.horizon_worker", url, repr(at)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "stated"
        finally:
            os.kill(worker.pid, signal.SIGKILL)


async def test_r13_a_horizon_the_provider_stated_outlives_the_worker(ledger_url: str) -> None:
    """The tool states its provider's bound (``ctx.settles_by``); the worker is killed.
    The bound was held in memory only: recovery marked the call ``unknown`` with no
    horizon, the first "not found" proved it never happened, and the receipt said to
    send it again while the transfer was still landing."""
    stated = time.time() + 60
    await anyio.to_thread.run_sync(_kill_after_statement, ledger_url, stated)
    read = anyio.Event()

    async def transfer(ctx: stopline.CallContext, amount: int) -> str:
        raise AssertionError("recovery sends nothing")

    tool = stopline.Tool(transfer, name=HORIZON_TOOL)

    @tool.verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        read.set()
        return ReadBack(Verdict.NOT_COMMITTED)  # not landed yet

    budget = VerifyBudget(attempts=1, first_delay=0.0)
    # opening recovers what the dead worker left in flight and verifies it
    async with stopline.open(ledger_url, tools=[tool], verify=budget) as ledger:
        await read.wait()
        op = await ledger.backend.get_operation("r/transfer")
        assert op.status is OpStatus.UNKNOWN  # not yet: the provider said it may still land
        assert op.cause is stopline.Cause.CRASH
        assert op.horizon == pytest.approx(stated, abs=0.001)
        receipt = await ledger.receipt("r")
        assert "until" in receipt.lines[0].status_words and not receipt.settled


async def test_r13_a_lost_correction_keeps_the_horizon_its_provider_stated(
    ledger: stopline.Ledger,
) -> None:
    """A refund whose answer is lost after its provider stated a bound: the correction
    was recorded lost with no horizon, a first "not found" proved it did not happen, and
    the review's "correct it again" sent a second refund."""
    refunds: dict[str, int] = {}
    sent = anyio.Event()

    async def charge(ctx: stopline.CallContext) -> str:
        return "charged"

    tool = stopline.Tool(charge, compensation=Compensation.ASK)

    @tool.compensator
    async def _(ctx: stopline.CallContext) -> str:
        ctx.settles_by(time.time() + 60)  # the refund lands within a minute
        sent.set()
        raise ConnectionResetError("the answer was lost")

    @tool.compensation_verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        found = ctx.key in refunds
        return ReadBack(Verdict.COMMITTED if found else Verdict.NOT_COMMITTED, ref=ctx.key)

    async with ledger.run("pay", owner="user:1", run_id="r") as run:
        await run.call(tool, key="charge")
    after = await ledger.compensate("r/charge", by="user:1")  # until its outcome is recorded
    assert sent.is_set() and after.status is OpStatus.COMPENSATING
    comp = await ledger.backend.get_operation("r/charge~compensate")
    assert comp.status is OpStatus.UNKNOWN
    assert comp.horizon is not None and comp.horizon > time.time() + 50
    again = await ledger.verify(comp.id)  # found nothing yet: proves nothing
    assert again.status is OpStatus.UNKNOWN and not refunds
    assert (await ledger.backend.get_operation("r/charge")).status is OpStatus.COMPENSATING


async def test_a_read_back_that_never_answers_is_one_that_found_no_answer(
    ledger_url: str,
) -> None:
    """A verifier that hangs held ``reconcile`` (and the operation "verifying") for
    ever; each read now has ``read_timeout`` seconds, then counts as no answer, and the
    spent budget hands the operation to review."""
    hung = 0

    async def post(ctx: stopline.CallContext) -> str:
        raise ConnectionResetError("dropped")

    tool = stopline.Tool(post)

    @tool.verifier
    async def _(ctx: stopline.CallContext) -> ReadBack:
        nonlocal hung
        hung += 1
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    budget = VerifyBudget(attempts=2, first_delay=0.0, read_timeout=0.05)
    async with stopline.open(ledger_url, tools=[tool], verify=budget) as ledger:
        with pytest.raises(ConnectionResetError):
            async with ledger.run("post", owner="user:1", run_id="r") as run:
                await run.call(tool, key="post")
        summary = await ledger.reconcile(budget=budget)
        assert summary.needs_review == ("r/post",) and hung >= 2
        said = [e.data for e in await ledger.backend.events("r") if e.kind == "verify_unknown"]
        assert said and "no answer within 0.05 s" in str(said[0])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_read_timeout_must_be_a_positive_number_of_seconds(bad: float) -> None:
    with pytest.raises(InvalidInput, match="read_timeout"):
        VerifyBudget(read_timeout=bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10", True])
def test_r13_a_tools_declared_horizon_must_be_seconds(bad: object) -> None:
    """A horizon of -1 or NaN (or a string) was taken as declared: every comparison with
    it false, so "not found" decided at once, or never, with the ledger none the wiser."""

    async def post() -> str:
        return "posted"

    with pytest.raises(InvalidInput, match="settles_within"):
        stopline.tool(settles_within=bad)(post)  # type: ignore[call-overload]


async def test_r13_a_reviewer_cannot_call_it_not_done_while_it_can_still_land(
    ledger: stopline.Ledger,
) -> None:
    """A call with no verifier goes to review at once; its effect could land for a minute
    more. The reviewer's "not committed" was accepted at once, the receipt then said it
    never happened, and the resume it offered sent it again while the first landed. The
    review line says until when, and that verdict waits for the horizon."""
    sent: list[str] = []

    async def deploy(ctx: stopline.CallContext) -> str:
        sent.append(ctx.key)
        raise ConnectionResetError("the answer was lost")  # the provider goes on

    tool = stopline.Tool(deploy, settles_within=60.0)  # no verifier: review
    with pytest.raises(ConnectionResetError):
        async with ledger.run("ship", owner="user:1", run_id="r") as run:
            await run.call(tool, key="deploy")
    receipt = await ledger.wait_settled("r", timeout=10)
    assert receipt.lines[0].status is OpStatus.NEEDS_REVIEW
    assert "its effect could land until" in receipt.lines[0].status_words
    with pytest.raises(stopline.NotPermitted, match="may still land until"):
        await ledger.resolve_review("r/deploy", "not_committed", by="user:1")
    op = await ledger.backend.get_operation("r/deploy")
    assert op.status is OpStatus.NEEDS_REVIEW  # nothing written
    await ledger.resolve_review("r/deploy", "committed", by="user:1")
    op = await ledger.backend.get_operation("r/deploy")
    assert op.status is OpStatus.COMMITTED and sent == ["r/deploy"]
