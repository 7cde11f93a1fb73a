"""The main job: the seeds' report-upload-notify workflow, cancelled at four points.

Each run generates a report (a read), uploads it (a provider that can cancel
until it accepts) and notifies a channel (a provider that cannot cancel once
it accepts). A user presses stop at four points; the demo prints what the
user is told at that moment and once the evidence is in.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio

import stopline
from stopline import Cancellable, PhaseKind
from stopline.testing import Barriers, FakeProvider

__all__ = ["main", "run_demo"]

Say = Callable[[str], None]


@stopline.tool(effects=False)
async def generate_report(topic: str) -> str:
    """A read: no gate record, nothing to stop in the world."""
    await anyio.lowlevel.checkpoint()
    return f"Quarterly report on {topic}"


class Workflow:
    """generate -> upload -> notify, with a barrier the demo can hold."""

    def __init__(self, *, drop_notify_response: bool = False) -> None:
        self.upload = FakeProvider(
            "upload",
            description="upload the report to storage",
            cancellable=Cancellable.UNTIL_ACCEPTED,
        )
        self.notify = FakeProvider(
            "notify",
            description="notify #finance of the report",
            cancellable=Cancellable.NEVER,
            drop_response=drop_notify_response,
        )
        self.points = Barriers()

    async def __call__(self, run: stopline.Run) -> None:
        async with run.phase(PhaseKind.THINKING, stopline.Policy.AT_BOUNDARY):
            report = await run.call(generate_report, "sales")
            await self.points.reach("report_ready", run.id)
        async with run.phase(PhaseKind.CALLING_EXTERNAL):
            await run.call(self.upload.tool, report)
            await run.call(self.notify.tool, "New report uploaded")


async def _scenario(
    ledger: stopline.Ledger,
    title: str,
    workflow: Workflow,
    hold: Callable[[Workflow], stopline.testing.Barrier] | None,
    say: Say,
    canceller: stopline.Ledger,
) -> stopline.Receipt:
    say(f"\n== {title}")
    run_ids: list[str] = []
    barrier = hold(workflow) if hold is not None else None

    async def main() -> None:
        async with ledger.run("report-upload-notify", owner="user:42") as run:
            run_ids.append(run.id)
            await workflow(run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        if barrier is not None:
            await barrier.reached.wait()
            now = await canceller.cancel(run_ids[0], by="user:42", reason="pressed stop")
            say("At the moment of the cancel the user is told:")
            say(_indent(now.text()))
            barrier.release()
    if barrier is None:  # the run finished before the user pressed stop
        await ledger.cancel(run_ids[0], by="user:42", reason="pressed stop")
    final = await ledger.wait_settled(run_ids[0], timeout=15)
    say("Once the evidence is in:")
    say(_indent(final.text()))
    return final


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


async def run_demo(ledger_url: str, say: Say = print) -> list[stopline.Receipt]:
    budget = stopline.VerifyBudget(attempts=5, first_delay=0.05)
    steps: list[tuple[str, Workflow, Callable[[Workflow], stopline.testing.Barrier] | None]] = [
        (
            "1. Stop before the upload (from another process, like the CLI)",
            Workflow(),
            lambda w: w.points.hold("report_ready"),
        ),
        ("2. Stop during the upload", Workflow(), lambda w: w.upload.hold("received")),
        (
            "3. Stop after the notification was accepted, before its response (which is lost)",
            Workflow(drop_notify_response=True),
            lambda w: w.notify.hold("accepted"),
        ),
        ("4. Stop after everything finished", Workflow(), None),
    ]
    receipts = []
    async with (
        stopline.open(ledger_url, verify=budget) as ledger,
        stopline.open(ledger_url) as elsewhere,  # the user's stop button, in another process
    ):
        for n, (title, workflow, hold) in enumerate(steps):
            canceller = elsewhere if n == 0 else ledger
            receipts.append(await _scenario(ledger, title, workflow, hold, say, canceller))
    return receipts


def main(ledger_url: str | None = None) -> int:
    """Run the four scenarios and print their receipts; exit code 0 when all are truthful."""
    with tempfile.TemporaryDirectory() as tmp:
        url = ledger_url or f"sqlite:///{Path(tmp) / 'demo.db'}"
        print(f"stopline demo: ledger {url}")
        receipts = anyio.run(run_demo, url)
    expected = [
        stopline.Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
        stopline.Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
        stopline.Headline.STOPPED_WITH_COMPLETED_ACTIONS,
        stopline.Headline.COMPLETED,
    ]
    return 0 if [r.headline for r in receipts] == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
