"""``stopline.testing`` from the outside, seventh probe: a child run's cancel answer, a
provider that commits after its caller died, a hold no call reaches, and what a user's
own action or input can get wrong.

Each test was a finding: the explorer judged a cell before what it acted on had played
out (the same cell committed once and not the next time), never explored an effect
landing after a crash, waited for ever on a hold, or passed an exploration of nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline.domain.model import CancelState
from stopline.domain.vocab import Cancellable, OpStatus
from stopline.errors import InvalidInput
from stopline.runtime.tool import ReadBack, Verdict
from stopline.testing import Barriers, CellStatus, FakeProvider
from stopline.testing.actions import (
    Action,
    ActionContext,
    Cancel,
    CrashLateCommit,
    CrashWorker,
    Point,
    RefuseCancel,
)
from stopline.testing.explorer import CORE_ACTIONS, DEFAULT_ACTIONS, ExplorerError, explore
from tests.testing.test_faults import send_invoice

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a child run's call in flight, cancelled with its parent ------------------------------


class Outbox:
    """A destination of the user's own. It answers a cancel once the request has left
    its queue, or after a short while (its own deadline): a cancel answered only once
    the call was let go finds the mail sent, and refuses."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.stopped: set[str] = set()
        self.points = Barriers()
        self.left_queue = anyio.Event()

        @stopline.tool(name="send_mail", cancellable=Cancellable.UNTIL_ACCEPTED)
        async def send_mail(ctx: stopline.CallContext, text: str) -> str:
            await self.points.reach("queued", ctx.key)
            self.left_queue.set()
            if ctx.key in self.stopped:
                raise stopline.Rejected("cancelled while queued", ref=ctx.key)
            if ctx.key not in self.sent:
                self.sent.append(ctx.key)
            return ctx.key

        @send_mail.canceller
        async def cancel(ctx: stopline.CallContext) -> bool:
            with anyio.move_on_after(0.3):  # a bound, not a barrier: the answer's deadline
                await self.left_queue.wait()
            if ctx.key in self.sent:
                return False
            self.stopped.add(ctx.key)
            return True

        @send_mail.verifier
        async def read_back(ctx: stopline.CallContext) -> stopline.ReadBack:
            if ctx.key in self.sent:
                return stopline.ReadBack(stopline.Verdict.COMMITTED, ctx.key)
            return stopline.ReadBack(stopline.Verdict.NOT_COMMITTED, ctx.key, ended=True)

        self.tool = send_mail


async def hands_off_to_a_sender(run: stopline.Run, box: Outbox) -> None:
    """The parent hands off at a boundary: the cancel leaves the child's call in flight."""
    handoff = run.phase(stopline.PhaseKind.HANDOFF, stopline.Policy.AT_BOUNDARY)
    async with handoff, run.child("sender") as sub, sub.phase(stopline.PhaseKind.CALLING_EXTERNAL):
        await sub.call(box.tool, "invoice #42")


class CancelAndLook(Action):
    """``cancel``, then what the ledger says of each call's cancel once it returned."""

    name = "cancel_and_look"

    def __init__(self) -> None:
        self.seen: list[tuple[str, CancelState, OpStatus]] = []

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()
        ops = await ctx.ledger.backend.operations(ctx.run_id, descendants=True)
        self.seen.extend((op.id, op.cancel_state, op.status) for op in ops)


async def test_a_cancel_waits_for_the_answer_of_a_child_runs_call_in_flight() -> None:
    """``ActionContext.cancel`` waited for the answers of the parent's own calls alone: a
    child's call was let go while its canceller was still answering, and the same cell
    committed the mail once and stopped it the next time."""
    look = CancelAndLook()
    boxes: list[Outbox] = []

    def outbox() -> Outbox:
        boxes.append(Outbox())
        return boxes[-1]

    matrix = await explore(
        hands_off_to_a_sender,
        outbox,
        actions=[look],
        ground_truth=lambda box: {"send_mail": box.sent},
        only="point=queued action=cancel_and_look seed=0",
        out=None,
    )
    (cell,) = matrix.cells
    assert look.seen == [
        (f"{cell.run_id}:sender/1:send_mail", CancelState.CONFIRMED, OpStatus.NOT_COMMITTED)
    ], cell.text()
    assert cell.status is CellStatus.PASS, cell.text()
    assert cell.headline is not None
    assert cell.headline.value == "canceled_before_external_action"
    assert boxes[-1].sent == []


# -- the provider commits after the worker died ------------------------------------------


async def test_a_provider_committing_after_the_worker_died_is_read_back_committed(
    tmp_path: Path,
) -> None:
    """No cell let a provider commit once its caller had died: the crash cancelled the
    fake's work with the worker's, so "the request may still land" was never explored.
    ``crash_late_commit`` kills the worker with the request at the provider, which
    carries it out; the fresh worker's recovery must read it back ``committed``."""
    made: list[FakeProvider] = []

    def mail() -> FakeProvider:
        made.append(FakeProvider("mail"))
        return made[-1]

    matrix = await explore(
        send_invoice,
        mail,
        actions=[CrashWorker(), CrashLateCommit()],
        ledger_url=f"sqlite:///{tmp_path / 'explore.db'}",
        out=None,
    )
    assert matrix.ok, matrix.report()
    ran = matrix.with_status(CellStatus.PASS)
    assert {c.point for c in ran if c.action == "crash_late_commit"} == {
        "received/mail",
        "accepted/mail",
    }
    assert matrix.cell("committed/mail", "crash_late_commit").note == (
        "the provider holds no request it has yet to commit here"
    )
    alone = await explore(
        send_invoice,
        mail,
        actions=[CrashLateCommit()],
        only="point=accepted/mail action=crash_late_commit seed=0",
        ledger_url=f"sqlite:///{tmp_path / 'alone.db'}",
        out=None,
    )
    (cell,) = alone.cells
    op_id = f"{cell.run_id}/1:mail"
    assert made[-1].landed == [op_id] and made[-1].effects == [op_id]
    async with stopline.open(f"sqlite:///{tmp_path / f'alone-{cell.run_id}.db'}") as ledger:
        events = await ledger.backend.events(cell.run_id)
        op = await ledger.backend.get_operation(op_id)
    moves = [(str(e.kind), e.to_state) for e in events if e.op_id == op_id]
    assert moves[-2:] == [("lost", "unknown"), ("verified_committed", "committed")]
    assert op.status is OpStatus.COMMITTED and op.cause is not None
    assert op.cause.value == "crash"


def blind_to_late_commits() -> FakeProvider:
    """Its read-back searches an index that only answered requests reach: an effect
    carried out after its caller had gone is not found."""
    provider = FakeProvider("mail")

    async def read_back(ctx: stopline.CallContext) -> ReadBack:
        if ctx.key in provider.committed and ctx.key not in provider.landed:
            return ReadBack(Verdict.COMMITTED, ctx.key, "found by key")
        return ReadBack(Verdict.NOT_COMMITTED, ctx.key, "no such key")

    provider.tool.verify_fn = read_back
    return provider


async def test_a_read_back_blind_to_a_late_commit_is_r3_in_the_late_commit_cells() -> None:
    """Every ``crash`` cell passed such a read-back: there, nothing landed after the crash
    for it to miss, and recovery's ``not_committed`` was true."""
    matrix = await explore(
        send_invoice, blind_to_late_commits, actions=[CrashWorker(), CrashLateCommit()], out=None
    )
    assert all(c.ok for c in matrix if c.action == "crash"), matrix.report()
    broken = {c.point: c for c in matrix.broken("R3")}
    assert set(broken) == {"received/mail", "accepted/mail"}, matrix.report()
    for cell in broken.values():
        assert cell.action == "crash_late_commit"
        assert (
            f"R3: {cell.run_id}/1:mail is not_committed in the ledger; provider 'mail' "
            "committed it" in cell.text()
        )


async def test_a_provider_that_outlives_a_cut_call_carries_it_out(tmp_path: Path) -> None:
    """``outlives_caller``: a call the cancel cuts at ``accepted`` is carried out all the
    same; the ledger reads it back ``committed`` and the receipt does not deny it."""
    provider = FakeProvider("mail", outlives_caller=True)
    held = provider.hold("accepted")
    async with stopline.open(f"sqlite:///{tmp_path / 'cut.db'}") as ledger:

        async def workflow() -> None:
            async with ledger.run("send", owner="me", run_id="cut") as run:
                now = stopline.Policy.IMMEDIATE  # the cancel cuts the call in flight
                async with run.phase(stopline.PhaseKind.CALLING_EXTERNAL, now):
                    await run.call(provider.tool, "invoice #42")

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await held.reached.wait()
            await ledger.cancel("cut", by="me")
        receipt = await ledger.wait_settled("cut", timeout=10)
        op = await ledger.backend.get_operation("cut/1:mail")
    assert provider.landed == ["cut/1:mail"] and provider.effects == ["cut/1:mail"]
    assert op.status is OpStatus.COMMITTED
    assert receipt.headline.value == "stopped_with_completed_actions"


def test_outlives_caller_is_checked_when_made() -> None:
    with pytest.raises(InvalidInput) as refused:
        FakeProvider("mail", outlives_caller="yes")  # type: ignore[arg-type]
    assert refused.value.what == "outlives_caller"


def test_the_late_commit_is_a_core_action() -> None:
    assert any(isinstance(a, CrashLateCommit) for a in CORE_ACTIONS)
    assert DEFAULT_ACTIONS[: len(CORE_ACTIONS)] == CORE_ACTIONS


# -- a hold no call reaches -------------------------------------------------------------


async def test_holding_responding_on_a_provider_that_drops_its_response_is_refused(
    tmp_path: Path,
) -> None:
    """``hold("responding")`` with ``drop_response=True`` waited for a point no call
    reaches (the call raises at ``committed``): the test hung."""
    lossy = FakeProvider("mail", drop_response=True)
    for hold in (lossy.hold, lossy.barriers.hold):
        with pytest.raises(InvalidInput) as refused:
            hold("responding")
        assert refused.value.what == "point"
        assert "drops its responses (drop_response=True)" in str(refused.value)
        assert "never reach 'responding' (hold 'committed')" in str(refused.value)
    held = lossy.hold("committed")  # the point before the drop is held as before
    async with (
        stopline.open(f"sqlite:///{tmp_path / 'drop.db'}") as ledger,
        ledger.run("send", owner="me", run_id="drop") as run,
    ):

        async def call() -> None:
            with pytest.raises(ConnectionResetError):
                await run.call(lossy.tool, "invoice #42")

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await held.reached.wait()
            held.release()
    assert lossy.dropped == ["drop/1:mail"]
    lossy.drop_response = False  # its calls reach "responding" again: it may be held
    assert not lossy.hold("responding").reached.is_set()


def test_dropping_responses_while_responding_is_held_is_refused() -> None:
    """The other order: a hold of ``responding`` waits, then the provider drops."""
    provider = FakeProvider("mail")
    held = provider.hold("responding")
    with pytest.raises(InvalidInput) as refused:
        provider.drop_response = True
    assert "a hold of 'responding' waits for a call" in str(refused.value)
    assert provider.drop_response is False
    held.release()
    with pytest.raises(InvalidInput) as odd:
        provider.drop_response = "sometimes"  # type: ignore[assignment]
    assert odd.value.what == "drop_response"


# -- a user's own action, and odd inputs --------------------------------------------------


class AppliesAnswersABool(Action):
    """A user's action reading ``applies`` as "does it apply?"."""

    name = "cancel_here"

    def applies(self, point: Point) -> Any:
        return point.name == "received"

    async def at_point(self, ctx: ActionContext) -> None:
        await ctx.cancel()


async def test_an_action_whose_applies_answers_a_bool_is_refused() -> None:
    """``applies`` returning True or False made every cell n/a (any answer but None is a
    reason), and the matrix of nothing passed."""
    with pytest.raises(ExplorerError, match=r"AppliesAnswersABool.applies\(\) returned "):
        await explore(
            send_invoice, lambda: FakeProvider("mail"), actions=[AppliesAnswersABool()], out=None
        )


async def test_an_exploration_whose_every_cell_is_n_a_is_an_explorer_error() -> None:
    """A provider that cannot cancel, explored with ``refuse_cancel`` alone: every cell
    n/a, ``matrix.ok``, and the test passed having run nothing."""
    never = Cancellable.NEVER
    with pytest.raises(ExplorerError, match="every cell is n/a: nothing was explored") as e:
        await explore(
            send_invoice,
            lambda: FakeProvider("mail", cancellable=never),
            actions=[RefuseCancel()],
            out=None,
        )
    assert "refuse_cancel: the provider cannot cancel: nothing to refuse" in str(e.value)
    only = "point=received/mail action=refuse_cancel seed=0"  # asked for by name: told
    alone = await explore(
        send_invoice,
        lambda: FakeProvider("mail", cancellable=never),
        actions=[RefuseCancel()],
        only=only,
        out=None,
    )
    assert [c.status for c in alone.cells] == [CellStatus.NOT_APPLICABLE]


async def test_a_workflow_that_is_not_async_is_named_so() -> None:
    """A plain ``def`` workflow failed as "NoneType can't be used in 'await' expression"."""

    def plain(run: stopline.Run, mail: FakeProvider) -> None:
        return None

    with pytest.raises(ExplorerError) as refused:
        await explore(plain, lambda: FakeProvider("mail"), actions=[Cancel()], out=None)  # type: ignore[arg-type]
    assert "the workflow returned NoneType, not an awaitable: write it as async def" in str(
        refused.value
    )


async def test_odd_inputs_to_a_fake_provider_and_its_barriers_are_refused() -> None:
    """``of_run("name")`` read the name's characters as keys, ``of_runs(which, "run")``
    the id's, ``respond_late`` of a key never committed was a ``KeyError``, and a hold
    of a point that is not a name waited for ever."""
    provider = FakeProvider("mail")
    with pytest.raises(InvalidInput) as which:
        provider.of_run("name", "run")
    assert which.value.what == "which" and "'requests', 'effects'" in str(which.value)
    with pytest.raises(InvalidInput) as ids:
        provider.of_runs("effects", "run")
    assert ids.value.what == "run_ids"

    async def deliver(key: str, response: Any) -> None:
        raise AssertionError("nothing to deliver")

    with pytest.raises(InvalidInput) as late:
        await provider.respond_late("run/1:mail", deliver)
    assert late.value.what == "key" and provider.late == []
    for point in (3, ""):
        with pytest.raises(InvalidInput):
            Barriers().hold(point)  # type: ignore[arg-type]
