"""A workload touching every kind of statement a ledger sends, for the plan tests.

Calls, a lost reply read back, a checkpoint, a tree's cancel with calls in
flight and its settling, a pause and a resume, an approval asked for and
granted, a correction, a reconciliation pass, the review queue, the workers in
flight, receipts one by one and a page of them, runs by state. Both engines'
plan tests run it and explain what it sent (``tests/ledger/test_sqlite_plans.py``,
``tests/postgres/test_workload_plans.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import anyio

import stopline
from stopline import RunState
from stopline.testing import FakeProvider
from tests.lifecycle.test_tree_cancel import cancel_a_tree

CHILDREN = 12  # enough ids that, unguided, SQLite prefers the state index to them

Hook = Callable[[stopline.Ledger], Awaitable[None]]


async def run_workload(url: str, *, traced: Hook, untraced: Hook) -> None:
    """The workload on the ledger at ``url``: ``traced(ledger)`` once it is open,
    ``untraced(ledger)`` before it closes."""
    send = FakeProvider("send", compensable=True)
    lossy = FakeProvider("lossy", drop_response=True)
    in_call = anyio.Event()
    entered: list[str] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        entered.append(ctx.op_id)
        if len(entered) == CHILDREN:
            in_call.set()
        await anyio.sleep_forever()

    async with stopline.open(url, tools=[hold, send.tool, lossy.tool]) as ledger:
        await traced(ledger)
        async with ledger.run("r", owner="u", run_id="r1") as run:
            for i in range(3):
                await run.call(send.tool, i, key=f"send{i}")
            await run.checkpoint("sent", {"n": 3})
            with contextlib.suppress(Exception):  # its reply lost: unknown, read back
                await run.call(lossy.tool, "x", key="lost")
        tree = await cancel_a_tree(ledger, hold, in_call, children=CHILDREN)
        await ledger.wait_settled(tree, timeout=30)

        async with ledger.run("p", owner="u", run_id="p1") as paused:
            await ledger.pause(paused.id, by="u")
            await ledger.resume(paused.id, by="u")
            approval = await paused.request_approval("pay", approver="u")
            await ledger.approve(approval.id, by="u")
        await ledger.compensate("r1/send0", by="u", reason="plan changed")
        await ledger.reconcile()
        await ledger.review_items()
        await ledger.backend.in_flight_workers()

        await ledger.receipt("r1")
        await ledger.receipt(tree)
        await ledger.receipts([run.id for run in await ledger.reads.runs(limit=200)])
        await ledger.runs_with_receipts(limit=200)
        await ledger.reads.runs(state=RunState.CANCELLED, limit=50)
        await ledger.reads.events("r1")
        await untraced(ledger)
