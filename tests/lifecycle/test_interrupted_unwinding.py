"""A call that a committed cancel interrupts: recorded with the others at the delivery,
then unwound on the loop's next turn, its cancel going on up without the frames it
came through inside the tool.

Those frames (the tool's, its sleep's) and their tracebacks were kept alive while
every other interrupted call of a tree took its turn: ten objects a call for CPython's
collector to walk, half of the collector's time in a 10,000-child tree's window. The
workflow still gets the cancel, and its own frames from ``run.call`` up.
"""

from __future__ import annotations

import types

import anyio
import pytest

import stopline
from stopline import PhaseKind, Policy, RunState

pytestmark = pytest.mark.trio_too


def frames(tb: types.TracebackType | None) -> list[str]:
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


async def test_an_interrupted_call_unwinds_without_the_tools_frames(
    ledger: stopline.Ledger,
) -> None:
    entered = anyio.Event()
    seen: list[BaseException] = []
    ids: list[str] = []

    @stopline.tool
    async def hold_the_line(ctx: stopline.CallContext) -> None:
        entered.set()
        await anyio.sleep_forever()

    async def workflow() -> None:
        async with ledger.run("r", owner="u") as run:
            ids.append(run.id)
            async with run.phase(PhaseKind.READING, Policy.IMMEDIATE):
                try:
                    await run.call(hold_the_line)
                except BaseException as exc:
                    seen.append(exc)
                    raise

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await entered.wait()
            receipt = await ledger.cancel(ids[0], by="u")

    (cancel,) = seen
    assert isinstance(cancel, anyio.get_cancelled_exc_class())
    names = frames(cancel.__traceback__)
    assert "workflow" in names  # the workflow's own way down is kept
    assert "hold_the_line" not in names  # the tool's is not
    assert receipt.run_state in (RunState.CANCELLING, RunState.CANCELLED)
