"""An outcome the ledger refuses for ever (ADR 0069): recorded once, and the outbox moves on.

The ledger's own database refuses one move of one operation for ever: a trigger,
set from outside by another client, as an operator's constraint or a migration's
would. The provider answered; the answer cannot be written as it is. Before, the
outbox retried it for as long as the process lived (every few seconds, the worker
degraded for good), the operation stayed ``requested`` ("recording") under a run
that had completed, and every later outcome of that operation waited behind it,
never written. Now: a final answer the ledger refuses becomes ``unknown`` with the
answer's evidence and the refusal, and a read-back proves what happened; a refused
acceptance is kept as evidence and the answer behind it is recorded. Nothing is
sent again (R5), the refusal is reported once, and nothing else waits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import stopline
from stopline import EvidenceKind, OpStatus
from stopline.domain.vocab import OpEvent
from tests.conftest import FAST_VERIFY
from tests.faults.recovery_outside_agent import Plan, effects, make_tool
from tests.faults.recovery_outside_harness import ledger_urls, refuse_moves, until_status

__all__ = ["ledger_urls"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)

SETTLED = {OpStatus.COMMITTED, OpStatus.NOT_COMMITTED, OpStatus.NEEDS_REVIEW}


@pytest.mark.parametrize("durable", [False, True], ids=["deferred", "durable"])
async def test_an_answer_the_ledger_refuses_for_ever_becomes_unknown_and_is_read_back(
    tmp_path: Path, ledger_urls: str, durable: bool
) -> None:
    destination = str(tmp_path / "destination.db")
    tool = make_tool(Plan(ledger_urls, destination, "run_r", ("k", "other")))
    async with stopline.open(
        ledger_urls, tools=[tool], verify=FAST_VERIFY, durable_outcomes=durable
    ) as ledger:
        refuse_moves(ledger_urls, "run_r/k", "requested", "committed")
        async with ledger.run("agent", owner="user:1", run_id="run_r") as run:
            answer = await run.call(tool, 5, key="k")  # the workflow gets its answer
            await run.call(tool, 6, key="other")  # nothing else waits on the refusal
        op = await until_status(ledger, "run_r/k", SETTLED, guard=30)
        other = await ledger.backend.get_operation("run_r/other")
        events = [e for e in await ledger.backend.events("run_r") if e.op_id == op.id]
        drain = ledger.health.steps["drain"]
        degraded = ledger.health.degraded
        held = dict(ledger.core.outbox.held)
    assert answer == {"charged": 5, "key": "run_r/k"}
    # what the ledger holds is what was proven: the read-back of the destination
    assert op.status is OpStatus.COMMITTED and other.status is OpStatus.COMMITTED
    assert EvidenceKind.READ_BACK in {e.kind for e in op.evidence}
    # the refused answer is kept with the move it could make: requested -> unknown
    (lost,) = [e for e in events if e.kind == OpEvent.LOST]
    kept = {item["ref"] for item in lost.data["evidence"]}
    assert "outcome_refused" in kept
    assert {item["kind"] for item in lost.data["evidence"]} >= {EvidenceKind.RESPONSE_DIGEST}
    assert effects(destination) == ["run_r/k", "run_r/other"]  # nothing sent again (R5)
    assert drain.failures - drain.retries == 1  # reported once, as not retried
    # the engine says "refused" (ADR 0079): taken so at once, not after six tries
    assert drain.retries == 0 and drain.last_error.startswith("LedgerRefused")
    assert not degraded and held == {}


async def test_a_refused_acceptance_is_kept_as_evidence_and_the_answer_behind_it_recorded(
    tmp_path: Path, ledger_urls: str
) -> None:
    destination = str(tmp_path / "destination.db")
    tool = make_tool(Plan(ledger_urls, destination, "run_a", ("k",), accept=True))
    async with stopline.open(
        ledger_urls, tools=[tool], verify=FAST_VERIFY, durable_outcomes=True
    ) as ledger:
        refuse_moves(ledger_urls, "run_a/k", "requested", "accepted")
        async with ledger.run("agent", owner="user:1", run_id="run_a") as run:
            await run.call(tool, 1, key="k")
        op = await until_status(ledger, "run_a/k", SETTLED, guard=30)
        events = [e for e in await ledger.backend.events("run_a") if e.op_id == op.id]
        held = dict(ledger.core.outbox.held)
    assert op.status is OpStatus.COMMITTED  # the answer queued behind the refusal landed
    assert EvidenceKind.RESPONSE_DIGEST in {e.kind for e in op.evidence}
    (noted,) = [e for e in events if e.kind == f"evidence_{OpEvent.ACCEPTED.value}"]
    assert {item["ref"] for item in noted.data["evidence"]} >= {"outcome_refused", "psp:run_a/k"}
    assert effects(destination) == ["run_a/k"]
    assert held == {}
