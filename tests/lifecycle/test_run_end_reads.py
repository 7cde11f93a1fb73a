"""A run that ends by itself is not read again to be settled.

The settler moves cancelled runs on; it reads a run and all its operations to
decide. A run that completed or failed here is in a state nothing leaves, so
there is nothing to decide: reading it then cost a writer job (a round trip on
PostgreSQL) and the parse of every operation the run had, at every run's end.
It was asked twice: by the run's end, and by its last call's outcome, which
commits with the end and finds the run's block gone. Counted here, not timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

import stopline
from stopline import RunState
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.transitions import FINAL_RUN_STATES
from stopline.errors import UnknownRun
from stopline.ledger.backend import Backend
from stopline.ledger.forwarding import ForwardingBackend

RUNS = 20


class SettleReads(ForwardingBackend):
    """The run states the settler's reads found."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.found: list[RunState] = []

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        got = await self.inner.runs_and_operations(run_ids, settling=settling)
        self.found.extend(item[0].state for item in got if not isinstance(item, UnknownRun))
        return got


@stopline.tool
async def noop(n: int) -> int:
    return n


class WorkflowError(Exception):
    pass


async def failing(ledger: stopline.Ledger, ids: list[str], n: int) -> None:
    async with ledger.run("fails", owner="alice") as run:
        ids.append(run.id)
        await run.call(noop, n)
        raise WorkflowError("the workflow failed")


def test_the_final_states_are_those_nothing_leaves() -> None:
    assert {RunState.COMPLETED, RunState.FAILED} == FINAL_RUN_STATES


async def test_a_run_that_ended_by_itself_is_not_read_to_be_settled(tmp_path: Path) -> None:
    seen: list[SettleReads] = []

    def observe(backend: Backend) -> Backend:
        seen.append(SettleReads(backend))
        return seen[-1]

    ids = []
    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", observers=[observe]) as ledger:
        for i in range(RUNS):
            async with ledger.run("completes", owner="alice") as run:
                ids.append(run.id)
                await run.call(noop, i)
            with pytest.raises(WorkflowError, match="the workflow failed"):
                await failing(ledger, ids, i)
        await ledger.wait_idle()
        states = [(await ledger.backend.get_run(run_id)).state for run_id in ids]
    (reads,) = seen
    assert states == [RunState.COMPLETED, RunState.FAILED] * RUNS
    # before: every run's end read it again, found it final, and left it (2 x RUNS reads)
    assert [s for s in reads.found if s in FINAL_RUN_STATES] == []


async def test_a_run_cancelled_elsewhere_still_settles_when_its_block_ends(
    tmp_path: Path,
) -> None:
    """Another process cancels the run, unheard here (not watched): its block's end is
    refused, as the cancel came first, and the settler still moves it on."""
    path = tmp_path / "l.db"
    async with stopline.open(f"sqlite:///{path}?cancel_poll_ms=0") as ledger:
        async with ledger.run("cancelled elsewhere", owner="alice") as run:
            await run.call(noop, 1)
            async with stopline.open(f"sqlite:///{path}") as other:
                await other.cancel(run.id, by="alice")
            assert not run.cancel_requested  # nothing reached this process
        receipt = await ledger.wait_settled(run.id, timeout=30)
    assert receipt.run_state is RunState.CANCELLED
