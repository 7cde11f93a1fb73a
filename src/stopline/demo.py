"""The main job: the seeds' report-upload-notify workflow, stopped six ways.

Each run generates a report (a read), uploads it (a provider that can cancel
until it accepts) and notifies a channel (a provider that cannot cancel once
it accepts). Both providers are tools on a real MCP server that the demo
spawns over stdio (``stopline.integrations.mcp.testing``), with their own
ground truth in the server's durable record; every call goes through the MCP
protocol. A user presses stop at four points; the demo prints what the user
is told at that moment and once the evidence is in.

Two more runs finish the seeds' story with a partner in this process: a
report already shared with it is corrected (its share withdrawn: "correction
queued"), and a post to its inbox whose answer is lost, and which nothing can
read back, goes to a human ("human review required"). The demo prints all
four of the seeds' receipt headlines (``SEED_HEADLINES``).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from mcp_types import CONNECTION_CLOSED

import stopline
from mcp import MCPError
from stopline import Cause, Compensation, Headline, PhaseKind, Policy
from stopline.domain.receipt import HEADLINE_MESSAGES
from stopline.runtime.context import CallContext
from stopline.testing import Barriers

__all__ = ["EXPECTED", "SEED_HEADLINES", "main", "run_demo"]

# The four receipts the seeds promise, as the user reads them.
SEED_HEADLINES = tuple(
    HEADLINE_MESSAGES[h]
    for h in (
        Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
        Headline.AWAITING_CONFIRMATION,
        Headline.CORRECTION_QUEUED,
        Headline.NEEDS_REVIEW,
    )
)
# The final headline of each of the demo's runs, in order.
EXPECTED = (
    Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
    Headline.CANCELED_BEFORE_EXTERNAL_ACTION,
    Headline.STOPPED_WITH_COMPLETED_ACTIONS,
    Headline.COMPLETED,
    Headline.CORRECTED,
    Headline.NEEDS_REVIEW,
)

Say = Callable[[str], None]


@stopline.tool(effects=False)
async def generate_report(topic: str) -> str:
    """A read: no gate record, nothing to stop in the world."""
    await anyio.lowlevel.checkpoint()
    return f"Quarterly report on {topic}"


class Hold:
    """A point where the demo holds the workflow: here (local) or on the MCP server."""

    def __init__(self, reached: Callable[[], Awaitable[None]], release: Callable[[], Any]) -> None:
        self.reached = reached
        self.release = release


class Workflow:
    """generate -> upload -> notify over MCP, with a local barrier the demo can hold."""

    def __init__(self, mcp: Any) -> None:
        self.mcp = mcp
        self.points = Barriers()

    async def __call__(self, run: stopline.Run) -> None:
        async with run.phase(PhaseKind.THINKING, stopline.Policy.AT_BOUNDARY):
            report = await run.call(generate_report, "sales")
            await self.points.reach("report_ready", run.id)
        async with run.phase(PhaseKind.CALLING_EXTERNAL):
            await self.mcp.call(run, "upload", {"payload": report})
            await self.mcp.call(run, "notify", {"payload": "New report uploaded"})

    def hold_here(self, point: str) -> Hold:
        barrier = self.points.hold(point)

        async def reached() -> None:
            await barrier.reached.wait()

        async def release() -> None:
            barrier.release()

        return Hold(reached, release)

    async def hold_on_server(self, point: str, fault: str = "") -> Hold:
        """Hold the next call at ``point`` (e.g. ``"received:upload"``) on the server."""
        client = self.mcp.client
        await client.call_tool("ctl_hold", {"point": point})
        if fault:
            await client.call_tool("ctl_fault", {"tool": point.split(":")[1], "fault": fault})

        async def reached() -> None:
            await client.call_tool("ctl_reached", {"point": point})

        async def release() -> None:
            try:
                await client.call_tool("ctl_release", {"point": point})
            except MCPError as exc:
                # a server told to die once released may die before it answers this
                if not (fault == "die" and exc.code == CONNECTION_CLOSED):
                    raise

        return Hold(reached, release)


class Partner:
    """A partner in this process: a shared folder whose shares can be withdrawn, and an
    inbox whose posts cannot be read back. The demo holds it at named points."""

    def __init__(self) -> None:
        self.points = Barriers()
        self.shared: dict[str, str] = {}  # key -> report: the partner's ground truth
        self.withdrawn: list[str] = []
        self.inbox: list[str] = []
        self.share = stopline.tool(
            name="share_report",
            description="share the report with the partner",
            compensation=Compensation.ALWAYS,  # a cancel corrects a share that happened
        )(self._share)
        self.share.compensator(self._withdraw)
        self.post = stopline.tool(
            name="post_to_partner", description="post to the partner's inbox"
        )(self._post)

    async def _share(self, ctx: CallContext, report: str) -> str:
        self.shared[ctx.key] = report
        return ctx.key

    async def _withdraw(self, ctx: CallContext) -> str:
        await self.points.reach("withdrawing", ctx.key)
        self.withdrawn.append(ctx.key.partition("~")[0])
        return "share withdrawn"

    async def _post(self, ctx: CallContext, text: str) -> str:
        self.inbox.append(text)  # delivered ...
        await self.points.reach("posted", ctx.key)
        # ... and the answer is lost; the inbox offers no read-back (no verifier)
        raise stopline.NoAnswer(Cause.TRANSPORT, "the partner's gateway dropped the connection")


async def _corrected(
    ledger: stopline.Ledger, partner: Partner, workflow: Workflow, say: Say
) -> stopline.Receipt:
    """5: the report was already shared when the user pressed stop: the share is withdrawn."""
    say("\n== 5. Stop after the report was shared with the partner (a share can be withdrawn)")
    shared = workflow.hold_here("shared")
    withdrawing = partner.points.hold("withdrawing")
    run_ids: list[str] = []

    async def main() -> None:
        async with ledger.run("report-share-notify", owner="user:42") as run:
            run_ids.append(run.id)
            async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.AT_BOUNDARY):
                report = await run.call(generate_report, "sales")
                await run.call(partner.share, report)
                await workflow.points.reach("shared", run.id)
                await workflow.mcp.call(run, "notify", {"payload": "New report shared"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        await shared.reached()
        await ledger.cancel(run_ids[0], by="user:42", reason="pressed stop")
        await shared.release()
        await withdrawing.reached.wait()
        say("While the correction runs the user is told:")
        say(_indent((await ledger.receipt(run_ids[0])).text()))
        withdrawing.release()
    final = await ledger.wait_settled(run_ids[0], timeout=15)
    say("Once the evidence is in:")
    say(_indent(final.text()))
    return final


async def _reviewed(ledger: stopline.Ledger, partner: Partner, say: Say) -> stopline.Receipt:
    """6: the partner's answer is lost and nothing can read it back: a human decides."""
    say("\n== 6. Stop while posting to the partner, whose answer is then lost")
    posted = partner.points.hold("posted")
    run_ids: list[str] = []

    async def main() -> None:
        async with ledger.run("report-post", owner="user:42") as run:
            run_ids.append(run.id)
            async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.AT_BOUNDARY):
                with contextlib.suppress(stopline.NoAnswer):
                    await run.call(partner.post, "Quarterly report attached")

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        await posted.reached.wait()
        now = await ledger.cancel(run_ids[0], by="user:42", reason="pressed stop")
        say("At the moment of the cancel the user is told:")
        say(_indent(now.text()))
        posted.release()
    final = await ledger.wait_settled(run_ids[0], timeout=15)
    say("Once the evidence is in:")
    say(_indent(final.text()))
    say("    (stopline review list shows it; a reviewer decides it with stopline review resolve)")
    return final


async def _scenario(
    ledger: stopline.Ledger,
    title: str,
    workflow: Workflow,
    hold: Hold | None,
    say: Say,
    canceller: stopline.Ledger,
) -> stopline.Receipt:
    say(f"\n== {title}")
    run_ids: list[str] = []

    async def main() -> None:
        async with ledger.run("report-upload-notify", owner="user:42") as run:
            run_ids.append(run.id)
            with contextlib.suppress(stopline.NoAnswer):  # the receipt says what happened
                await workflow(run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(main)
        if hold is not None:
            await hold.reached()
            now = await canceller.cancel(run_ids[0], by="user:42", reason="pressed stop")
            say("At the moment of the cancel the user is told:")
            say(_indent(now.text()))
            await hold.release()
    if hold is None:  # the run finished before the user pressed stop
        await ledger.cancel(run_ids[0], by="user:42", reason="pressed stop")
    final = await ledger.wait_settled(run_ids[0], timeout=15)
    say("Once the evidence is in:")
    say(_indent(final.text()))
    return final


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


async def run_demo(
    ledger_url: str, say: Say = print, *, server_db: Path | None = None
) -> list[stopline.Receipt]:
    from mcp import StdioServerParameters
    from stopline.integrations.mcp import StoplineMCP

    budget = stopline.VerifyBudget(attempts=5, first_delay=0.05)
    with tempfile.TemporaryDirectory(prefix="stopline-demo-server-") as tmp:
        db = server_db or Path(tmp) / "providers.db"
        args = ["-m", "stopline.integrations.mcp.testing", "--db", str(db)]
        server = StdioServerParameters(command=sys.executable, args=args)
        receipts = []
        async with (
            stopline.open(ledger_url, verify=budget) as ledger,
            stopline.open(ledger_url) as elsewhere,  # the user's stop button, in another process
            StoplineMCP(server, mode="legacy", name="providers") as mcp,
        ):
            say(f"providers: a real MCP server over stdio ({mcp.client.protocol_version})")
            steps: list[tuple[str, Callable[[Workflow], Awaitable[Hold | None]]]] = [
                (
                    "1. Stop before the upload (from another process, like the CLI)",
                    _local("report_ready"),
                ),
                ("2. Stop during the upload", _remote("received:upload")),
                (
                    "3. Stop after the notification was accepted, before its response "
                    "(which is lost: the provider's server crashes after committing)",
                    _remote("accepted:notify", fault="die"),
                ),
                ("4. Stop after everything finished", _nothing),
            ]
            for n, (title, hold) in enumerate(steps):
                workflow = Workflow(mcp)
                canceller = elsewhere if n == 0 else ledger
                held = await hold(workflow)
                receipts.append(await _scenario(ledger, title, workflow, held, say, canceller))
            partner = Partner()
            receipts.append(await _corrected(ledger, partner, Workflow(mcp), say))
            receipts.append(await _reviewed(ledger, partner, say))
    return receipts


def _local(point: str) -> Callable[[Workflow], Awaitable[Hold | None]]:
    async def hold(workflow: Workflow) -> Hold | None:
        return workflow.hold_here(point)

    return hold


def _remote(point: str, fault: str = "") -> Callable[[Workflow], Awaitable[Hold | None]]:
    async def hold(workflow: Workflow) -> Hold | None:
        return await workflow.hold_on_server(point, fault)

    return hold


async def _nothing(workflow: Workflow) -> Hold | None:
    return None


def main(ledger_url: str | None = None) -> int:
    """Run the six stops and print their receipts; exit code 0 when all are truthful.

    With ``ledger_url`` the runs stay in that ledger (for ``stopline runs``, ``show``
    and the console); without, in a temporary one.
    """
    with tempfile.TemporaryDirectory() as tmp:
        url = ledger_url or f"sqlite:///{Path(tmp) / 'demo.db'}"
        print(f"stopline demo: ledger {url}")
        receipts = anyio.run(run_demo, url)
    return 0 if tuple(r.headline for r in receipts) == EXPECTED else 1


if __name__ == "__main__":
    raise SystemExit(main())
