"""The testing kit against a user's own payment tool: a canceller that confirms what it
did not stop, and a compensator that is not idempotent.

Each tool here breaks its side of the contract in one way and has an honest twin; the
kit fails the one and passes the other.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import stopline
from stopline.domain.vocab import Cancellable
from stopline.runtime.tool import Compensation
from stopline.testing import Barriers, CellStatus, FakeProvider
from stopline.testing.actions import (
    CORE_ACTIONS,
    DEFAULT_ACTIONS,
    Cancel,
    CancelTwice,
    Compensate,
    CompensateAgain,
    CrashWorker,
)
from stopline.testing.explorer import explore
from stopline.testing.mutations import receipt_overclaims

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Bank:
    """A payments destination of the user's own: ``charges`` and ``refunds`` are what it
    really holds (each by the key of the call that made it).

    ``canceller``: ``"honest"`` confirms only a cancel that stopped the charge, ``"lies"``
    confirms every cancel, ``None`` declares none. ``refunds``: ``"by_key"`` refunds once
    per correction key, ``"every_call"`` refunds each time it is called."""

    def __init__(self, canceller: str | None = "honest", refunds: str = "by_key") -> None:
        self.charges: list[str] = []
        self.refunds: list[str] = []
        self.stopped: set[str] = set()
        self.points = Barriers()
        bank = self

        @stopline.tool(
            name="charge",
            cancellable=Cancellable.UNTIL_ACCEPTED,
            compensation=Compensation.ALWAYS,
        )
        async def charge(ctx: stopline.CallContext, cents: int) -> str:
            await bank.points.reach("queued", ctx.key)
            if ctx.key in bank.stopped:
                raise stopline.Rejected("stopped before it was charged", ref=ctx.key)
            if ctx.key not in bank.charges:
                bank.charges.append(ctx.key)
            return ctx.key

        @charge.verifier
        async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
            if ctx.key in bank.charges:
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)

        @charge.compensator
        async def give_back(ctx: stopline.CallContext) -> str:
            if refunds == "every_call" or ctx.key not in bank.refunds:
                bank.refunds.append(ctx.key)
            return "refunded"

        self.give_back = give_back
        if canceller is not None:

            @charge.canceller
            async def cancel(ctx: stopline.CallContext) -> bool:
                if canceller == "lies":
                    return True
                if ctx.key in bank.charges:
                    return False  # too late: charged already
                bank.stopped.add(ctx.key)
                return True

        self.tool = charge


async def pay(run: stopline.Run, bank: Bank) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(bank.tool, 1250)


def held(bank: Bank) -> dict[str, list[str]]:
    """The ground truth: every charge and every refund, by key (a refund is an effect too)."""
    return {"charge": [*bank.charges, *bank.refunds]}


# -- a canceller that confirms what it did not stop ---------------------------------


async def test_a_canceller_that_confirms_a_charge_it_did_not_stop_is_r3() -> None:
    """The runtime caught the lie (the charge's response came after the confirmation:
    review), so every cell passed with "LEFT TO REVIEW: charge" and no word of why;
    yet a confirmed cancel is evidence the charge never happened."""
    matrix = await explore(
        pay,
        lambda: Bank(canceller="lies"),
        actions=[Cancel()],
        ground_truth=held,
        out=None,
    )
    for point in ("queued", "returned/charge", "response_delivered/charge"):
        cell = matrix.cell(point, "cancel")
        assert cell.rules_broken == ("R3",), cell.text()
        assert (
            f"tool 'charge' committed {cell.run_id}/1:charge, yet its canceller confirmed "
            "the cancel" in cell.text()
        )
    report = matrix.report()
    assert "charge: evidence in conflict: committed contradicts recorded not_committed" in report


async def test_an_honest_canceller_passes_every_core_cell() -> None:
    matrix = await explore(pay, Bank, actions=CORE_ACTIONS, ground_truth=held, out=None)
    assert matrix.ok, matrix.report()
    assert matrix.cell("queued", "cancel").headline is not None
    assert not matrix.reviews


# -- a compensator that is not idempotent -------------------------------------------


async def test_a_compensator_that_refunds_every_call_is_r3_in_compensate_again() -> None:
    """Sent once (``compensate``), a refund that is not idempotent looks right; sent again
    under its own key, as a retry after a lost answer sends it, it refunds twice."""
    made: list[Bank] = []

    def banks() -> Bank:
        made.append(Bank(refunds="every_call"))
        return made[-1]

    only = [
        f"point=response_delivered/charge action={a} seed=0"
        for a in ("compensate", "compensate_again")
    ]
    matrix = await explore(
        pay,
        banks,
        actions=[Compensate(), CompensateAgain()],
        ground_truth=held,
        only=only,
        out=None,
    )
    assert matrix.cell("response_delivered/charge", "compensate").status is CellStatus.PASS
    cell = matrix.cell("response_delivered/charge", "compensate_again")
    assert cell.rules_broken == ("R3",), cell.text()
    correction = f"{cell.run_id}/1:charge~compensate"
    assert f"R3: tool 'charge' applied the correction {correction} 2 times" in cell.text()
    # each tool is put back as it was once its cell ended
    assert all(b.tool.compensate_fn is b.give_back for b in made)


async def test_an_idempotent_compensator_passes_compensate_again() -> None:
    matrix = await explore(pay, Bank, actions=[CompensateAgain()], ground_truth=held, out=None)
    assert matrix.ok, matrix.report()
    cell = matrix.cell("response_delivered/charge", "compensate_again")
    assert cell.headline is not None and cell.headline.value == "corrected"


async def test_compensate_again_where_the_workflow_calls_the_tool_again() -> None:
    """The tool the ledger knows by its name is the workflow's own (not a copy in its
    place): a later call of it is the same tool, fenced by the cancel as ever."""

    async def pay_twice(run: stopline.Run, bank: Bank) -> None:
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(bank.tool, 1250)
            await run.call(bank.tool, 99)

    matrix = await explore(
        pay_twice, Bank, actions=[CompensateAgain()], ground_truth=held, out=None
    )
    assert matrix.ok, matrix.report()
    cell = matrix.cell("response_delivered/charge", "compensate_again")
    assert cell.headline is not None and cell.headline.value == "corrected"
    assert "raised" not in cell.note


async def test_compensate_again_is_a_default_action_and_a_fake_provider_passes_it() -> None:
    assert any(isinstance(a, CompensateAgain) for a in DEFAULT_ACTIONS)
    matrix = await explore(
        pay_provider,
        lambda: FakeProvider("mail", compensable=True),
        actions=[CompensateAgain()],
        out=None,
    )
    assert matrix.ok, matrix.report()
    assert matrix.cell("response_delivered/mail", "compensate_again").status is CellStatus.PASS


async def pay_provider(run: stopline.Run, provider: FakeProvider) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(provider.tool, "invoice #42")


# -- what a failing cell says ---------------------------------------------------------


async def test_each_r8_line_says_which_receipt_overclaimed() -> None:
    """Two cancels and the final receipt, each overclaiming, printed three identical lines."""
    with receipt_overclaims():
        matrix = await explore(
            pay_provider,
            lambda: FakeProvider("mail"),
            actions=[CancelTwice()],
            only="point=responding/mail action=cancel_twice seed=0",
            out=None,
        )
    (cell,) = matrix.cells
    said = [v.detail for v in cell.violations if "while effects were committed" in v.detail]
    assert [s.split(" 'Canceled")[0] for s in said] == [
        "cancel #1 returned",
        "cancel #2 returned",
        "the receipt says",
    ]
    assert len(set(cell.violations)) == len(cell.violations)


class Ledgerless:
    """A read-back that finds a charge nobody made."""

    def __init__(self) -> None:
        self.charges: list[str] = []

        @stopline.tool(name="charge", cancellable=Cancellable.UNTIL_ACCEPTED)
        async def charge(ctx: stopline.CallContext, cents: int) -> str:
            self.charges.append(ctx.key)
            return ctx.key

        @charge.verifier
        async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
            return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)

        self.tool = charge


async def test_a_read_back_that_finds_a_charge_never_made_is_r3() -> None:
    """The worker dies after the gate, before the charge: recovery reads back, and a
    read-back that says "there" makes the ledger claim a charge the bank never made."""

    async def charge_once(run: stopline.Run, bank: Ledgerless) -> None:
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(bank.tool, 1250)

    matrix = await explore(
        charge_once,
        Ledgerless,
        actions=[CrashWorker()],
        ground_truth=lambda bank: {"charge": bank.charges},
        only="point=after_gate/charge action=crash seed=0",
        out=None,
    )
    (cell,) = matrix.cells
    assert cell.rules_broken == ("R3",), cell.text()
    assert f"{cell.run_id}/1:charge is committed in the ledger; tool 'charge' has no such" in (
        cell.text()
    )


# -- the pytest fixture ------------------------------------------------------------------


# the head of a user's test file exploring one tool (``send``) through the fixture
A_USERS_TEST = (
    "import pytest\n"
    "import stopline\n"
    "from stopline.testing import FakeProvider\n\n"
    "async def send(run, mail):\n"
    "    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):\n"
    "        await run.call(mail.tool, 'x')\n\n"
    "@pytest.fixture\n"
    "def anyio_backend():\n"
    "    return 'asyncio'\n\n"
)


def test_a_tmp_path_a_ledger_url_cannot_carry_fails_the_test_saying_so(tmp_path: Path) -> None:
    """With ``--basetemp`` holding '?', the fixture's ledger URL ended its path there:
    the cells' ledgers went beside the base directory, outside every tmp_path, and the
    test passed."""
    (tmp_path / "test_q.py").write_text(
        A_USERS_TEST + "@pytest.mark.anyio\n"
        "async def test_q(stopline_explore):\n"
        "    only = 'point=accepted/mail action=cancel seed=0'\n"
        "    await stopline_explore(send, lambda: FakeProvider('mail'), only=only)\n"
    )
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'base?x'}",
            "test_q.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=100,
    )
    assert ran.returncode != 0, ran.stdout
    assert "holds '?', which a sqlite:/// ledger URL cannot carry" in ran.stdout
    assert sorted(p.name for p in tmp_path.glob("*.db")) == []
