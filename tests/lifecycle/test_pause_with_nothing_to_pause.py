"""R9: a pause of a run that has ended, or that a cancel stopped, says there is nothing to
pause, in the terms of ``RunEnded`` as a resume does, and writes nothing.

Before: it raised ``IllegalTransition`` ("illegal transition: event 'pause' in state
'completed'"), and ``stopline pause`` printed those words and exited 1 as for an error.
"""

from __future__ import annotations

import pytest

import stopline
from stopline import RunState
from tests.lifecycle.test_probe_r10_pause_resume import ended_run


@pytest.mark.parametrize("ending", ["completed", "failed", "cancelled"])
async def test_a_pause_of_a_run_that_ended_raises_run_ended_and_writes_nothing(
    ledger: stopline.Ledger, ending: str
) -> None:
    await ended_run(ledger, "ended", ending)
    before = await ledger.backend.events("ended")
    with pytest.raises(stopline.RunEnded) as raised:
        await ledger.pause("ended", by="alice", reason="lunch")
    assert raised.value.state is RunState(ending)
    assert str(raised.value) == (f"run 'ended' has ended ({ending}): nothing runs in it to pause")
    assert not isinstance(raised.value, stopline.IllegalTransition)
    assert await ledger.backend.events("ended") == before  # nothing written
    assert (await ledger.backend.get_run("ended")).state is RunState(ending)


async def test_a_pause_of_a_paused_run_is_still_a_no_op(ledger: stopline.Ledger) -> None:
    """The refusal is for runs with nothing to pause; a second pause stays idempotent."""
    async with ledger.run("job", owner="alice", run_id="idle"):
        await ledger.pause("idle", by="alice")
        before = await ledger.backend.events("idle")
        receipt = await ledger.pause("idle", by="alice")
        assert receipt.run_state is RunState.PAUSED
        assert await ledger.backend.events("idle") == before
        await ledger.resume("idle", by="alice")
