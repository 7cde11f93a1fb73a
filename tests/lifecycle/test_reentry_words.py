"""What re-entering a stopped run says of it (R14): a run being cancelled is stopped,
not ended; one that ended says so."""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import PhaseKind, Policy, RunState
from stopline.errors import RunEnded

pytestmark = pytest.mark.timeout(30)


async def test_reentering_a_run_still_settling_says_it_is_stopped_not_ended(
    ledger: stopline.Ledger,
) -> None:
    sent = anyio.Event()

    @stopline.tool
    async def deploy(ctx: stopline.CallContext) -> None:
        sent.set()
        await anyio.sleep_forever()

    @deploy.verifier
    async def _(ctx: stopline.CallContext) -> stopline.ReadBack:
        await anyio.sleep_forever()  # the read-back never answers: the run keeps settling
        raise AssertionError

    async with anyio.create_task_group() as tg:

        async def work() -> None:
            async with (
                ledger.run("deploy", owner="user:1", run_id="r") as run,
                run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE),  # the cancel cuts it
            ):
                await run.call(deploy, key="d")

        tg.start_soon(work)
        await sent.wait()
        await ledger.cancel("r", by="user:1")
    while (await ledger.backend.get_run("r")).state is not RunState.SETTLING:
        await ledger.wait_for_change("r")  # its call in doubt, being read back
    with pytest.raises(RunEnded) as stopped:
        async with ledger.run("deploy", owner="user:1", run_id="r"):
            pass
    assert "run 'r' is stopped (settling)" in str(stopped.value)
    assert "has ended" not in str(stopped.value)
