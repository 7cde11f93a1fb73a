"""A call that a committed cancel interrupts: it sees its cancel before the rest of the
delivery runs (providers asked, records started, listeners told), then unwinds on the
loop's next turn, its cancel going on up without the frames it came through inside
the tool; the cancel records it with the others.

The rest of the delivery waits one turn of the loop, shielded: a run that cancels
itself has its calls recorded all the same.

Those frames (the tool's, its sleep's) and their tracebacks were kept alive while
every other interrupted call of a tree took its turn: ten objects a call for CPython's
collector to walk, half of the collector's time in a 10,000-child tree's window. The
workflow still gets the cancel, and its own frames from ``run.call`` up.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import Cancellable, OpStatus, PhaseKind, Policy, RunState
from tests.support.held import Held

pytestmark = [pytest.mark.trio_too, pytest.mark.uvloop_too]


def frames(tb: types.TracebackType | None) -> list[str]:
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


async def test_an_interrupted_call_unwinds_without_the_tools_frames(
    ledger: stopline.Ledger,
) -> None:
    held = Held(ledger)
    receipt = await held.cancelled()
    (cancel,) = held.caught
    assert isinstance(cancel, anyio.get_cancelled_exc_class())
    names = frames(cancel.__traceback__)
    assert "workflow" in names  # the workflow's own way down is kept
    assert "hold_the_line" not in names  # the tool's is not
    assert receipt.run_state in (RunState.CANCELLING, RunState.CANCELLED)


async def test_the_workflow_gets_the_one_cancel_its_tool_saw(ledger: stopline.Ledger) -> None:
    """The interrupted call's turn of the loop throws no second cancel up: anyio's
    cancellation is level-triggered and its next pass throws the same cancel in again
    during that turn (on asyncio, where the turn is unshielded); the turn takes it, and
    what reaches the workflow is the cancel its tool saw, not another chained on it."""
    held = Held(ledger)
    await held.cancelled()
    ((seen,), (caught,)) = held.seen, held.caught
    assert caught is seen
    assert caught.__context__ is None


async def test_a_native_cancel_landing_in_the_turn_goes_on_up(tmp_path: Path) -> None:
    """Only the committed cancel's own next pass is taken in the interrupted call's
    turn. A native ``Task.cancel`` landing then (a framework stopping its task, an
    ``asyncio.timeout`` expiring) is not lost: it reaches the workflow, with the
    committed cancel as its context. Asyncio's loops only (this module's asyncio and
    uvloop): trio has no native cancel."""
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        await native_cancel_in_the_turn(ledger)


async def native_cancel_in_the_turn(ledger: stopline.Ledger) -> None:
    held = Held(ledger)

    @stopline.tool
    async def hold_the_line(ctx: stopline.CallContext) -> None:
        held.entered.set()
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError as cancel:
            held.seen.append(cancel)
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_soon(task.cancel, "native")  # lands in the turn
            raise

    held.tool = hold_the_line
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(held.workflow)
            await held.entered.wait()
            await ledger.cancel(held.ids[0], by="u")
    ((seen,), (caught,)) = held.seen, held.caught
    assert isinstance(caught, asyncio.CancelledError)
    assert caught.args == ("native",)
    assert caught.__context__ is seen
    (line,) = (await ledger.wait_settled(held.ids[0], timeout=20)).lines
    assert line.status is OpStatus.NEEDS_REVIEW  # recorded by the cancel all the same


async def test_an_interrupted_call_sees_its_cancel_before_the_listeners_are_told(
    tmp_path: Path,
) -> None:
    """On asyncio, whose ready queue is first in first out. Trio runs each batch of
    ready tasks in a random order on purpose, so there the delivery's rest comes before
    or after the interrupted call's first step, either way. The ledger's cancel watch
    is off: its own delivery of the same cancel, read from the file, could come first
    and tell the listeners at once."""
    seen_when_told: list[bool] = []
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}?cancel_poll_ms=0") as ledger:
        held = Held(ledger)
        ledger.on_cancel(lambda run_ids: seen_when_told.append(held.interrupted.is_set()))
        await held.cancelled()
    assert seen_when_told == [True]


async def test_a_run_that_cancels_itself_has_its_interrupted_calls_recorded(
    ledger: stopline.Ledger,
) -> None:
    """The cancelling task is inside the run's own block: the delivery's turn of the
    loop must not end it before the interrupted call is recorded."""
    held = Held(ledger)

    async def cancel_myself() -> None:
        await held.entered.wait()
        await ledger.cancel(held.ids[0], by="u")

    with anyio.fail_after(30):
        async with ledger.run("r", owner="u") as run:
            held.ids.append(run.id)
            async with (
                run.phase(PhaseKind.READING, Policy.IMMEDIATE),
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(cancel_myself)
                await run.call(held.tool)
        receipt = await ledger.wait_settled(held.ids[0], timeout=20)
    (line,) = receipt.lines
    # interrupted and recorded (no read-back: a person decides), not left requested
    assert line.status is OpStatus.NEEDS_REVIEW
    assert receipt.settled


async def cancel_an_upload(ledger: stopline.Ledger, n: int) -> bool:
    """One run's upload in flight, cancelled: whether its provider had been asked when
    ``cancel()`` returned."""
    entered, asked = anyio.Event(), anyio.Event()
    ids: list[str] = []

    @stopline.tool(name=f"upload_{n}", cancellable=Cancellable.UNTIL_ACCEPTED)
    async def upload(ctx: stopline.CallContext) -> None:
        entered.set()
        await anyio.sleep_forever()

    @upload.canceller
    async def _(ctx: stopline.CallContext) -> bool:
        asked.set()
        return True

    async def workflow() -> None:
        async with (
            ledger.run(f"r{n}", owner="u") as run,
            run.phase(PhaseKind.READING, Policy.IMMEDIATE),
        ):
            ids.append(run.id)
            await run.call(upload)

    async with anyio.create_task_group() as tg:
        tg.start_soon(workflow)
        await entered.wait()
        await ledger.cancel(ids[0], by="u")
        was_asked = asked.is_set()
    return was_asked


async def test_an_interrupted_calls_provider_is_asked_whatever_ran_first(
    ledger: stopline.Ledger,
) -> None:
    """``cancel()`` returns once the provider of the interrupted call has been asked,
    on trio too, where the delivery's rest and the interrupted call's first step run
    in either order (eight cancels meet both)."""
    with anyio.fail_after(30):
        assert [await cancel_an_upload(ledger, n) for n in range(8)] == [True] * 8
