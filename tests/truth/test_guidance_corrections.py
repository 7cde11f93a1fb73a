"""R14 around corrections: every recovery line and refusal says what following it does.

A correction in review names the reviewer, not a wait; a correction in flight
never offers the resume the ledger refuses; ``compensate`` of what cannot be
corrected says why and what to do, the ledger unchanged, the loser of two at once
too; a provider's cancel ability is worded as observed; and the CLI, which holds
no tool, says what to do from a shell instead of asking to register one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import pytest

import stopline
from stopline import Cancellable, Headline, OpStatus, RunState, Verdict, errors
from stopline.cli import EXIT_ERROR
from stopline.ledger.backend import Backend, GateResult
from stopline.ledger.forwarding import ForwardingBackend
from stopline.runtime.tool import Compensation
from tests.conftest import FAST_VERIFY
from tests.support.observed import open_observed
from tests.surfaces.test_cli import stopline_cli
from tests.truth.helpers import Remote, quiesce

pytestmark = pytest.mark.timeout(60)

RESUME = "resume with ledger.resume(run_id, by=...)"


async def test_a_correction_in_review_says_a_reviewer_decides(ledger: stopline.Ledger) -> None:
    """p02: the compensator corrected, then raised; no compensation verifier, so the
    correction went to review. The run's line said "wait until it settles", which never
    happens, and the original's said its outcome is verified: a person decides it."""
    hotel: list[str] = []

    @stopline.tool(compensation=Compensation.ALWAYS)
    async def book(ctx: stopline.CallContext, room: int) -> str:
        return "booked"

    @book.compensator
    async def _(ctx: stopline.CallContext) -> str:
        hotel.append(ctx.key)
        raise TimeoutError("hotel API timed out after cancelling")

    async with ledger.run("trip", owner="user:1", run_id="g-review") as run:
        await run.call(book, 12, key="room")
        await ledger.cancel(run.id, by="user:1")
    await quiesce(ledger)
    receipt = await ledger.receipt("g-review")
    assert receipt.run_state is RunState.NEEDS_REVIEW  # it waits for a reviewer: settled so far
    assert receipt.headline is Headline.NEEDS_REVIEW
    assert receipt.resume_rule.startswith("a reviewer decides 1 operation in review")
    original, correction = receipt.lines
    assert (original.status, correction.status) == (OpStatus.COMPENSATING, OpStatus.NEEDS_REVIEW)
    assert "human review" in original.recovery and "verified" not in original.recovery

    # following it: the reviewer decides the correction, and the run closes corrected
    await ledger.resolve_review(correction.op_id, "committed", by="user:1", note="refunded")
    receipt = await ledger.wait_settled("g-review", timeout=30)
    assert receipt.headline is Headline.CORRECTED
    assert receipt.resume_rule.startswith(RESUME)
    assert hotel == [correction.op_id]


async def test_a_correction_in_flight_never_offers_the_resume_the_ledger_refuses(
    ledger: stopline.Ledger,
) -> None:
    """p11: a settled cancelled run, then a correction of it under way. The line said
    "resume with ledger.resume(...)" and the resume was refused (not resolved)."""
    remote = Remote()
    async with ledger.run("trip", owner="user:1", run_id="g-flight") as run:
        await run.call(remote.tool, "room 12", key="book")
        await ledger.cancel(run.id, by="user:1")
    settled = await ledger.wait_settled("g-flight", timeout=30)
    assert settled.resume_rule.startswith(RESUME)
    await ledger.compensate("g-flight/book", by="user:1", wait=False)
    await remote.correcting.wait()

    receipt = await ledger.receipt("g-flight")

    assert receipt.run_state is RunState.CANCELLED
    assert receipt.resume_rule.startswith("wait until it settles (ledger.wait_settled)")
    with pytest.raises(stopline.NotPermitted, match="not resolved"):
        await ledger.resume("g-flight", by="user:1")
    remote.let_correct.set()  # following it: wait, then resume
    receipt = await ledger.wait_settled("g-flight", timeout=30)
    assert receipt.resume_rule.startswith(RESUME)
    assert "1 completed action is returned" in receipt.resume_rule
    await ledger.resume("g-flight", by="user:1")
    async with ledger.run("trip", owner="user:1", run_id="g-flight") as run:
        await run.call(remote.tool, "room 12", key="book")
    assert remote.sent == ["g-flight/book", "g-flight/book~compensate"]  # nothing repeated


async def test_compensate_says_why_not_and_what_to_do(ledger: stopline.Ledger) -> None:
    """p19: ``compensate`` of an operation that is not committed raised
    ``illegal transition: event 'compensation_started' in state 'unknown'``."""
    reading, may_read = anyio.Event(), anyio.Event()

    @stopline.tool(compensation=Compensation.NEVER)
    async def charge(ctx: stopline.CallContext, mode: str) -> str:
        if mode == "drop":
            raise ConnectionResetError("dropped")
        if mode == "reject":
            raise stopline.Rejected("card declined")
        return "charged"

    @charge.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        reading.set()
        await may_read.wait()  # held: the dropped charge stays unknown meanwhile
        return stopline.ReadBack(Verdict.UNKNOWN)

    @charge.compensator
    async def _(ctx: stopline.CallContext) -> str:
        return "refunded"

    async with ledger.run("pay", owner="user:1", run_id="g-refuse") as run:
        for mode in ("drop", "reject", "ok"):
            with contextlib.suppress(ConnectionResetError, stopline.Rejected):
                await run.call(charge, mode, key=mode)
    await reading.wait()
    assert (await ledger.compensate("g-refuse/ok", by="user:1")).status is OpStatus.COMPENSATED
    before = await ledger.backend.events("g-refuse")
    said = {}
    for key in ("drop", "reject", "ok"):
        with pytest.raises(errors.NotCorrectable) as refused:
            await ledger.compensate(f"g-refuse/{key}", by="user:1")
        assert isinstance(refused.value, stopline.IllegalTransition)  # what callers caught
        said[key] = str(refused.value)
    assert "not known yet (unknown)" in said["drop"] and "ledger.verify(" in said["drop"]
    assert "did not happen (not_committed): there is nothing to correct" in said["reject"]
    assert "corrected already (g-refuse/ok~compensate)" in said["ok"]
    assert await ledger.backend.events("g-refuse") == before  # the ledger unchanged
    may_read.set()


class BothAtTheGate(ForwardingBackend):
    """Lets a correction's gate through only once two are there (two at once)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.waiting = 0
        self.both = anyio.Event()

    async def begin_compensation(self, spec: Any, evidence: Any) -> GateResult:
        self.waiting += 1
        if self.waiting == 2:
            self.both.set()
        await self.both.wait()
        return await self.inner.begin_compensation(spec, evidence)


async def test_the_second_of_two_corrections_at_once_says_one_is_under_way(
    ledger_url: str,
) -> None:
    """p09: the loser got ``IllegalTransition`` in state compensating."""
    remote = Remote()
    remote.let_correct.set()
    async with open_observed(ledger_url, BothAtTheGate) as (ledger, _):
        async with ledger.run("pay", owner="user:1", run_id="g-race") as run:
            await run.call(remote.tool, "room 12", key="book")
        done: list[OpStatus] = []
        refused: list[str] = []

        async def correct() -> None:
            try:
                done.append((await ledger.compensate("g-race/book", by="user:1")).status)
            except errors.NotCorrectable as exc:
                refused.append(str(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(correct)
            tg.start_soon(correct)
        await quiesce(ledger)
        final = await ledger.backend.get_operation("g-race/book")
    assert done == [OpStatus.COMPENSATED]
    (lost,) = refused
    assert "already under way (g-race/book~compensate)" in lost
    assert "nothing is corrected twice" in lost
    assert final.status is OpStatus.COMPENSATED
    assert list(remote.corrected) == ["g-race/book~compensate"]  # one refund


async def test_a_cancel_ability_is_worded_as_observed(ledger: stopline.Ledger) -> None:
    """6b: an operation never accepted, its provider unable to cancel at all (the
    default), said "the provider cannot cancel it once accepted". ADR 0066: a tool that
    declared nothing (the default, ``never``) is not said to have a provider unable to
    cancel: only that it declared no way, so none is asked."""
    reading, may_read = anyio.Event(), anyio.Event()

    async def send(ctx: stopline.CallContext) -> str:
        raise ConnectionResetError("dropped before any answer")

    async def find(ctx: stopline.CallContext) -> stopline.ReadBack:
        reading.set()
        await may_read.wait()  # held: both stay unknown while the receipt is read
        return stopline.ReadBack(Verdict.COMMITTED, ref=ctx.key)

    never = stopline.Tool(send, name="never")
    until = stopline.Tool(send, name="until", cancellable=Cancellable.UNTIL_ACCEPTED)
    for tool in (never, until):
        tool.wants_context = True
        tool.verify_fn = find
    async with ledger.run("send", owner="user:1", run_id="g-words") as run:
        for tool in (never, until):
            with pytest.raises(ConnectionResetError):
                await run.call(tool, key=tool.name)
    await reading.wait()

    lines = (await ledger.receipt("g-words")).lines

    assert [line.status for line in lines] == [OpStatus.UNKNOWN, OpStatus.UNKNOWN]
    assert lines[0].provider_cancel == (
        "not declared cancellable: its provider is not asked to cancel it"
    )
    assert lines[1].provider_cancel == (
        "the provider cannot cancel it once accepted; whether it accepted is not known"
    )
    may_read.set()


async def test_the_cli_says_what_to_do_instead_of_compensating_from_a_shell(
    ledger_url: str,
) -> None:
    """p08: ``review resolve --as compensate`` told a shell user to pass the tool to
    ``stopline.open(url, tools=[...])``. It is refused before anything is written,
    naming what a shell can do and what the application does."""
    remote = Remote(refuse_correction=True)
    remote.let_correct.set()
    async with stopline.open(ledger_url, verify=FAST_VERIFY) as ledger:
        async with ledger.run("trip", owner="user:1", run_id="g-cli") as run:
            await run.call(remote.tool, "room 12", key="book")
        await ledger.compensate("g-cli/book", by="user:1")
        await quiesce(ledger)
        before = await ledger.backend.events("g-cli")
    assert before[-1].to_state == OpStatus.NEEDS_REVIEW.value

    done = await anyio.to_thread.run_sync(
        lambda: stopline_cli(
            "review",
            "resolve",
            "g-cli/book",
            "--as",
            "compensate",
            "--by",
            "user:1",
            ledger=ledger_url,
        )
    )

    assert done.returncode == EXIT_ERROR
    message = " ".join(done.stderr.split())
    assert "nothing was recorded" in message
    assert "stopline review resolve g-cli/book --as committed" in message
    assert "ledger.compensate('g-cli/book', by=...)" in message
    assert "tools=[...]" in message  # where the correction can run: the application
    async with stopline.open(ledger_url) as ledger:
        assert await ledger.backend.events("g-cli") == before  # the ledger unchanged
