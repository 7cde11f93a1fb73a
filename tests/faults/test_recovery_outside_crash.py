"""Recovery across processes, seen from outside: A is SIGKILLed with a call in flight,
B opens the same ledger (a real SQLite file, a real PostgreSQL schema) and recovers.

A's tool writes a real destination (a SQLite table, one row per effect), so every
effect is counted. From outside, after each kill:

- B claims no more than it can show: a call A was killed in is ``unknown`` until a
  read-back of the destination decides; "not found" while the effect may still land
  (before a horizon the tool declared, or the call stated) is "not yet";
- following what B's ledger says (re-entering the workflow under the same keys)
  repeats nothing: every effect lands once;
- an effect that lands after A died (a provider that finishes on its own) is kept
  as evidence, and one that contradicts a read-back goes to review.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

import stopline
from stopline import EvidenceKind, OpStatus, Verdict
from stopline.errors import NotCorrectable, OperationInDoubt
from tests.faults import recovery_outside_harness as harness
from tests.faults.recovery_outside_agent import Plan, corrections, effects
from tests.faults.recovery_outside_harness import (
    GUARD,
    ONE_LOOK,
    Fifo,
    agent,
    b_tool,
    ledger_urls,
    reenter,
    release,
)

__all__ = ["ledger_urls"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)


def plan_for(url: str, tmp: Path, **options: Any) -> Plan:
    return harness.plan_for(url, tmp, "run_x", **options)


async def killed_at(plan: Plan, tmp: Path, marker: str) -> None:
    async with agent(plan, tmp) as a:
        await a.until(marker)
        await a.kill()


async def statuses(ledger: stopline.Ledger, run_id: str) -> dict[str, OpStatus]:
    return {op.id: op.status for op in await ledger.backend.operations(run_id)}


async def until_effect(destination: str, key: str) -> None:
    """Until the destination holds ``key`` (the detached provider's own write)."""
    with anyio.fail_after(GUARD):
        while key not in effects(destination):  # noqa: ASYNC110 (another process writes)
            await anyio.sleep(0.02)


async def test_a_call_killed_before_its_effect_is_proven_not_to_have_happened_and_sent_once(
    tmp_path: Path, ledger_urls: str
) -> None:
    plan = plan_for(ledger_urls, tmp_path, hold=str(Fifo(tmp_path / "hold").path))
    await killed_at(plan, tmp_path, "sent run_x/k2")  # past the gate, before the effect
    async with stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK) as b:
        await b.reconcile(budget=ONE_LOOK)
        k2 = await b.backend.get_operation("run_x/k2")
        assert await statuses(b, "run_x") == {
            "run_x/k1": OpStatus.COMMITTED,
            "run_x/k2": OpStatus.NOT_COMMITTED,
        }
        # what it rests on: the intent, the worker's death, the destination read back
        assert [e.ref for e in k2.evidence][:2] == ["gate", "crash"]
        assert EvidenceKind.READ_BACK in {e.kind for e in k2.evidence}
        answers, doubt = await reenter(b, plan)
        assert doubt is None and [a["key"] for a in answers] == ["run_x/k1", "run_x/k2", "run_x/k3"]
        assert set((await statuses(b, "run_x")).values()) == {OpStatus.COMMITTED}
    assert effects(plan.destination) == ["run_x/k1", "run_x/k2", "run_x/k3"]  # each once


async def test_a_call_killed_after_its_effect_is_proven_committed_never_sent_corrected_once(
    tmp_path: Path, ledger_urls: str
) -> None:
    plan = plan_for(ledger_urls, tmp_path, stop_after_effect=True)
    await killed_at(plan, tmp_path, "effect run_x/k2")  # the effect landed, its answer lost
    async with stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK) as b:
        await b.reconcile(budget=ONE_LOOK)
        k2 = await b.backend.get_operation("run_x/k2")
        assert k2.status is OpStatus.COMMITTED
        assert EvidenceKind.READ_BACK in {e.kind for e in k2.evidence}
        answers, doubt = await reenter(b, plan)
        assert doubt is None and len(answers) == 3
        # its line offers a correction: made once, however often it is asked for
        corrected = await b.compensate("run_x/k2", by="user:1")
        with pytest.raises(NotCorrectable):
            await b.compensate("run_x/k2", by="user:1")
    assert corrected.status is OpStatus.COMPENSATED
    assert corrections(plan.destination) == ["run_x/k2"]
    assert Counter(effects(plan.destination)) == dict.fromkeys(
        ["run_x/k1", "run_x/k2", "run_x/k3"], 1
    )


async def test_the_cli_recovers_a_killed_worker_and_says_unknown_where_it_cannot_read_back(
    tmp_path: Path, ledger_urls: str
) -> None:
    """``stopline reconcile`` in a third process, without the tool: A's call is recovered
    and left ``unknown`` (nothing here can read it back), never "did not happen"."""
    plan = plan_for(ledger_urls, tmp_path, hold=str(Fifo(tmp_path / "hold").path))
    await killed_at(plan, tmp_path, "sent run_x/k2")
    env = {**os.environ, "STOPLINE_LEDGER": ledger_urls, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "stopline.cli"]
    with anyio.fail_after(GUARD):
        done = await anyio.run_process([*cli, "reconcile", "--json"], env=env, check=False)
        shown = await anyio.run_process([*cli, "show", "run_x", "--json"], env=env, check=False)
    summary = json.loads(done.stdout)
    assert done.returncode == 3, done.stderr  # still in doubt: not verifiable there
    assert summary["not_here"] == ["run_x/k2"]  # recovered as the CLI opened the ledger
    lines = {op["id"]: op["status"] for op in json.loads(shown.stdout)["operations"]}
    assert lines == {"run_x/k1": "committed", "run_x/k2": "unknown"}
    async with stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK) as b:
        await b.reconcile(budget=ONE_LOOK)  # the process that has the tool reads it back
        k2 = await b.backend.get_operation("run_x/k2")
    assert k2.status is OpStatus.NOT_COMMITTED
    assert effects(plan.destination) == ["run_x/k1"]


@pytest.mark.parametrize("horizon", ["declared", "stated"])
async def test_an_effect_that_may_still_land_after_the_kill_is_not_yet_then_proven(
    tmp_path: Path, ledger_urls: str, horizon: str
) -> None:
    """The provider finishes the request on its own, after A died (a detached writer).
    The tool declares a horizon (``settles_within``), or the call stated one before A
    died (``ctx.settles_by``, which recovery hands on): until the effect lands, B's
    read-back finds nothing and says "not yet" (``unknown``, which no re-entry sends
    again); once the effect lands a read-back proves it, and a re-entry replays it."""
    fifo = Fifo(tmp_path / "hold")
    bound = {"settles_within": 3600.0} if horizon == "declared" else {"state_horizon": 3600.0}
    plan = plan_for(ledger_urls, tmp_path, hold=str(fifo.path), late=True, **bound)
    await killed_at(plan, tmp_path, "handed run_x/k2")
    b_plan = plan if horizon == "declared" else dataclasses.replace(plan, state_horizon=None)
    async with stopline.open(ledger_urls, tools=[b_tool(b_plan)], verify=ONE_LOOK) as b:
        looked = await b.verify("run_x/k2")  # the destination has nothing yet
        assert looked.status is OpStatus.UNKNOWN
        # a stated horizon is A's evidence, handed on by recovery; a declared one, B's tool's
        assert (looked.horizon is not None) == (horizon == "stated")
        assert EvidenceKind.READ_BACK not in {e.kind for e in looked.evidence}
        assert effects(plan.destination) == ["run_x/k1"]
        await release(fifo)  # the provider's late effect lands
        await until_effect(plan.destination, "run_x/k2")
        proven = await b.verify("run_x/k2")
        assert proven.status is OpStatus.COMMITTED
        answers, doubt = await reenter(b, b_plan)  # the tool B declared (one per name)
        assert doubt is None and len(answers) == 3
    assert Counter(effects(plan.destination)) == dict.fromkeys(
        ["run_x/k1", "run_x/k2", "run_x/k3"], 1
    )


async def test_a_late_effect_that_contradicts_the_read_back_goes_to_review_with_both(
    tmp_path: Path, ledger_urls: str
) -> None:
    """A tool that declared no horizon and whose provider finished after A died: the
    read-back proved "not committed" (A's call ended with A), then the provider's own
    late answer says committed. Both are kept; the contradiction goes to review, and a
    re-entry sends nothing while it is there."""
    fifo = Fifo(tmp_path / "hold")
    plan = plan_for(ledger_urls, tmp_path, hold=str(fifo.path), late=True)
    await killed_at(plan, tmp_path, "handed run_x/k2")
    async with stopline.open(ledger_urls, tools=[b_tool(plan)], verify=ONE_LOOK) as b:
        assert (await b.verify("run_x/k2")).status is OpStatus.NOT_COMMITTED
        await release(fifo)
        await until_effect(plan.destination, "run_x/k2")
        late = await b.late_response("run_x/k2", Verdict.COMMITTED, ref="effects:run_x/k2")
        assert late.status is OpStatus.NEEDS_REVIEW
        refs = {e.ref for e in late.evidence}
        events = [e for e in await b.backend.events("run_x") if e.op_id == "run_x/k2"]
        read_back = [e for e in events if e.to_state == OpStatus.NOT_COMMITTED.value]
        assert "effects:run_x/k2" in refs and read_back  # the late answer and the read-back
        answers, doubt = await reenter(b, plan)
        assert isinstance(doubt, OperationInDoubt) and len(answers) == 1
    assert effects(plan.destination) == ["run_x/k1", "run_x/k2"]
