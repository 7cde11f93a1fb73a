"""In-process workflows the explorer tests drive.

``report_upload_notify`` is the demo's workflow (``stopline.demo``) with its
providers in-process: the demo now calls them on a real MCP server in a
subprocess, which is right for the demo and too slow to run a hundred times.
"""

from __future__ import annotations

import anyio

import stopline
from stopline import Cancellable, PhaseKind, Policy
from stopline.testing import Barriers, CancelBehaviour, FakeProvider


@stopline.tool(effects=False)
async def generate_report(topic: str) -> str:
    await anyio.lowlevel.checkpoint()
    return f"Quarterly report on {topic}"


class Demo:
    """The demo's providers: upload cancels until it accepts, notify never cancels."""

    def __init__(self) -> None:
        self.upload = FakeProvider(
            "upload", description="upload the report", cancellable=Cancellable.UNTIL_ACCEPTED
        )
        self.notify = FakeProvider(
            "notify", description="notify #finance", cancellable=Cancellable.NEVER
        )
        self.points = Barriers()


async def report_upload_notify(run: stopline.Run, demo: Demo) -> None:
    async with run.phase(PhaseKind.THINKING, Policy.AT_BOUNDARY):
        report = await run.call(generate_report, "sales")
        await demo.points.reach("report_ready", run.id)
    async with run.phase(PhaseKind.CALLING_EXTERNAL):
        await run.call(demo.upload.tool, report)
        await run.call(demo.notify.tool, "New report uploaded")


class Delegated:
    """A handoff-like step, an approval-like wait and a compensable tool."""

    def __init__(self) -> None:
        self.research = FakeProvider("research", cancellable=Cancellable.AFTER_ACCEPTED)
        self.draft = FakeProvider(
            "draft", cancellable=Cancellable.AFTER_ACCEPTED, on_cancel=CancelBehaviour.REFUSE
        )
        self.reserve = FakeProvider(
            "reserve", cancellable=Cancellable.UNTIL_ACCEPTED, compensable=True
        )
        self.points = Barriers()


async def handoff_approve_reserve(run: stopline.Run, p: Delegated) -> None:
    # a handoff: two sequential sub-steps; a cancel lets the current one finish
    async with run.phase(PhaseKind.HANDOFF, Policy.AT_BOUNDARY):
        await run.call(p.research.tool, "facts")
        await run.call(p.draft.tool, "draft")
    # waiting for a human's approval: nothing in the world changes while waiting
    async with run.phase(PhaseKind.AWAITING_APPROVAL):
        await p.points.reach("approval_requested", run.id)
    async with run.phase(PhaseKind.COMMITTING):
        await run.call(p.reserve.tool, "seat 12A")
