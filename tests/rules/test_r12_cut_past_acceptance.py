"""R12 and R14 for a call whose cut sends its provider a cancel that its policy would
not ask: the record says why the policy would not have, as the tool declares it.

A tool that cancels only until accepted, accepted, then cut under ``immediate`` by a
cancel whose cut sends the provider a cancel by itself (an MCP task's ``tasks/cancel``,
``on_cut``): the ``cancel_asked`` note said "its tool is not declared cancellable
(R12)", which is false of a tool declared ``until_accepted``.
"""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import Cancellable, CancelState, PhaseKind, Policy
from tests.scenarios.workflows import Started, start

GUARD = 30


@pytest.mark.parametrize(
    ("cancellable", "why"),
    [
        (Cancellable.NEVER, "its tool is not declared cancellable (R12)"),
        (
            Cancellable.UNTIL_ACCEPTED,
            "its provider had accepted it, and its tool cancels only until then (R12)",
        ),
    ],
    ids=["never", "until-accepted"],
)
async def test_a_cut_that_sent_a_cancel_says_why_the_policy_would_not_have(
    ledger: stopline.Ledger, cancellable: Cancellable, why: str
) -> None:
    accepted, asked = anyio.Event(), anyio.Event()

    async def ask() -> object:
        asked.set()
        return False  # the provider refuses: it had accepted the work

    @stopline.tool(name=f"upload_{cancellable.value}", cancellable=cancellable)
    async def upload(ctx: stopline.CallContext) -> str:
        ctx.cancel_via("test/cancel", ask, on_cut=True)
        await ctx.accepted("job-1")
        accepted.set()
        await anyio.sleep_forever()
        return "uploaded"

    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await run.call(upload)

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        with anyio.fail_after(GUARD):
            await accepted.wait()
        await ledger.cancel(started.run_id, by="user:1")
    with anyio.fail_after(GUARD):  # the cut's cancel was sent, and its answer came
        while (await ledger.backend.operations(started.run_id))[0].cancel_state is not (
            CancelState.REFUSED
        ):
            await ledger.wait_for_change(started.run_id, poll=0.05)
    assert asked.is_set()
    (note,) = [e for e in await ledger.backend.events(started.run_id) if e.kind == "cancel_asked"]
    assert note.data.get("channel") == "test/cancel"
    assert str(note.data.get("detail", "")).endswith(why), note.data
