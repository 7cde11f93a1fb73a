"""R14, ADR 0066: a tool that declared nothing about cancelling is not said to have a
provider that cannot cancel.

``Cancellable.NEVER`` is every tool's default, so the record of a tool that declared
nothing holds it as much as one that declared it. The receipt said "the provider
cannot cancel it" of such a call (once accepted: "the provider cannot cancel it once
accepted"), and "it runs to completion at the provider": what its provider could do
is not known. What the record proves is said instead: no way to cancel was declared,
so none is asked, and the provider may still complete it. A declared limit (cancel
until accepted) keeps its words (R12, S15).
"""

from __future__ import annotations

import anyio
import pytest

import stopline
from stopline import Cancellable, OpStatus
from tests.surfaces.test_cli import stopline_cli

pytestmark = pytest.mark.timeout(60)

UNDECLARED = "not declared cancellable: its provider is not asked to cancel it"


def accepting(
    name: str, accepted: anyio.Event, finish: anyio.Event, declared: Cancellable | None = None
) -> stopline.Tool[str]:
    """A tool its provider accepts, then holds until ``finish``; ``declared``: what it
    declares about cancelling (None: nothing, the default)."""

    async def send(ctx: stopline.CallContext, text: str) -> str:
        await ctx.accepted(ref=f"{name}:{ctx.key}")
        accepted.set()
        await finish.wait()
        return "sent"

    if declared is None:
        return stopline.tool(name=name)(send)
    return stopline.tool(name=name, cancellable=declared)(send)


async def test_an_undeclared_tool_accepted_is_not_said_to_be_uncancellable(
    ledger_url: str,
) -> None:
    finish = anyio.Event()
    undeclared_in, declared_in = anyio.Event(), anyio.Event()
    undeclared = accepting("post", undeclared_in, finish)  # nothing declared: the default
    declared = accepting("upload", declared_in, finish, Cancellable.UNTIL_ACCEPTED)
    assert undeclared.cancellable is Cancellable.NEVER

    async with (
        stopline.open(ledger_url) as ledger,
        anyio.create_task_group() as tg,
        ledger.run("job", owner="user:1", run_id="u") as run,
    ):

        async def call(tool: stopline.Tool[str], text: str) -> None:
            await run.call(tool, text, key=tool.name)

        tg.start_soon(call, undeclared, "hello")
        tg.start_soon(call, declared, "report")
        await undeclared_in.wait()
        await declared_in.wait()
        receipt = await ledger.receipt("u")
        shown = await anyio.to_thread.run_sync(lambda: stopline_cli("show", "u", ledger=ledger_url))
        finish.set()

    lines = {line.op_id: line for line in receipt.lines}
    post, upload = lines["u/post"], lines["u/upload"]
    assert (post.status, upload.status) == (OpStatus.ACCEPTED, OpStatus.ACCEPTED)
    assert post.provider_cancel == UNDECLARED
    assert post.recovery == "its provider may still complete it; then human review if no answer"
    # a declared limit keeps its words (R12)
    assert upload.provider_cancel == "the provider cannot cancel it once accepted"
    assert (
        upload.recovery == "it runs to completion at the provider; then human review if no answer"
    )
    # the CLI shows the same line
    assert f"- post: accepted by the provider; not finished yet; {UNDECLARED}" in shown.stdout
    assert "the provider cannot cancel it; " not in shown.stdout


async def test_the_note_of_a_cancel_not_asked_says_what_the_record_holds(
    ledger_url: str,
) -> None:
    """The cancel's note for an undeclared tool's call (shown in `stopline show`'s
    timeline) said "its policy says the provider cannot cancel it": it says that no way
    to cancel was declared, so none was asked."""
    sent, finish = anyio.Event(), anyio.Event()

    @stopline.tool(name="post")
    async def post(ctx: stopline.CallContext) -> str:
        sent.set()
        await finish.wait()
        return "posted"

    async with stopline.open(ledger_url) as ledger:
        async with anyio.create_task_group() as tg:

            async def work() -> None:
                async with ledger.run("job", owner="user:1", run_id="n") as run:
                    await run.call(post, key="post")

            tg.start_soon(work)
            await sent.wait()
            await ledger.cancel("n", by="user:1")
            finish.set()
        events = await ledger.backend.events("n")
    (note,) = [e for e in events if e.kind == "cancel_not_asked"]
    assert note.data is not None and note.data["detail"].startswith(UNDECLARED)
    assert "cannot cancel" not in note.data["detail"]
