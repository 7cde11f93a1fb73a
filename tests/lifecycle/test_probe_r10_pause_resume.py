"""R9/R10 probe: a pause holds a retry as it holds a first attempt; a resume of a run that
ended says so.

Before: a ``Retry`` attempt after a rejected one, in a run paused meanwhile, met the
gate's ``EXISTING`` answer and raised ``OperationInDoubt`` ("outcome is
'not_committed'; verify or review it"): the pause failed the run. And
``ledger.resume`` of a completed run returned "Resumed run ...: continue from the
start." while nothing was resumed: following it, the re-entry met ``RunEnded``.
"""

from __future__ import annotations

import contextlib

import anyio
import pytest

import stopline
from stopline import OpStatus, Retry, RunState
from stopline.testing import FakeProvider


async def test_a_retry_waits_at_the_gate_of_a_paused_run(ledger: stopline.Ledger) -> None:
    attempts: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext, what: str) -> str:
        attempts.append(ctx.key)
        if len(attempts) == 1:  # the user pauses while the first attempt fails
            await ledger.pause(ctx.run_id, by="alice")
            raise stopline.Rejected("busy, try later")
        return f"sent {what}"

    async def resume_once_held(run_id: str) -> None:
        while (await ledger.reads.run(run_id)).state is not RunState.PAUSED:
            await ledger.wait_for_change(run_id)  # the retry waiting at the gate pauses it
        assert attempts == ["rp/1:send"]  # held: not sent again while paused
        await ledger.resume(run_id, by="alice")

    with anyio.fail_after(30):  # a hang guard
        async with (
            ledger.run("job", owner="alice", run_id="rp") as run,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(resume_once_held, run.id)
            answer = await run.call(send, "x", retry=Retry(attempts=2, backoff=0.01))
    assert answer == "sent x"
    assert attempts == ["rp/1:send", "rp/1:send"]  # the same key, once more after the resume
    receipt = await ledger.receipt("rp")
    assert receipt.run_state is RunState.COMPLETED
    assert [line.status for line in receipt.lines] == [OpStatus.COMMITTED]


@pytest.mark.parametrize("ending", ["completed", "failed"])
async def test_a_resume_of_a_run_that_ended_says_nothing_was_resumed(
    ledger: stopline.Ledger, ending: str
) -> None:
    """A no-op, as a second resume is (a pause lets a run complete, and the resume that
    follows it must not fail), but never worded "Resumed ...: continue from ..."."""
    await ended_run(ledger, "ended", ending)
    before = await ledger.backend.events("ended")
    resumed = await ledger.resume("ended", by="alice")
    assert str(resumed) == f"Run ended has ended ({ending}): nothing to resume."
    assert resumed.run.state is RunState(ending)
    assert await ledger.backend.events("ended") == before  # nothing written


async def ended_run(ledger: stopline.Ledger, run_id: str, ending: str) -> None:
    """A run of one call that ended ``ending``: completed, failed (its workflow raised),
    or cancelled (by its owner, inside its block), settled."""
    send = FakeProvider("send")
    failing = pytest.raises(RuntimeError) if ending == "failed" else contextlib.nullcontext()
    with failing:
        async with ledger.run("job", owner="alice", run_id=run_id) as run:
            await run.call(send.tool, 1)
            if ending == "failed":
                raise RuntimeError("the workflow failed")
            if ending == "cancelled":
                await ledger.cancel(run_id, by="alice")
    await ledger.wait_settled(run_id)
