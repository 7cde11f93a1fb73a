"""A ledger with one run of each kind an operator meets, built with real providers.

Used by the surface tests and by ``scripts/screenshots.py``. Every cancel
lands at a barrier, never after a sleep.
"""

from __future__ import annotations

import dataclasses

import anyio

import stopline
from stopline import Cancellable, PhaseKind, Policy
from stopline.ledger.backend import RunSpec
from stopline.testing import FakeProvider

__all__ = ["Seeded", "seed"]

FAST = stopline.VerifyBudget(attempts=2, first_delay=0.01, factor=1.0, max_delay=0.01)


@dataclasses.dataclass(slots=True)
class Seeded:
    completed: str = ""
    prevented: str = ""  # S1: cancelled before the tool call
    verified: str = ""  # S3: unknown, then read back as committed
    review: str = ""  # unknown, no verifier: needs review
    running: str = ""  # left running (as by a worker that is still going)


async def _calls(
    ledger: stopline.Ledger,
    name: str,
    providers: list[FakeProvider],
    *,
    hold: tuple[FakeProvider, str] | None = None,
    policy: Policy | None = None,
) -> str:
    """Run a workflow calling each provider; cancel it at ``hold`` when given."""
    held = hold[0].hold(hold[1]) if hold else None
    run_id = anyio.Event()
    ids: list[str] = []

    async def body() -> None:
        async with ledger.run(name, owner="user:ada") as run:
            ids.append(run.id)
            run_id.set()
            async with run.phase(PhaseKind.CALLING_EXTERNAL, policy):
                for provider in providers:
                    await run.call(provider.tool, f"{provider.name} payload")

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
        await run_id.wait()
        if held is not None:
            await held.reached.wait()
            await ledger.cancel(ids[0], by="user:ada", reason="changed my mind")
            held.release()
    await ledger.wait_settled(ids[0], timeout=10)
    return ids[0]


async def seed(url: str) -> Seeded:
    out = Seeded()
    async with stopline.open(url, verify=FAST) as ledger:
        report = FakeProvider("build_report", description="build the quarterly report")
        upload = FakeProvider("upload", description="upload report.pdf to the share")
        out.completed = await _calls(ledger, "report", [report, upload])

        send = FakeProvider("send_email", description="email the report to finance")
        async with ledger.run("notify", owner="user:bob") as run:
            out.prevented = run.id
            await ledger.cancel(run.id, by="user:bob", reason="wrong recipient")
            try:
                await run.call(send.tool, "to finance")
            finally:
                pass
        await ledger.wait_settled(out.prevented, timeout=10)

        notify = FakeProvider(
            "post_message", cancellable=Cancellable.NEVER, description="post to #releases"
        )
        out.verified = await _calls(
            ledger, "announce", [notify], hold=(notify, "committed"), policy=Policy.IMMEDIATE
        )

        pay = FakeProvider(
            "charge_card",
            cancellable=Cancellable.NEVER,
            verifiable=False,
            description="charge card 4242 for 120 EUR",
        )
        out.review = await _calls(
            ledger, "checkout", [pay], hold=(pay, "committed"), policy=Policy.IMMEDIATE
        )

        record = await ledger.backend.create_run(
            RunSpec(id="run_live_deploy", name="deploy", owner="user:cyd", tenant="default")
        )
        out.running = record.id
    return out
