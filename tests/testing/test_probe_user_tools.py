"""The testing toolkit from the outside: a user's own tool, its read-back, and bad input.

Each test here was a finding of trying ``stopline.testing`` as a user would: a bug
planted in a tool of one's own, an argument a user gets wrong, a read-back that
raises or hangs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput
from stopline.testing import CancelBehaviour, FakeProvider, Matrix
from stopline.testing.actions import Cancel, CrashWorker
from stopline.testing.checks import Observed, check
from stopline.testing.explorer import ExplorerError, explore
from stopline.testing.mutations import receipt_overclaims

Explore = Callable[..., Awaitable[Matrix]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Mailbox:
    """A destination of the user's own; ``read_back`` is how its verifier behaves."""

    def __init__(self, read_back: str = "honest", *, raise_after_send: bool = False) -> None:
        self.sent: list[str] = []

        @stopline.tool(name="send_mail", cancellable=Cancellable.UNTIL_ACCEPTED)
        async def send_mail(ctx: stopline.CallContext, text: str) -> str:
            if ctx.key not in self.sent:
                self.sent.append(ctx.key)
            if raise_after_send:
                raise RuntimeError("sent, then the client library raised")
            return ctx.key

        @send_mail.verifier
        async def verify(ctx: stopline.CallContext) -> stopline.ReadBack:
            if read_back == "raises":
                raise ValueError("the read-back broke")
            if read_back == "hangs":
                await anyio.sleep_forever()
            if read_back == "says absent" or ctx.key not in self.sent:
                return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)
            return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)

        self.tool = send_mail


async def mail(run: stopline.Run, box: Mailbox) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        with contextlib.suppress(RuntimeError):  # the agent carries on after a tool error
            await run.call(box.tool, "invoice #42")


def sent(box: Mailbox) -> dict[str, list[str]]:
    return {"send_mail": box.sent}


async def send_invoice(run: stopline.Run, provider: FakeProvider) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(provider.tool, "invoice #42")


def mail_provider() -> FakeProvider:
    return FakeProvider("mail")


# -- a bug planted in the user's own tool is found ------------------------------------


async def test_a_read_back_that_denies_a_sent_mail_is_found_with_no_point_of_the_users() -> None:
    """A crash after the tool returned, before the ledger recorded it, leaves the effect
    to the read-back: the runtime's ``returned/<tool>`` point is there for every tool of
    the user's own (before it, a read-back that said "absent" passed every cell unless
    the user had planted a point of their own after the send)."""
    matrix = await explore(
        mail, lambda: Mailbox("says absent"), actions=[CrashWorker()], ground_truth=sent, out=None
    )
    cell = matrix.cell("returned/send_mail", "crash")
    assert cell.rules_broken == ("R3",)
    assert f"{cell.run_id}/1:send_mail is not_committed in the ledger" in cell.text()
    assert "tool 'send_mail' committed it" in cell.text()
    honest = await explore(
        mail, lambda: Mailbox(), actions=[CrashWorker()], ground_truth=sent, out=None
    )
    assert honest.ok and honest.cell("returned/send_mail", "crash").status.value == "pass"


async def test_a_fake_providers_matrix_has_no_returned_point() -> None:
    """A ``FakeProvider`` has that instant already (``responding``): its matrix is as
    docs/testing.md prints it."""
    matrix = await explore(send_invoice, mail_provider, actions=[Cancel()], out=None)
    assert not [p for p in matrix.points if p.startswith("returned/")]
    assert "responding/mail" in matrix.points


async def test_an_r8_overclaim_about_a_tool_of_ones_own_names_the_effects() -> None:
    with receipt_overclaims():
        matrix = await explore(
            mail,
            Mailbox,
            actions=[Cancel()],
            ground_truth=sent,
            out=None,
            only="point=returned/send_mail action=cancel seed=0",
        )
    cell = matrix.cell("returned/send_mail", "cancel")
    assert "while effects were committed: [" in cell.text()
    assert "providers had committed" not in cell.text()


# -- a read-back that raises or hangs --------------------------------------------------


async def _one_cell_with_read_back(read_back: str) -> Matrix:
    """A tool that sends, then raises: its outcome rests on ``read_back``."""
    return await explore(
        mail,
        lambda: Mailbox(read_back, raise_after_send=True),
        actions=[Cancel()],
        only="point=before_dispatch/send_mail action=cancel seed=0",
        ground_truth=sent,
        out=None,
    )


async def test_a_read_back_that_hangs_is_bounded_and_named_in_the_report() -> None:
    """The explorer's read-backs give up as production's do (after ``read_timeout``), so
    the call goes to review (the contract holds) and the report says why. Before, each
    read waited 30 s, past the explorer's wait for the run to settle: every cell the
    read-back was asked in failed "R2: the run did not settle", blaming the runtime."""
    matrix = await _one_cell_with_read_back("hangs")
    assert matrix.ok, matrix.report()
    assert "LEFT TO REVIEW in 1 cell(s): send_mail: the read-back gave no answer within" in (
        matrix.report()
    )


async def test_a_read_back_that_raises_is_named_in_the_report() -> None:
    matrix = await _one_cell_with_read_back("raises")
    assert matrix.ok
    assert matrix.reviews == {"send_mail: the read-back raised ValueError: the read-back broke": 1}


async def test_an_operation_left_unresolved_says_the_wait_ended_not_settled(
    tmp_path: Path,
) -> None:
    """A run that did not settle is not called settled: each unresolved operation is
    named with the evidence it rests on."""
    provider = FakeProvider("mail")
    hold = provider.hold("accepted")
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger,
        anyio.create_task_group() as tg,
    ):

        async def go() -> None:
            async with ledger.run("w", owner="u", run_id="r1") as run:
                await send_invoice(run, provider)

        tg.start_soon(go)
        await hold.reached.wait()
        backend = ledger.backend
        seen = Observed(
            run=await backend.get_run("r1"),
            ops=await backend.operations("r1"),
            events=await backend.events("r1"),
            receipt=await ledger.receipt("r1"),
            settled=False,
            providers={"mail": provider},
        )
        hold.release()
    violations, _ = check(seen)
    texts = [str(v) for v in violations]
    assert "R2: the run did not settle in time: running, receipt running" in texts
    assert "R2: r1/1:mail is still accepted when the wait for it ended (last evidence:" in (
        "\n".join(texts)
    )
    assert not any("once settled" in t for t in texts)


# -- the pytest fixture ---------------------------------------------------------------


async def test_the_fixture_warns_when_a_tool_has_no_ground_truth(stopline_explore: Explore) -> None:
    """A passing test's report is never shown: the NO GROUND TRUTH line is a warning."""
    with pytest.warns(UserWarning, match="NO GROUND TRUTH for 'send_mail'"):
        await stopline_explore(
            mail, Mailbox, actions=[Cancel()], only="point=returned/send_mail action=cancel seed=0"
        )


# -- bad input: a typed error naming it, before any run --------------------------------


def _explore_with(**changes: Any) -> Callable[[], Awaitable[Matrix]]:
    arguments: dict[str, Any] = {
        "workflow": send_invoice,
        "providers": mail_provider,
        "actions": [Cancel()],
        "out": None,
    }
    arguments.update(changes)
    workflow, providers = arguments.pop("workflow"), arguments.pop("providers")
    return lambda: explore(workflow, providers, **arguments)


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"seed": "abc"}, "seed"),  # printed as seed=abc, which no re-run line parses
        ({"seed": 1.5}, "seed"),
        ({"seed": None}, "seed"),
        ({"seed": True}, "seed"),
        ({"cell_timeout": 0}, "cell_timeout"),
        ({"actions": []}, "actions"),  # nothing explored: a test that proves nothing
        ({"actions": [Cancel]}, "actions"),  # the class, not an instance
        ({"only": 42}, "only"),
        ({"only": []}, "only"),  # ran every cell
        ({"verify": "fast"}, "verify"),
        ({"out": 5}, "out"),  # raised TypeError once every cell had run
        ({"ground_truth": {"send_mail": []}}, "ground_truth"),
        ({"providers": FakeProvider("mail")}, "providers"),  # the provider, not a factory
    ],
)
async def test_an_argument_explore_cannot_use_is_refused_by_name(
    changes: dict[str, Any], what: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        await _explore_with(**changes)()
    assert refused.value.what == what


async def test_a_memory_ledger_url_is_refused_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It made ``:memory:-<run id>.db`` files in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExplorerError, match="names no file"):
        await _explore_with(ledger_url="sqlite:///:memory:")()
    assert [p async for p in anyio.Path(tmp_path).iterdir()] == []


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"cancellable": "yes"}, "cancellable"),  # failed mid-run, blamed on the workflow
        ({"on_cancel": "maybe"}, "on_cancel"),  # quietly confirmed every cancel
        ({"on_cancel": None}, "on_cancel"),
        ({"verifiable": "no"}, "verifiable"),  # "no" is true
        ({"drop_response": "sometimes"}, "drop_response"),
        ({"compensable": 3}, "compensable"),
        ({"name": ""}, "provider name"),  # its tool was named "_call"
        ({"name": None}, "provider name"),  # a TypeError sorting the points
    ],
)
def test_a_fault_plan_with_nonsense_values_is_refused(options: dict[str, Any], what: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        FakeProvider(**{"name": "mail", **options})
    assert refused.value.what == what


def test_a_fault_plan_may_name_its_values() -> None:
    provider = FakeProvider("mail", cancellable="after_accepted", on_cancel="refuse")  # type: ignore[arg-type]
    assert provider.tool.cancellable is Cancellable.AFTER_ACCEPTED
    assert provider.on_cancel is CancelBehaviour.REFUSE


@pytest.mark.parametrize(
    ("ground_truth", "said"),
    [
        (lambda box: 1 / 0, "ground_truth(providers) raised ZeroDivisionError"),
        (lambda box: ["x"], "ground_truth(providers) returned list"),
        (lambda box: {"send_mail": "x0-discover/1:send_mail"}, "must be the keys"),
        (lambda box: {"send_mail": [1]}, "holds 1: each key is the effect's ctx.key"),
    ],
)
async def test_a_ground_truth_that_fails_is_named_not_the_workflow(
    ground_truth: Callable[[Mailbox], Any], said: str
) -> None:
    with pytest.raises(ExplorerError) as stopped:
        await explore(mail, Mailbox, actions=[Cancel()], ground_truth=ground_truth, out=None)
    assert said in str(stopped.value)
    assert "the discovery run (the workflow on its own, no action) could not be played" in str(
        stopped.value
    )
