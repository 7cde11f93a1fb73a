"""What ``cancel()`` has done when it returns (R14): the fence is durable, local work is
interrupted, and each provider it asks to cancel has been asked (the request recorded
and sent), without waiting for the answer."""

from __future__ import annotations

import anyio

import stopline
from stopline import Cancellable, PhaseKind, Policy
from tests.scenarios.workflows import Started, start


async def test_cancel_returns_once_the_provider_is_asked_not_once_it_answers(
    ledger: stopline.Ledger,
) -> None:
    entered, asked, answer = anyio.Event(), anyio.Event(), anyio.Event()

    @stopline.tool(cancellable=Cancellable.UNTIL_ACCEPTED)
    async def upload(ctx: stopline.CallContext) -> str:
        entered.set()
        await anyio.sleep_forever()
        return "uploaded"

    @upload.canceller
    async def _(ctx: stopline.CallContext) -> bool:
        asked.set()
        await answer.wait()  # the provider takes its time to answer
        return True

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.READING, Policy.IMMEDIATE):  # the cancel cuts it
            await run.call(upload)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await entered.wait()
        at_cancel = await ledger.cancel(started.run_id, by="user:1")
        assert asked.is_set()  # asked before cancel() returned
        assert not answer.is_set()  # and cancel() did not wait for the answer
        # the ask is in the receipt cancel() returns; its answer is not
        assert at_cancel.lines[0].provider_cancel.startswith("cancel asked; no answer")
        answer.set()
    final = await ledger.wait_settled(started.run_id, timeout=10)
    assert final.lines[0].provider_cancel == "the provider confirmed the cancel"
