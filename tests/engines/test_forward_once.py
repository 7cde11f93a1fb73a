"""A stopline cancel is asked of the engine once per cancel (``EngineGate.forward``).

This process hears of its own cancel twice: from the cancel's return and from the
ledger's notification of the commit (the SQLite file watch, PostgreSQL's NOTIFY). Each
asked the engine to cancel the workflow: twice the engine's cancel calls for one stop.
A new cancel (after a resume) is asked again, and an ask that failed is asked again
(the background work's retry)."""

from __future__ import annotations

import anyio

import stopline
from stopline.integrations._engines import EngineGate


async def test_one_cancel_is_asked_of_the_engine_once_and_a_new_one_again(
    ledger_url: str,
) -> None:
    asked: list[str] = []
    moved = [anyio.Event()]  # the current one: set at each ask
    fail_next = [False]

    async def engine_cancel(workflow_id: str, reason: str) -> None:
        if fail_next[0]:
            fail_next[0] = False
            raise ConnectionError("the engine did not answer")
        asked.append(workflow_id)
        moved[0].set()

    async def until_asked(workflow_id: str, times: int) -> None:
        with anyio.fail_after(30):  # a guard: asks come in the background
            while asked.count(workflow_id) < times:
                moved[0] = anyio.Event()
                await moved[0].wait()

    async with stopline.open(ledger_url) as ledger:
        gate = EngineGate(ledger, engine="probe", owner="user:1")
        gate.forward_cancels(engine_cancel)
        try:
            await gate.open_run("wf-1", "wf")
            await ledger.cancel("wf-1", by="user:1")
            await until_asked("wf-1", 1)
            await gate.forward(["wf-1"])  # the same cancel heard again: not asked again
            assert asked == ["wf-1"]
            await ledger.resume("wf-1", by="user:1")
            await ledger.cancel("wf-1", by="user:1")  # a new cancel: asked again
            await until_asked("wf-1", 2)
            await gate.open_run("wf-2", "wf")
            fail_next[0] = True  # the first ask of this cancel fails
            await ledger.cancel("wf-2", by="user:1")
            await until_asked("wf-2", 1)  # the retry asks: the failed ask was not counted
        finally:
            gate.close()
