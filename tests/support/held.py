"""A call held in its tool until a cancel interrupts it: one run, one call, ``immediate``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio

import stopline
from stopline import PhaseKind, Policy


class Held:
    """A run of ``ledger`` (``run_id``, or a new one) with one call of ``hold_the_line``
    in flight under ``immediate``, and what its tool and its workflow saw of the cancel:
    ``entered`` once the tool waits, ``interrupted`` once its cancel reached it."""

    def __init__(self, ledger: stopline.Ledger, run_id: str | None = None) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.entered = anyio.Event()
        self.interrupted = anyio.Event()
        self.interrupted_ns = 0  # when (``time.time_ns``, OpenTelemetry's clock)
        self.caught: list[BaseException] = []  # what reached the workflow
        self.seen: list[BaseException] = []  # what reached the tool
        self.ids: list[str] = []
        held = self

        @stopline.tool
        async def hold_the_line(ctx: stopline.CallContext) -> None:
            held.entered.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class() as cancel:
                held.seen.append(cancel)
                held.interrupted_ns = time.time_ns()
                held.interrupted.set()
                raise

        self.tool = hold_the_line

    async def workflow(self) -> None:
        async with (
            self.ledger.run("r", owner="u", run_id=self.run_id) as run,
            run.phase(PhaseKind.READING, Policy.IMMEDIATE),
        ):
            self.ids.append(run.id)
            try:
                await run.call(self.tool)
            except BaseException as exc:
                self.caught.append(exc)
                raise

    @contextlib.asynccontextmanager
    async def in_flight(self) -> AsyncIterator[None]:
        """The workflow started and its call entered for the block; the block's end
        waits for the workflow (30 s at most)."""
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.workflow)
                await self.entered.wait()
                yield

    async def cancelled(self) -> stopline.Receipt:
        """The workflow started and its call entered, the run cancelled from outside."""
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.workflow)
                await self.entered.wait()
                receipt = await self.ledger.cancel(self.ids[0], by="u")
        return receipt
