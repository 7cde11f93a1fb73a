"""``stopline.testing`` from the outside, sixth probe: a workflow with a child run, a
toolkit call a user gets wrong, a forgotten ``await``.

Each test was a finding: what the toolkit reported was not what happened (a child
run's effects were judged against nothing), or a plausible use failed badly (a typo
in a held point hung the test; an exploration of nothing passed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

import stopline
from stopline.domain.model import CancelState
from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput
from stopline.runtime import provider_asks
from stopline.runtime.provider_asks import _answer_of
from stopline.testing import CellStatus, FakeProvider
from stopline.testing.actions import Cancel, Compensate, CrashWorker, LateResponse, RefuseCancel
from stopline.testing.explorer import ExplorerError, explore
from stopline.testing.mutations import gate_ignores_fence, receipt_overclaims
from tests.testing.test_probe3_user_tools import A_USERS_TEST

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a workflow that calls its tools in a child run -------------------------------------


async def in_a_child(run: stopline.Run, mail: FakeProvider) -> None:
    """The agent hands the sending to a sub-agent: a child run its parent owns (S4)."""
    async with run.child("sender") as sub, sub.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await sub.call(mail.tool, "invoice #42")


def compensable_mail() -> FakeProvider:
    return FakeProvider("mail", compensable=True)


async def test_a_child_runs_effects_are_in_its_parents_receipt_and_the_checks_agree() -> None:
    """The receipt of a run tells its children's operations; the checks read the run's
    own alone, so every cell after the child's commit failed R8 ("the evidence
    justifies canceled_before_external_action") against a receipt that was right."""
    matrix = await explore(
        in_a_child, compensable_mail, actions=[Cancel(), Compensate(), LateResponse()], out=None
    )
    assert matrix.ok, matrix.report()
    cell = matrix.cell("committed/mail", "cancel")
    assert cell.headline is not None
    assert cell.headline.value == "stopped_with_completed_actions"
    corrected = matrix.cell("response_delivered/mail", "compensate")
    assert corrected.headline is not None and corrected.headline.value == "corrected"


async def test_a_receipt_denying_a_child_runs_effect_is_r8() -> None:
    """Under ``receipt_overclaims`` every cell passed: the child's effects, filed under
    the child's run id, were no effects of the run's."""
    with receipt_overclaims():
        matrix = await explore(
            in_a_child,
            lambda: FakeProvider("mail"),
            actions=[Cancel()],
            only="point=responding/mail action=cancel seed=0",
            out=None,
        )
    (cell,) = matrix.cells
    assert "R8" in cell.rules_broken, cell.text()
    assert f"while effects were committed: ['{cell.run_id}:sender/1:mail']" in cell.text()


async def test_a_child_run_dispatching_after_its_parents_cancel_is_r1() -> None:
    """Under ``gate_ignores_fence`` the child's call passed the gate after the cancel, and
    the cell passed: the child's gate events were not read."""
    with gate_ignores_fence():
        matrix = await explore(
            in_a_child,
            lambda: FakeProvider("mail"),
            actions=[Cancel()],
            only="point=before_dispatch/mail action=cancel seed=0",
            out=None,
        )
    (cell,) = matrix.cells
    assert "R1" in cell.rules_broken, cell.text()
    assert f"{cell.run_id}:sender/1:mail passed the gate" in cell.text()


class Mailbox:
    """A destination of the user's own; ``honest=False``: its read-back says "absent"."""

    def __init__(self, *, honest: bool = True) -> None:
        self.sent: list[str] = []

        @stopline.tool(name="send_mail", cancellable=Cancellable.UNTIL_ACCEPTED)
        async def send_mail(ctx: stopline.CallContext, text: str) -> str:
            if ctx.key not in self.sent:
                self.sent.append(ctx.key)
            return ctx.key

        @send_mail.verifier
        async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
            if honest and ctx.key in self.sent:
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)

        self.tool = send_mail


async def mail_in_a_child(run: stopline.Run, box: Mailbox) -> None:
    async with run.child("sender") as sub, sub.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await sub.call(box.tool, "invoice #42")


async def test_a_lying_read_back_in_a_child_run_is_r3_and_an_honest_one_passes() -> None:
    """The ground truth of a tool called in a child run was filtered by the parent's run
    id: it held nothing, and the child's operations were not read either, so a
    read-back denying a sent mail passed."""
    only = "point=returned/send_mail action=crash seed=0"
    lying = await explore(
        mail_in_a_child,
        lambda: Mailbox(honest=False),
        actions=[CrashWorker()],
        ground_truth=lambda box: {"send_mail": box.sent},
        only=only,
        out=None,
    )
    (cell,) = lying.cells
    assert cell.rules_broken == ("R3",), cell.text()
    assert f"{cell.run_id}:sender/1:send_mail is not_committed in the ledger" in cell.text()
    honest = await explore(
        mail_in_a_child,
        Mailbox,
        actions=[CrashWorker(), Cancel()],
        ground_truth=lambda box: {"send_mail": box.sent},
        require_ground_truth=True,
        out=None,
    )
    assert honest.ok, honest.report()
    assert honest.cell("returned/send_mail", "crash").status is CellStatus.PASS


# -- a provider's answer to a cancel, as the ledger records it ----------------------------


def _refusal_recorded_as_confirmation(answer: object) -> tuple[CancelState, str]:
    """The runtime's reading of a canceller's answer, broken: a refusal is a confirmation."""
    state, detail = _answer_of(answer)
    return (CancelState.CONFIRMED, detail) if state is CancelState.REFUSED else (state, detail)


async def test_a_refusal_the_ledger_records_as_a_confirmation_is_r14(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The provider refused the cancel and the ledger said it confirmed it (R14: worded as
    observed); the cell passed, as the effect had not happened yet when it was asked."""
    monkeypatch.setattr(provider_asks, "_answer_of", _refusal_recorded_as_confirmation)
    matrix = await explore(
        send_invoice,
        lambda: FakeProvider("mail"),
        actions=[RefuseCancel()],
        only="point=received/mail action=refuse_cancel seed=0",
        out=None,
    )
    (cell,) = matrix.cells
    assert "R14" in cell.rules_broken, cell.text()
    assert (
        f"R14: {cell.run_id}/1:mail: the ledger records the cancel confirmed; "
        "provider 'mail' refused" in cell.text()
    )
    monkeypatch.undo()
    honest = await explore(
        send_invoice,
        lambda: FakeProvider("mail", cancellable=Cancellable.AFTER_ACCEPTED),
        actions=[Cancel(), RefuseCancel()],
        out=None,
    )
    assert honest.ok, honest.report()


async def send_invoice(run: stopline.Run, mail: FakeProvider) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(mail.tool, "invoice #42")


# -- an exploration of nothing ------------------------------------------------------------


async def test_a_workflow_that_passes_no_point_is_an_explorer_error() -> None:
    """A workflow calling its tool around ``run.call`` passes no point: the matrix had no
    cell, ``ok`` was True, and the test passed having explored nothing."""

    async def no_call(run: stopline.Run, mail: FakeProvider) -> None:
        await anyio.lowlevel.checkpoint()  # the tool called some other way, or not at all

    with pytest.raises(ExplorerError, match="passed no point: nothing to explore"):
        await explore(no_call, lambda: FakeProvider("mail"), actions=[Cancel()], out=None)


# -- toolkit calls a user gets wrong ------------------------------------------------------


async def test_holding_a_fake_provider_at_a_point_it_has_not_is_refused() -> None:
    """``hold("commited")`` was a hold nobody reaches: the test waited on it for ever."""
    provider = FakeProvider("mail")
    with pytest.raises(InvalidInput) as refused:
        provider.hold("commited")
    assert refused.value.what == "point"
    assert "'received', 'accepted', 'committed', 'responding'" in str(refused.value)
    assert provider.barriers.passed == []
    held = provider.hold("committed")  # a point it has is held as before
    assert not held.reached.is_set()


@pytest.mark.parametrize("actions", [["cancel"], [Cancel(), "crash"], [len]])
async def test_an_action_that_is_not_an_action_is_refused_by_name(actions: list[Any]) -> None:
    """``actions=["cancel"]`` (the names the table prints) was "the action str has no
    name: give its class a `name = ...`"."""
    with pytest.raises(InvalidInput) as refused:
        await explore(in_a_child, lambda: FakeProvider("mail"), actions=actions, out=None)
    assert refused.value.what == "actions"
    assert "is not an Action" in str(refused.value)


# -- the pytest fixture -------------------------------------------------------------------


def test_an_async_test_that_forgets_to_await_the_fixture_fails(tmp_path: Path) -> None:
    """``stopline_explore(...)`` without ``await`` explored nothing and the test passed
    (a RuntimeWarning aside): the case the fixture refuses a sync test for."""
    (tmp_path / "test_forgot_await.py").write_text(
        A_USERS_TEST + "@pytest.mark.anyio\n"
        "async def test_forgot(stopline_explore):\n"
        "    stopline_explore(send, lambda: FakeProvider('mail'))\n\n"
        "@pytest.mark.anyio\n"
        "async def test_awaited(stopline_explore):\n"
        "    only = 'point=accepted/mail action=cancel seed=0'\n"
        "    await stopline_explore(send, lambda: FakeProvider('mail'), only=only)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_forgot_await.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=100,
    )
    assert ran.returncode != 0, ran.stdout
    assert "stopline_explore(...) was called and never awaited: nothing was explored" in (
        ran.stdout
    )
    assert "ERROR test_forgot_await.py::test_forgot - Failed" in ran.stdout
    assert "PASSED test_forgot_await.py::test_awaited" in ran.stdout
    assert "ERROR test_forgot_await.py::test_awaited" not in ran.stdout
    assert "never awaited" not in ran.stderr


async def test_require_ground_truth_that_is_no_bool_is_refused() -> None:
    """``require_ground_truth="no"`` was true (every tool then needed a ground truth)."""

    async def workflow(run: stopline.Run, providers: Any) -> None:
        raise AssertionError("not run")

    with pytest.raises(InvalidInput) as refused:
        await explore(workflow, lambda: None, require_ground_truth=cast(bool, "no"))
    assert refused.value.what == "require_ground_truth"
