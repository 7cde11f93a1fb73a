"""A worker that pauses its own run and dies (ADR 0066): the run it leaves is paused with a
completed action, one that provably did not happen and one whose answer was lost.

``python -m tests.truth.advice_paused_worker LEDGER_URL RUN_ID``; the tools are
``tools()``'s, so a re-entry in another process calls the same ones by the same keys.
"""

from __future__ import annotations

import contextlib
import os
import sys

import anyio

import stopline
from stopline import OpStatus, VerifyBudget
from stopline.runtime.tool import Rejected

__all__ = ["run_workflow", "tools"]

BUDGET = VerifyBudget(attempts=1, first_delay=0.0)


def tools(
    sent: list[str], *, worker: bool
) -> tuple[stopline.Tool[object], stopline.Tool[object], stopline.Tool[object]]:
    """``pay``, ``transfer`` and ``notify``; each call that reaches one appends its key to
    ``sent``. In the worker, ``transfer`` is refused before it commits and ``notify``'s
    answer is lost (no read-back is declared: it goes to review)."""

    @stopline.tool
    async def pay(ctx: stopline.CallContext, amount: int) -> object:
        sent.append(ctx.key)
        return {"paid": amount}

    @stopline.tool
    async def transfer(ctx: stopline.CallContext, amount: int) -> object:
        sent.append(ctx.key)
        if worker:
            raise Rejected("insufficient funds", ref="bank:1")
        return {"moved": amount}

    @stopline.tool
    async def notify(ctx: stopline.CallContext, text: str) -> object:
        sent.append(ctx.key)
        if worker:
            raise ConnectionResetError("dropped before any answer")
        return {"told": text}

    return pay, transfer, notify


async def run_workflow(run: stopline.Run, sent: list[str], *, worker: bool) -> None:
    """The workflow: the same calls, by the same keys, wherever it runs."""
    pay, transfer, notify = tools(sent, worker=worker)
    await run.call(pay, 120, key="pay")
    with contextlib.suppress(Rejected):  # in the worker: refused before it committed
        await run.call(transfer, 50, key="transfer")
    with contextlib.suppress(ConnectionResetError):  # in the worker: its answer lost
        await run.call(notify, "paid", key="notify")


async def main(url: str, run_id: str) -> None:
    async with (
        stopline.open(url, verify=BUDGET) as ledger,
        ledger.run("job", owner="user:1", run_id=run_id) as run,
    ):
        await run_workflow(run, [], worker=True)
        with anyio.fail_after(30):  # its lost answer is in review: nothing moves after
            while (
                await ledger.backend.get_operation(f"{run_id}/notify")
            ).status is not OpStatus.NEEDS_REVIEW:
                await ledger.wait_for_change(run_id)
        await ledger.pause(run_id, by="user:1")
        os._exit(0)  # the worker dies with its run paused


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
