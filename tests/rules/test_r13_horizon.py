"""R13: not found is not "not committed" while the effect can still land.

A provider that goes on after the local call was interrupted (the shape of an
MCP server whose tool cannot stop) commits after the first read-back found
nothing. Before its horizon that read-back proves nothing: the runtime keeps
verifying, the receipt says until when, and nothing is sent twice.
"""

from __future__ import annotations

import time

import anyio
import pytest

import stopline
from stopline import Headline, OpStatus, PhaseKind, Policy, ReadBack, Verdict, VerifyBudget
from stopline.domain.receipt import horizon_words
from tests.scenarios.workflows import Started, start

pytestmark = pytest.mark.timeout(30)


class LateProvider:
    """Commits on its own, after the caller stopped waiting; keeps its own record."""

    def __init__(self, settles_within: float | None) -> None:
        self.effects: dict[str, int] = {}
        self.sent: list[str] = []
        self.received = anyio.Event()
        self.commit_now = anyio.Event()  # the provider lands the effect when this is set
        self.reads: list[float] = []
        self.first_read = anyio.Event()
        self.lost_at = 0.0

        async def pay(ctx: stopline.CallContext, amount: int) -> str:
            self.sent.append(ctx.key)
            self.received.set()
            await anyio.sleep_forever()  # the caller waits; the provider works on elsewhere
            raise AssertionError("unreachable")

        self.tool = stopline.Tool(pay, settles_within=settles_within)

        @self.tool.verifier
        async def _(ctx: stopline.CallContext) -> ReadBack:
            self.reads.append(time.time())
            self.first_read.set()
            if ctx.key in self.effects:
                return ReadBack(Verdict.COMMITTED, ref=ctx.key)
            return ReadBack(Verdict.NOT_COMMITTED)  # found/not-found: nothing there yet

    async def provider_side(self, key: str) -> None:
        await self.commit_now.wait()
        self.effects[key] = self.effects.get(key, 0) + 1


async def cancel_immediate(ledger: stopline.Ledger, provider: LateProvider) -> tuple[str, str]:
    async def body(run: stopline.Run, started: Started) -> None:
        async with run.phase(PhaseKind.CALLING_EXTERNAL, Policy.IMMEDIATE):
            await run.call(provider.tool, 5, key="pay")

    async with anyio.create_task_group() as tg:
        started = start(tg, ledger, body)
        await provider.received.wait()
        provider.lost_at = time.time()  # the answer is lost after this moment
        await ledger.cancel(started.run_id, by="user:1")
    return started.run_id, f"{started.run_id}/pay"


async def test_r13_not_found_before_the_horizon_keeps_verifying(
    ledger: stopline.Ledger,
) -> None:
    provider = LateProvider(settles_within=60.0)
    run_id, op_id = await cancel_immediate(ledger, provider)
    async with anyio.create_task_group() as tg:
        tg.start_soon(provider.provider_side, op_id)
        await provider.first_read.wait()  # the first read-back found nothing ...
        op = await ledger.backend.get_operation(op_id)
        assert op.status is OpStatus.UNKNOWN  # ... which proves nothing yet (R13)
        assert op.horizon is not None and op.horizon > time.time()
        receipt = await ledger.receipt(run_id)
        until = horizon_words(op.horizon)  # with its date should it be tomorrow's
        assert receipt.lines[0].status_words == f"may have happened; verifying until {until}"
        assert receipt.headline is Headline.VERIFYING
        provider.commit_now.set()  # the provider lands it after that read-back
    receipt = await ledger.wait_settled(run_id, timeout=20)
    assert receipt.lines[0].status is OpStatus.COMMITTED
    assert receipt.headline is Headline.STOPPED_WITH_COMPLETED_ACTIONS
    # resuming repeats nothing: the operation is committed, replayed from the ledger
    await ledger.resume(run_id, by="user:1")
    async with ledger.run("job", owner="user:1", run_id=run_id) as run:
        await run.call(provider.tool, 5, key="pay")
    assert provider.sent == [op_id] and provider.effects == {op_id: 1}


async def test_r13_after_the_horizon_not_found_proves_not_committed(ledger_url: str) -> None:
    budget = VerifyBudget(attempts=2, first_delay=0.01, factor=1.0, max_delay=0.01)
    async with stopline.open(ledger_url, verify=budget) as ledger:
        provider = LateProvider(settles_within=0.5)
        run_id, op_id = await cancel_immediate(ledger, provider)
        # the cancel records the interrupted call in the background: wait for that change
        while (op := await ledger.backend.get_operation(op_id)).status is OpStatus.REQUESTED:
            await ledger.wait_for_change(run_id)
        assert op.horizon is not None
        receipt = await ledger.wait_settled(run_id, timeout=20)
    assert receipt.lines[0].status is OpStatus.NOT_COMMITTED
    assert receipt.headline is Headline.CANCELED_BEFORE_EXTERNAL_ACTION
    # the read-back that proved it came after the horizon, never before
    assert provider.reads[-1] >= op.horizon
    assert all(r < op.horizon for r in provider.reads[:-1])


async def test_r13_first_delay_delays_the_first_read(ledger_url: str) -> None:
    budget = VerifyBudget(attempts=1, first_delay=0.3)
    async with stopline.open(ledger_url, verify=budget) as ledger:
        provider = LateProvider(settles_within=None)
        run_id, _ = await cancel_immediate(ledger, provider)
        await ledger.wait_settled(run_id, timeout=20)
    # honoured: the first read-back waited first_delay (up to clock granularity)
    assert provider.reads and provider.reads[0] - provider.lost_at >= 0.29
