"""The explorer against workflows that repeat an effect when resumed (probe 42).

The receipt of a cancelled run tells the user to resume it and enter the workflow
again under the same run id: what was done is returned from the ledger, not done
again. A workflow whose calls are not the same on re-entry (a key of its own drawn
afresh) repeats its effects there, and no action re-entered a workflow: every cell
passed. ``cancel_resume`` (a default action) does, and compares each destination
with a run never cancelled; the honest twin of each workflow passes.
"""

from __future__ import annotations

import uuid

import pytest

import stopline
from stopline.testing import CellStatus, FakeProvider
from stopline.testing.actions import DEFAULT_ACTIONS, CancelResume
from stopline.testing.explorer import explore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pair() -> dict[str, FakeProvider]:
    return {"mail": FakeProvider("mail"), "pay": FakeProvider("pay")}


async def _same_calls(run: stopline.Run, p: dict[str, FakeProvider]) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(p["mail"].tool, "invoice #42")
        await run.call(p["pay"].tool, 1250)


async def _fresh_key(run: stopline.Run, p: dict[str, FakeProvider]) -> None:
    """Sends the invoice under a key drawn afresh each time it is entered."""
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(p["mail"].tool, "invoice #42", key=uuid.uuid4().hex)
        await run.call(p["pay"].tool, 1250)


async def test_a_workflow_that_sends_again_on_resume_is_caught_and_its_twin_passes() -> None:
    honest = await explore(_same_calls, _pair, actions=[CancelResume()], out=None)
    assert honest.ok, honest.report()
    broken = await explore(_fresh_key, _pair, actions=[CancelResume()], out=None)
    failed = {c.point for c in broken.broken("R4")}
    # wherever the invoice was sent before the cancel, and only there (R1 is not broken:
    # a resume lifts the fence, so the gates passed after it are the re-entry's)
    not_sent = {"before_dispatch/mail", "after_gate/mail", "received/mail"}
    assert failed == set(broken.points) - not_sent, broken.report()
    assert not broken.broken("R1"), broken.report()
    cell = broken.cell("committed/mail", "cancel_resume")
    assert "provider 'mail' holds 2 effects" in cell.text()
    assert "a run never cancelled makes 1" in cell.text()
    assert broken.cell("before_dispatch/mail", "cancel_resume").status is CellStatus.PASS


class Mailbox:
    """A destination of the user's own (docs/testing.md), idempotent by key."""

    def __init__(self, fresh_key: bool = False) -> None:
        self.sent: list[str] = []
        self.fresh_key = fresh_key

        @stopline.tool(name="send_mail", cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
        async def send_mail(ctx: stopline.CallContext, text: str) -> str:
            if ctx.key not in self.sent:
                self.sent.append(ctx.key)
            return ctx.key

        @send_mail.verifier
        async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
            if ctx.key in self.sent:
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)

        self.tool = send_mail


async def _mail(run: stopline.Run, box: Mailbox) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        key = uuid.uuid4().hex if box.fresh_key else None
        await run.call(box.tool, "invoice #42", key=key)
        await run.call(box.tool, "reminder")


async def test_a_tool_of_your_own_sent_again_on_resume_is_caught_by_its_ground_truth() -> None:
    def truth(box: Mailbox) -> dict[str, list[str]]:
        return {"send_mail": box.sent}

    honest = await explore(_mail, Mailbox, actions=[CancelResume()], ground_truth=truth, out=None)
    assert honest.ok, honest.report()
    broken = await explore(
        _mail,
        lambda: Mailbox(fresh_key=True),
        actions=[CancelResume()],
        ground_truth=truth,
        out=None,
    )
    assert broken.broken("R4"), broken.report()
    assert all("tool 'send_mail' holds" in c.text() for c in broken.broken("R4"))


def test_cancel_resume_is_among_the_default_actions() -> None:
    assert "cancel_resume" in [a.name for a in DEFAULT_ACTIONS]
