"""Leases across processes: A is stopped (SIGSTOP) with a call in flight, not killed.
Its lease lapses while it is stopped, B takes over, then A comes back (SIGCONT).

From outside, on a real SQLite file and a real PostgreSQL schema:

- what B records of A says what B saw, no more (R8, ADR 0069): a lapsed lease is
  not a death; B says A died only where this host shows A's process gone;
- A's late answer is kept as evidence (agreeing, it settles the call; contradicting
  B's read-back, it goes to review), and A's next intent is refused at the gate
  (``LeaseExpired``, nothing recorded, nothing sent);
- nothing lands twice at the destination.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import stopline
from stopline import OpStatus
from stopline.errors import UnknownOperation
from tests.faults import recovery_outside_harness as harness
from tests.faults.recovery_outside_agent import Plan, effects
from tests.faults.recovery_outside_harness import (
    ONE_LOOK,
    Agent,
    Fifo,
    agent,
    b_tool,
    ledger_urls,
    outside_sql,
    reenter,
    release,
    until_status,
)

__all__ = ["ledger_urls"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)

CRASH, LEASE_LAPSED = "crash", "lease_lapsed"  # the evidence recovery writes (readback.py)
# where a recovered call may be: in doubt, in review for want of an answer, or (on old
# code) read back "not committed"; never still ``requested``
IN_DOUBT = {OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW, OpStatus.NOT_COMMITTED}


def plan_for(url: str, tmp: Path, **options: Any) -> tuple[Plan, Fifo]:
    fifo = Fifo(tmp / "hold")
    return harness.plan_for(url, tmp, "run_z", hold=str(fifo.path), **options), fifo


async def stopped_in_its_call(a: Agent) -> str:
    """A's worker id, once A is stopped inside ``k2``'s body (past the gate)."""
    worker = (await a.until("ready")).split()[1]
    await a.until("sent run_z/k2")
    a.stop()
    return worker


@pytest.mark.parametrize("where", ["stopped_here", "stopped_elsewhere", "killed"])
async def test_recovery_says_a_worker_died_only_where_its_process_is_seen_gone(
    tmp_path: Path, ledger_urls: str, where: str
) -> None:
    plan, _ = plan_for(ledger_urls, tmp_path, lease=1.0)
    async with agent(plan, tmp_path, other_host=where == "stopped_elsewhere") as a:
        worker = await stopped_in_its_call(a)
        if where == "killed":
            await a.kill()
        b = stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK)
        b.lease = 1.0  # B sweeps for dead workers every third of a second
        async with b:
            op = await until_status(b, "run_z/k2", IN_DOUBT)  # once its lease lapsed
    said = {e.ref: e.detail for e in op.evidence if e.ref in (CRASH, LEASE_LAPSED)}
    assert worker in said[CRASH]
    if where == "killed":
        assert said == {CRASH: f"worker {worker} left this call in flight: its process"
                        f" (pid {a.pid}) died"}  # fmt: skip
        return
    assert "died" not in said[CRASH] and said[LEASE_LAPSED].endswith("may still land")
    if where == "stopped_here":
        assert f"process (pid {a.pid}) still exists on this host" in said[LEASE_LAPSED]
    else:
        assert "process on host a-remote-host cannot be seen" in said[LEASE_LAPSED]


@pytest.mark.parametrize("horizon", [3600.0, None], ids=["declared", "none"])
async def test_a_worker_back_after_its_lease_lapsed_is_fenced_and_its_late_answer_kept(
    tmp_path: Path, ledger_urls: str, horizon: float | None
) -> None:
    """A's lease is long (it never renews during the test) and lapses by the ledger's
    clock while A is stopped (a GC pause past it, a clock ahead). B recovers A's call
    and reads the destination back: nothing there, and A's process still exists, so
    that proves nothing, with a horizon or without (R13). A comes back: its tool lands
    the effect and A records its answer, kept as evidence that settles the call (R4).
    A's next call is refused at the gate: never recorded, never sent."""
    plan, fifo = plan_for(ledger_urls, tmp_path, lease=3600.0, settles_within=horizon)
    async with agent(plan, tmp_path) as a:
        worker = await stopped_in_its_call(a)
        outside_sql(ledger_urls, f"UPDATE workers SET lease_until = 1 WHERE id = '{worker}'")
        async with stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK) as b:
            looked = await b.verify("run_z/k2")  # recovered as B opened; the effect not there
            a.cont()
            await release(fifo)
            await a.until("effect run_z/k2")
            refused = await a.until("error k3")
            await a.until("done")
            assert await a.ended() == 0
            final = await until_status(b, "run_z/k2", {OpStatus.COMMITTED})
            with pytest.raises(UnknownOperation):
                await b.backend.get_operation("run_z/k3")  # never recorded: never sent
    assert looked.status in {OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW}  # never "did not"
    assert refused == "error k3 LeaseExpired"
    assert final.status is OpStatus.COMMITTED and final.worker == worker
    assert effects(plan.destination) == ["run_z/k1", "run_z/k2"]


@pytest.mark.parametrize("horizon", [3600.0, None], ids=["declared", "none"])
@pytest.mark.parametrize("other_host", [False, True], ids=["here", "elsewhere"])
async def test_a_stopped_worker_taken_for_dead_gets_no_second_dispatch(
    tmp_path: Path, ledger_urls: str, other_host: bool, horizon: float | None
) -> None:
    """A's lease lapses for real while it is stopped (it cannot renew); B sweeps it dead
    and reads the destination back: nothing yet. That is no proof while A may still
    send (R13): the call stays in doubt (``unknown``, or in review once B's read-backs
    are spent), and B's re-entry of the workflow sends nothing for it. A comes back and
    lands its effect, once; its answer settles the call. (Before, "not found" was
    recorded "did not happen", the re-entry sent it again, and A's effect landed too:
    twice, with A's answer kept as one that agreed.)"""
    plan, fifo = plan_for(ledger_urls, tmp_path, lease=1.0, settles_within=horizon)
    async with agent(plan, tmp_path, other_host=other_host) as a:
        worker = await stopped_in_its_call(a)
        b = stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK)
        b.lease = 1.0  # B sweeps for dead workers every third of a second
        async with b:
            recovered = await until_status(b, "run_z/k2", IN_DOUBT)  # its lease lapsed
            looked = await b.verify("run_z/k2")
            _, doubt = await reenter(b, plan)
            sent_by_b = effects(plan.destination)
            a.cont()
            await release(fifo)
            await a.until("done")
            final = await until_status(b, "run_z/k2", {OpStatus.COMMITTED})
    assert recovered.worker == worker
    assert looked.status in {OpStatus.UNKNOWN, OpStatus.NEEDS_REVIEW}
    assert doubt is not None and doubt.op_id == "run_z/k2"
    assert sent_by_b == ["run_z/k1"]  # nothing sent again while in doubt
    assert final.status is OpStatus.COMMITTED
    assert Counter(effects(plan.destination)) == {"run_z/k1": 1, "run_z/k2": 1}
