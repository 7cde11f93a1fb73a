"""R12 and S15 in process: the limitation is said on that line, while it is in flight."""

from __future__ import annotations

import anyio

import stopline
from stopline import Cancellable, Headline, OpStatus
from stopline.cli.views import timeline
from stopline.testing import FakeProvider
from tests.scenarios.workflows import calls, start


async def test_s15_provider_cannot_cancel_once_accepted(ledger: stopline.Ledger) -> None:
    upload = FakeProvider("upload", cancellable=Cancellable.UNTIL_ACCEPTED)
    other = FakeProvider("other", cancellable=Cancellable.UNTIL_ACCEPTED)
    received, accepted = upload.hold("received"), upload.hold("accepted")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(other, upload))
        await received.reached.wait()
        before = (await ledger.receipt(started.run_id)).lines
        assert before[1].provider_cancel == "the provider can still cancel it"
        received.release()
        await accepted.reached.wait()
        line = (await ledger.receipt(started.run_id)).lines[1]
        assert line.status is OpStatus.ACCEPTED
        assert line.provider_cancel == "the provider cannot cancel it once accepted"
        assert line.recovery.startswith("it runs to completion at the provider; then verify")
        assert (await ledger.receipt(started.run_id)).lines[0].provider_cancel == ""  # done
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        # R14: nobody asks its provider (it cannot): no vendor confirmation to wait for
        assert at_cancel.headline is Headline.VERIFYING
        assert "cannot cancel it once accepted" in at_cancel.text()
        assert upload.cancel_requests == []  # not asked: it cannot
        accepted.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    assert [line.provider_cancel for line in receipt.lines] == ["", ""]  # no blanket warning


async def test_r12_never_cancellable_says_so_from_the_first_byte(ledger: stopline.Ledger) -> None:
    deploy = FakeProvider("deploy", cancellable=Cancellable.NEVER, verifiable=False)
    received = deploy.hold("received")
    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, calls(deploy))
        await received.reached.wait()
        line = (await ledger.receipt(started.run_id)).lines[0]
        # ``never`` is also every tool's default: the line says what the record proves
        # (no way to cancel declared, none asked), not what the provider could do (ADR 0066)
        assert line.provider_cancel == (
            "not declared cancellable: its provider is not asked to cancel it"
        )
        assert line.recovery == "its provider may still complete it; then human review if no answer"
        received.release()
    receipt = await ledger.wait_settled(started.run_id, timeout=10)
    assert receipt.lines[0].provider_cancel == ""


async def test_a_canceller_that_raises_is_an_error_not_a_refusal(ledger: stopline.Ledger) -> None:
    """R14: a canceller that raised was recorded ``refused`` (the work goes on), which an
    exception does not say; it is an ``error`` answer that says nothing of the work, the
    exception kept, and the call is still followed to its outcome (ADR 0083, amendment)."""
    entered, release = anyio.Event(), anyio.Event()

    @stopline.tool(cancellable=Cancellable.UNTIL_ACCEPTED)
    async def upload(ctx: stopline.CallContext) -> str:
        entered.set()
        await release.wait()
        return "stored"

    @upload.canceller
    async def _(ctx: stopline.CallContext) -> bool:
        raise ConnectionError("cancel endpoint unreachable")

    async with ledger.run("job", owner="user:1") as run, anyio.create_task_group() as tg:
        tg.start_soon(run.call, upload)
        await entered.wait()
        await ledger.cancel(run.id, by="user:1")
        (op,) = await ledger.backend.operations(run.id)
        while op.cancel_state in ("none", "asked"):  # the canceller's answer, once recorded
            await ledger.wait_for_change(run.id)
            (op,) = await ledger.backend.operations(run.id)
        assert op.cancel_state == "error"
        (line,) = (await ledger.receipt(run.id)).lines
        assert line.provider_cancel == (
            "the cancel request ended in an error; that says nothing of the work"
        )
        notes = [e for e in await ledger.backend.events(run.id) if e.kind == "cancel_error"]
        assert "cancel endpoint unreachable" in str(notes[0].data["detail"])
        # the timeline (stopline show, the console) says which way the cancel went
        shown = timeline(await ledger.backend.events(run.id), [op])
        (said,) = [e.detail for e in shown if e.kind == "cancel_error"]
        assert said.startswith("channel: canceller; detail: ConnectionError")
        release.set()
    receipt = await ledger.wait_settled(run.id, timeout=30)
    assert receipt.lines[0].status is OpStatus.COMMITTED  # followed to its outcome
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
