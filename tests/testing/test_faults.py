"""The explorer's own error paths: each becomes a cell's ``error`` or an ExplorerError,
a cancelled exploration ends, a crash cell leaves nothing open."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.testing import Barriers, CellStatus, FakeProvider
from stopline.testing.actions import Action, ActionContext, Cancel, CrashWorker
from stopline.testing.explorer import ExplorerError, explore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def send_invoice(run: stopline.Run, mail: FakeProvider) -> None:
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(mail.tool, "invoice #42")


async def broken_agent(run: stopline.Run, mail: FakeProvider) -> None:
    raise RuntimeError("my agent is broken before it does anything")


async def test_a_workflow_failing_on_its_own_is_an_explorer_error() -> None:
    with pytest.raises(ExplorerError, match="my agent is broken"):
        await explore(broken_agent, lambda: FakeProvider("mail"), actions=[Cancel()], out=None)


async def test_a_tool_the_runtime_refuses_is_an_explorer_error_naming_it() -> None:
    def plain_tool() -> Any:
        def send(ctx: stopline.CallContext, text: str) -> str:  # a plain def: not a tool
            return text

        return {"t": stopline.tool(name="t")(send)}  # type: ignore[arg-type]

    with pytest.raises(ExplorerError, match="providers factory raised InvalidInput"):
        await explore(send_invoice, plain_tool, actions=[Cancel()], out=None)


class Typo(Action):
    name = "cancel_as_admin"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel(by="admin", reson="policy")  # type: ignore[call-arg]


async def test_an_action_that_raises_is_that_cells_error_and_the_run_goes_on() -> None:
    matrix = await explore(
        send_invoice, lambda: FakeProvider("mail"), actions=[Typo(), Cancel()], out=None
    )
    typo = [c for c in matrix if c.action == "cancel_as_admin"]
    assert typo and all(c.status is CellStatus.ERROR for c in typo)
    assert all("TypeError" in c.note for c in typo)
    assert all(c.status is CellStatus.PASS for c in matrix if c.action == "cancel")


runs = 0


async def reminds_once(run: stopline.Run, mail: FakeProvider) -> None:
    global runs
    runs += 1
    first = runs == 1
    async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await run.call(mail.tool, "invoice")
        if first:
            await run.call(mail.tool, "first-time reminder")


async def test_a_point_not_reached_is_that_cells_error() -> None:
    global runs
    runs = 0
    matrix = await explore(
        reminds_once,
        lambda: FakeProvider("mail"),
        actions=[Cancel()],
        only="point=after_gate/mail#2 action=cancel seed=0",
        out=None,
    )
    (cell,) = matrix.cells
    assert cell.status is CellStatus.ERROR
    assert cell.note == "the workflow ended without reaching after_gate/mail#2"


class Unnamed(Action):
    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()


async def test_an_action_without_a_name_is_refused() -> None:
    with pytest.raises(ExplorerError, match="Unnamed has no name"):
        await explore(send_invoice, lambda: FakeProvider("mail"), actions=[Unnamed()], out=None)


@dataclasses.dataclass(slots=True)
class Slots:
    mail: FakeProvider


@dataclasses.dataclass
class Nested:
    services: dict[str, FakeProvider]


@pytest.mark.parametrize(
    "make",
    [lambda: Slots(FakeProvider("mail")), lambda: Nested({"mail": FakeProvider("mail")})],
    ids=["slots", "dict-in-object"],
)
async def test_providers_are_found_in_slots_and_nested_containers(make: Any) -> None:
    async def wf(run: stopline.Run, env: Any) -> None:
        mail = env.mail if isinstance(env, Slots) else env.services["mail"]
        await send_invoice(run, mail)

    matrix = await explore(wf, make, actions=[Cancel()], out=None)
    assert "received/mail" in matrix.points


async def test_two_providers_of_one_name_are_refused() -> None:
    async def wf(run: stopline.Run, p: dict[str, FakeProvider]) -> None:
        await send_invoice(run, p["orders"])

    with pytest.raises(ExplorerError, match="two FakeProviders are named 'api'"):
        await explore(
            wf,
            lambda: {"orders": FakeProvider("api"), "refunds": FakeProvider("api")},
            actions=[Cancel()],
            out=None,
        )


async def test_cancelling_explore_while_a_call_is_held_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outer cancel lands while the cell's call is held at a (shielded) runtime
    point: the hold is let go, explore() ends (it hung for ever) and leaves no
    temporary directory behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = 0
    with anyio.fail_after(30):  # a guard: a hang fails here, not on the suite's timeout
        with anyio.CancelScope() as outer:

            def providers() -> FakeProvider:
                nonlocal made
                made += 1
                return FakeProvider("mail")

            async def wf(run: stopline.Run, mail: FakeProvider) -> None:
                async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
                    with anyio.CancelScope(shield=True):
                        if made > 1:  # the cell, not the discovery run
                            outer.cancel()
                        await run.call(mail.tool, "invoice #42")

            await explore(
                wf,
                providers,
                actions=[Cancel()],
                only="point=before_dispatch/mail action=cancel seed=0",
                out=None,
            )
    assert outer.cancelled_caught
    assert [p.name async for p in anyio.Path(tmp_path).iterdir()] == []


class Sms:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.points = Barriers()

        @stopline.tool(name="send_sms", cancellable=stopline.Cancellable.UNTIL_ACCEPTED)
        async def send_sms(ctx: stopline.CallContext, text: str) -> str:
            await self.points.reach("queued", ctx.key)
            self.sent.append(ctx.key)
            return ctx.key

        @send_sms.canceller
        async def cancel(ctx: stopline.CallContext) -> None:
            return None  # asked; the gateway does not say

        self.tool = send_sms


async def test_a_canceller_answering_none_does_not_keep_the_cell_held() -> None:
    async def notify(run: stopline.Run, sms: Sms) -> None:
        async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL):
            await run.call(sms.tool, "shipped")

    matrix = await explore(
        notify,
        Sms,
        actions=[Cancel()],
        only="point=queued action=cancel seed=0",
        out=None,
        cell_timeout=10,
    )
    (cell,) = matrix.cells
    assert cell.status is not CellStatus.ERROR, cell.text()


def _ledger_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [p for p in out if "stopline-explore-" in p or "explore-" in Path(p).name]


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc/self/fd")
async def test_a_crash_cell_closes_the_dead_workers_ledger() -> None:
    matrix = await explore(
        send_invoice, lambda: FakeProvider("mail"), actions=[CrashWorker()], out=None
    )
    assert matrix.ok, matrix.report()
    assert [t for t in threading.enumerate() if t.name == "stopline-ledger"] == []
    assert _ledger_files() == []


class TimedOut(Action):
    """What pytest-timeout does: its ``Failed`` raised wherever the test is, here in a
    cell's action."""

    name = "timed_out"

    async def at_point(self, ctx: ActionContext) -> None:
        pytest.fail("Timeout (>1.0s) from pytest-timeout.")


async def test_a_test_runners_outcome_in_a_cell_ends_the_exploration() -> None:
    """pytest-timeout's ``Failed`` in a cell became that cell's error, and the
    exploration ran its other cells for half a minute past the test's timeout."""
    failed = pytest.fail.Exception
    with pytest.raises((failed, BaseExceptionGroup)) as raised:
        await explore(send_invoice, lambda: FakeProvider("mail"), actions=[TimedOut()], out=None)
    leaves = [raised.value]
    while isinstance(leaves[0], BaseExceptionGroup):
        leaves = list(leaves[0].exceptions)
    assert isinstance(leaves[0], failed) and "pytest-timeout" in str(leaves[0])
