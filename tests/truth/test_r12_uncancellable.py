"""R12 and S15 in process: the limitation is said on that line, while it is in flight."""

from __future__ import annotations

import anyio

import stopline
from stopline import Cancellable, Headline, OpStatus
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
        assert at_cancel.headline is Headline.AWAITING_CONFIRMATION
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
