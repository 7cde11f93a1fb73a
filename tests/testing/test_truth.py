"""Ground truth: what the checks judge a tool's effects against (a FakeProvider's,
or a tool of the user's own given by ``ground_truth=``), and where there is none."""

from __future__ import annotations

import contextlib

import pytest

import stopline
from stopline.testing import FakeProvider
from stopline.testing.actions import Cancel, Compensate, CrashWorker
from stopline.testing.explorer import explore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class LyingMailbox:
    """Sends, then says it did not: its read-back denies the mail it holds."""

    def __init__(self) -> None:
        self.sent: list[str] = []

        @stopline.tool(name="send_mail", cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
        async def send_mail(ctx: stopline.CallContext, text: str) -> str:
            self.sent.append(ctx.key)
            raise stopline.Rejected("mail server said no")

        @send_mail.verifier
        async def lie(ctx: stopline.CallContext) -> stopline.ReadBack:
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)

        self.tool = send_mail


class HonestMailbox:
    def __init__(self) -> None:
        self.sent: list[str] = []

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


async def mail_once(run: stopline.Run, box: LyingMailbox | HonestMailbox) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        with contextlib.suppress(stopline.Rejected):  # the agent believes nothing was sent
            await run.call(box.tool, "invoice #42")


async def test_r3_a_tool_with_no_ground_truth_is_named_in_the_report() -> None:
    matrix = await explore(mail_once, LyingMailbox, actions=[Cancel()], out=None)
    assert matrix.unverified == ("send_mail",)
    assert "NO GROUND TRUTH for 'send_mail'" in matrix.report()


async def test_r3_require_ground_truth_fails_the_cells_naming_the_tool() -> None:
    matrix = await explore(
        mail_once, HonestMailbox, actions=[Cancel()], out=None, require_ground_truth=True
    )
    assert not matrix.ok
    broken = [v for c in matrix.failures for v in c.violations if v.rule == "truth"]
    assert broken and all("'send_mail'" in v.detail for v in broken)


async def test_r3_a_given_ground_truth_shows_a_tool_denying_its_effect() -> None:
    matrix = await explore(
        mail_once,
        LyingMailbox,
        actions=[Cancel()],
        out=None,
        ground_truth=lambda box: {"send_mail": box.sent},
    )
    assert matrix.unverified == ()
    assert matrix.baseline is not None
    assert any(
        v.rule == "R3" and "tool 'send_mail' committed it" in v.detail
        for v in matrix.baseline.violations
    )


async def test_r3_an_honest_tool_with_its_ground_truth_passes_every_cell() -> None:
    matrix = await explore(
        mail_once,
        HonestMailbox,
        actions=[Cancel(), CrashWorker()],
        out=None,
        ground_truth=lambda box: {"send_mail": box.sent},
        require_ground_truth=True,
    )
    assert matrix.ok, matrix.report()


async def test_r2_a_crash_cell_recovers_a_tool_of_the_users_own() -> None:
    """The new worker knows every tool the workflow used, not only FakeProviders'."""
    matrix = await explore(mail_once, HonestMailbox, actions=[CrashWorker()], out=None)
    assert matrix.ok, matrix.report()
    assert matrix.cell("after_gate/send_mail", "crash").status.value == "pass"


class CorrectsNothing(FakeProvider):
    async def _compensate(self, ctx: stopline.CallContext) -> dict[str, object]:
        return {"id": ctx.key, "compensated": True}  # says so; does nothing


async def send_invoice(run: stopline.Run, mail: FakeProvider) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(mail.tool, "invoice #42")


def corrects_nothing() -> FakeProvider:
    provider = CorrectsNothing("mail", compensable=True)
    provider.tool.compensate_fn = provider._compensate
    return provider


async def test_r3_a_compensation_that_corrects_nothing_is_not_called_corrected() -> None:
    matrix = await explore(send_invoice, corrects_nothing, actions=[Compensate()], out=None)
    broken = matrix.broken("R3")
    assert broken, matrix.report()
    assert all(any("corrected nothing" in v.detail for v in c.violations) for c in broken)
    honest = await explore(
        send_invoice,
        lambda: FakeProvider("mail", compensable=True),
        actions=[Compensate()],
        out=None,
    )
    assert honest.ok, honest.report()
