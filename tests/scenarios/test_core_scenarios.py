"""CONTRACT.md scenarios S1, S2, S3, S7, S9, S10, S11, S16 on a real SQLite ledger.

Providers are ``stopline.testing.FakeProvider``: each keeps its own ground
truth of what it committed, and stops at barriers the test controls, so
every cancel lands at an exact point without sleeps.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import pytest

import stopline
from stopline import Cancellable, Cause, EvidenceKind, Headline, OpStatus, PhaseKind, Policy
from stopline.domain.lifecycle import Principal
from stopline.testing import CancelBehaviour, FakeProvider
from tests.conftest import FAST_VERIFY
from tests.scenarios.workflows import Started, calls, start

# The core scenarios also run on trio (with SQLite): anyio's promise, checked.
pytestmark = [pytest.mark.trio_too, pytest.mark.uvloop_too]


async def op_of(ledger: stopline.Ledger, run_id: str, n: int = 0) -> stopline.OperationRecord:
    return (await ledger.backend.operations(run_id))[n]


async def test_s01_cancel_before_the_tool_call(ledger: stopline.Ledger, ledger_url: str) -> None:
    """Cancelled from elsewhere (another ledger connection) while the agent thinks."""
    send = FakeProvider("send")
    thinking = anyio.Event()

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.FINALIZING):  # at_boundary: not interrupted
            await thinking.wait()
            await run.call(send.tool, "hello")  # no boundary in between: the gate decides

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await started.ready.wait()
        async with stopline.open(ledger_url) as elsewhere:  # "from anywhere"
            first = await elsewhere.cancel(started.run_id, by="user:1", reason="stop")
        assert first.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
        thinking.set()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert send.requests == []  # nothing reached the provider
    assert [line.status for line in receipt.lines] == [OpStatus.PREVENTED]
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    assert receipt.message == "Canceled before external action."
    assert receipt.run_state is stopline.RunState.CANCELLED
    assert started.error is None  # the workflow unwound quietly


async def test_s02_cancel_while_waiting_on_remote_confirmed(ledger: stopline.Ledger) -> None:
    upload = FakeProvider("upload", cancellable=Cancellable.UNTIL_ACCEPTED)
    held = upload.hold("received")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(upload))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert upload.cancel_requests == [held.key]  # the provider was asked
    assert upload.committed == {}
    op = await op_of(ledger, started.run_id)
    assert op.status is OpStatus.NOT_COMMITTED
    assert op.cancel_state == "confirmed"
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_s03_cancel_after_commit_before_response(ledger: stopline.Ledger) -> None:
    """Immediate policy: the local await is aborted, so the outcome is unknown until read back."""
    notify = FakeProvider("notify", cancellable=Cancellable.NEVER)
    held = notify.hold("committed")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(notify, policy=Policy.IMMEDIATE))
        await held.reached.wait()
        await ledger.cancel(started.run_id, by="user:1")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    op = await op_of(ledger, started.run_id)
    assert op.status is OpStatus.COMMITTED
    assert op.cause is Cause.USER_CANCEL
    kinds = [e.kind for e in await ledger.backend.events(started.run_id) if e.op_id == op.id]
    assert kinds.index("lost") < kinds.index("verified_committed")  # unknown, then proven
    assert EvidenceKind.READ_BACK in {e.kind for e in op.evidence}
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert notify.effects == [held.key]


async def test_s07_cancel_twice(ledger: stopline.Ledger) -> None:
    send = FakeProvider("send")
    held = send.hold("received")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(send))
        await held.reached.wait()
        first = await ledger.cancel(started.run_id, by="user:1", reason="first")
        admin = Principal("user:2", tenant="default", roles=frozenset({"admin"}))
        second = await ledger.cancel(started.run_id, by=admin, reason="second")
    settled = await ledger.wait_settled(started.run_id, timeout=10)
    third = await ledger.cancel(started.run_id, by="user:1", reason="third")
    assert third == settled  # after settling: the same receipt
    assert second.cancelled_by == first.cancelled_by == "user:1"
    assert second.cancel_reason == "first"
    events = await ledger.backend.events(started.run_id)
    assert [e.kind for e in events].count("cancel") == 1
    assert send.cancel_requests == [held.key]  # one cancellation reached the provider


async def test_s09_late_success_after_cancel(ledger: stopline.Ledger) -> None:
    """The local await is gone; the remote commits later and its response is kept."""
    remote_done = anyio.Event()
    accepted = anyio.Event()
    truth: dict[str, str] = {}

    @stopline.tool(cancellable=Cancellable.NEVER)
    async def pay(ctx: stopline.CallContext, amount: int) -> str:
        await ctx.accepted(ref="psp:1")
        accepted.set()
        await remote_done.wait()  # the local side waits; the cancel aborts this wait
        return "paid"

    @pay.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        if ctx.key in truth:
            return stopline.ReadBack(stopline.Verdict.COMMITTED, "psp:1", result=truth[ctx.key])
        return stopline.ReadBack(stopline.Verdict.UNKNOWN, detail="still processing")

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await run.call(pay, 100)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await accepted.wait()
        await ledger.cancel(started.run_id, by="user:1")
    op = await op_of(ledger, started.run_id)
    with anyio.fail_after(10):  # the cut call's record is written in the background
        while op.status is OpStatus.ACCEPTED:
            await ledger.wait_for_change(started.run_id)
            op = await op_of(ledger, started.run_id)
    assert op.status in (OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW)  # R3, not "not sent"
    # the remote commits, and its response arrives with nobody waiting
    truth[op.id] = "paid"
    late = await ledger.late_response(op.id, stopline.Verdict.COMMITTED, result="paid", ref="psp:1")
    assert late.status is OpStatus.COMMITTED
    assert late.result == "paid"
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    late_events = [e for e in await ledger.backend.events(started.run_id) if e.data.get("late")]
    assert late_events  # kept as evidence, marked late
    assert started.entries == 1  # the workflow was not restarted


async def test_s10_provider_refuses_the_cancel(ledger: stopline.Ledger) -> None:
    deploy = FakeProvider(
        "deploy", cancellable=Cancellable.AFTER_ACCEPTED, on_cancel=CancelBehaviour.REFUSE
    )
    held = deploy.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(deploy))
        await held.reached.wait()
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        assert at_cancel.headline is Headline.AWAITING_CONFIRMATION
        while (await op_of(ledger, started.run_id)).cancel_state != "refused":
            await ledger.wait_for_change(started.run_id)
        refused = await ledger.receipt(started.run_id)
        assert refused.headline is Headline.AWAITING_CONFIRMATION
        assert "refused to cancel" in refused.lines[0].provider_cancel
        held.release()  # the provider goes on and commits: the real outcome
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert deploy.effects == [held.key]


async def test_s11_queued_retry_fires_after_cancel(ledger: stopline.Ledger) -> None:
    attempts: list[str] = []
    timer = anyio.Event()

    @stopline.tool
    async def charge(ctx: stopline.CallContext, amount: int) -> str:
        attempts.append(ctx.key)
        raise stopline.Rejected("rate limited; retry later")

    retry_outcome: list[str] = []

    async def body(run: stopline.Run, started: Started) -> None:
        with contextlib.suppress(stopline.Rejected):
            await run.call(charge, 5, key="charge")

        async def retry_later() -> None:  # a timer outside the workflow's own scope
            await timer.wait()
            try:
                await run.call(charge, 5, key="charge")
                retry_outcome.append("dispatched")
            except stopline.RunFenced:
                retry_outcome.append("refused")

        tg_outer.start_soon(retry_later)
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg_outer:
        started = start(tg_outer, ledger, body)
        while not attempts:
            await ledger.wait_for_change(started.run_id)
        await ledger.cancel(started.run_id, by="user:1")
        timer.set()
    assert retry_outcome == ["refused"]
    assert len(attempts) == 1  # the retry never reached the provider
    events = await ledger.backend.events(started.run_id)
    kinds = [e.kind for e in events]
    assert kinds.index("cancel") < len(kinds) - 1 - kinds[::-1].index("gate_refused")
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION


async def test_s16_connection_drops_before_the_response(ledger: stopline.Ledger) -> None:
    """Unknown, reconciled by read-back; the retry with the same id makes no second effect."""
    ticket = FakeProvider("ticket", drop_response=True)
    outcome: dict[str, Any] = {}

    async def body(run: stopline.Run, started: Started) -> None:
        try:
            await run.call(ticket.tool, "file it", key="ticket")
        except ConnectionResetError:
            outcome["first"] = "dropped"
        outcome["retry"] = await run.call(ticket.tool, "file it", key="ticket")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    op = await op_of(ledger, started.run_id)
    assert outcome["first"] == "dropped"
    assert outcome["retry"] == {"id": op.id, "value": "file it"}  # the read-back's result
    assert op.status is OpStatus.COMMITTED
    assert op.cause is Cause.TRANSPORT
    assert len(ticket.requests) == 1 and ticket.effects == [op.id]  # no second effect
    assert receipt.headline is Headline.COMPLETED
    assert FAST_VERIFY.attempts >= 1


async def test_s10_a_cancel_the_provider_never_answers_does_not_hold_the_run(
    ledger: stopline.Ledger,
) -> None:
    """The provider's cancel endpoint hangs; the run still settles on the call's outcome."""
    hang, done, entered = anyio.Event(), anyio.Event(), anyio.Event()

    @stopline.tool(cancellable=Cancellable.UNTIL_ACCEPTED)
    async def upload(ctx: stopline.CallContext) -> str:
        entered.set()
        await done.wait()
        return "uploaded"

    @upload.canceller
    async def _(ctx: stopline.CallContext) -> bool:
        await hang.wait()  # never answers
        return True

    ledger.cancel_answer_timeout = 0.05

    async def body(run: stopline.Run, started: Started) -> None:
        await run.call(upload)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await entered.wait()
        await ledger.cancel(started.run_id, by="user:1")
        kinds: list[str] = []
        while "cancel_unanswered" not in kinds:
            await ledger.wait_for_change(started.run_id)
            kinds = [e.kind for e in await ledger.backend.events(started.run_id)]
        done.set()  # the call itself completes
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert receipt.lines[0].status is OpStatus.COMMITTED
