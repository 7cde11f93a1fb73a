"""A cancelled tree settles in batched steps: its runs read and moved together.

After a cancel, every child run is read, moved (``settling``, then
``cancelled`` or ``needs_review``) and its ``unknown`` call verified. Each of
those was one job on the ledger's writer per run; the jobs, not the rows,
were the cost (ADR 0037). Now the runs asked for while a step is under way
are stepped together in the next, and the verifications that wake together
read and record together. Counted here, not timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import OpStatus, RunState
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.vocab import RunEvent
from stopline.errors import IllegalTransition, UnknownOperation, UnknownRun
from stopline.ledger.backend import Backend, OutcomeUpdate
from stopline.ledger.forwarding import ForwardingBackend
from stopline.runtime.batches import Batches
from tests.lifecycle.test_tree_cancel import CHILDREN, cancel_a_tree, holding_tool


class Counting(ForwardingBackend):
    """The calls a ledger makes of its backend, and how many runs or operations each
    of the many-at-once calls took."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.items: Counter[str] = Counter()
        self.moved: list[str] = []  # runs moved one at a time

    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        self.calls["run_and_operations" + (" of the tree" if descendants else "")] += 1
        return await self.inner.run_and_operations(run_id, descendants=descendants)

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        self.calls["runs_and_operations"] += 1
        self.items["runs_and_operations"] += len(run_ids)
        return await self.inner.runs_and_operations(run_ids, settling=settling)

    async def run_event(
        self, run_id: str, event: RunEvent, *, by: str, reason: str = ""
    ) -> tuple[RunRecord, bool]:
        self.moved.append(run_id)
        return await self.inner.run_event(run_id, event, by=by, reason=reason)

    async def run_events(
        self, items: Sequence[tuple[str, RunEvent]], *, by: str
    ) -> list[tuple[RunRecord, bool] | IllegalTransition | UnknownRun]:
        self.calls["run_events"] += 1
        self.items["run_events"] += len(items)
        return await self.inner.run_events(items, by=by)

    async def get_operation(self, op_id: str) -> OperationRecord:
        self.calls["get_operation"] += 1
        return await self.inner.get_operation(op_id)

    async def get_operations(
        self, op_ids: Sequence[str]
    ) -> list[OperationRecord | UnknownOperation]:
        self.calls["get_operations"] += 1
        self.items["get_operations"] += len(op_ids)
        return await self.inner.get_operations(op_ids)

    async def record(self, op_id: str, update: OutcomeUpdate) -> OperationRecord:
        self.calls["record"] += 1
        return await self.inner.record(op_id, update)


# calls that are batched, against per-run calls (2 x CHILDREN): a quiet run makes 4
# reads; under load the verifications wake over several turns of the loop and read,
# record and step in a few batches more (seen: 6)
BATCHED = CHILDREN // 2


async def test_a_cancelled_trees_runs_settle_in_batched_steps(tmp_path: Path) -> None:
    hold, all_in = holding_tool()  # its read-back proves each call not committed
    counted: list[Counting] = []

    def observe(backend: Backend) -> Backend:
        counted.append(Counting(backend))
        return counted[-1]

    url = f"sqlite:///{tmp_path / 'l.db'}"
    async with stopline.open(url, tools=[hold], observers=[observe]) as ledger:
        root = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root, timeout=30)
        children = [r for r in await ledger.backend.list_runs(limit=100) if r.id != root]
    (seen,) = counted
    assert receipt.run_state is RunState.CANCELLED
    assert {line.status for line in receipt.lines} == {OpStatus.NOT_COMMITTED}
    assert len(children) == CHILDREN
    assert {r.state for r in children} == {RunState.CANCELLED}
    # every child moved twice (settling, then cancelled), and none alone
    assert seen.moved == []
    assert seen.items["run_events"] >= 2 * CHILDREN
    assert seen.calls["run_events"] <= BATCHED
    # each step read its runs together: not a read per run
    assert seen.calls["run_and_operations"] == 0
    assert seen.calls["runs_and_operations"] <= BATCHED
    assert seen.items["runs_and_operations"] >= 2 * CHILDREN
    # the verifications woke together: they read together, and their verdicts were
    # recorded with the others (no single ``record`` of an outcome)
    assert seen.calls["get_operation"] == 0
    assert seen.items["get_operations"] >= CHILDREN
    assert seen.calls["get_operations"] <= BATCHED
    assert seen.calls["record"] == 0


async def test_requests_made_while_a_batch_is_served_are_served_together_next(
    tmp_path: Path,
) -> None:
    served: list[list[int]] = []
    first_in = anyio.Event()
    release = anyio.Event()

    async def serve(items: list[int]) -> list[int | Exception]:
        served.append(list(items))
        if len(served) == 1:
            first_in.set()
            await release.wait()
        return [i * 10 if i >= 0 else ValueError(f"bad {i}") for i in items]

    results: dict[int, object] = {}

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        batches: Batches[int, int] = Batches(ledger.core, serve)

        async def ask(i: int) -> None:
            try:
                results[i] = await batches.one(i)
            except ValueError as exc:
                results[i] = str(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, 1)
            await first_in.wait()
            for i in (2, -3, 4):
                tg.start_soon(ask, i)
            await anyio.wait_all_tasks_blocked()  # each of them asked, and waits
            release.set()
    assert served == [[1], [2, -3, 4]]
    assert results == {1: 10, 2: 20, -3: "bad -3", 4: 40}


async def test_an_error_of_the_whole_batch_is_each_requests_own(tmp_path: Path) -> None:
    async def serve(items: list[int]) -> list[int | Exception]:
        raise stopline.errors.LedgerFull("l.db", "the disk is full")

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        batches: Batches[int, int] = Batches(ledger.core, serve)
        found = await batches.many([1, 2])
        with pytest.raises(stopline.errors.LedgerFull):
            await batches.one(3)
    assert [type(e).__name__ for e in found] == ["LedgerFull", "LedgerFull"]


async def test_while_the_ledger_closes_a_request_is_served_by_its_caller(
    tmp_path: Path,
) -> None:
    """Its batch's task was cancelled with the ledger: the caller, which outlives
    the ledger, is not left waiting; it serves its own request."""
    served: list[list[int]] = []

    async def serve(items: list[int]) -> list[int | Exception]:
        served.append(list(items))
        if len(served) == 1:
            await anyio.sleep_forever()  # cancelled as the ledger closes
        return [i * 10 for i in items]

    results: list[int] = []
    async with (
        anyio.create_task_group() as outer,  # outlives the ledger
        stopline.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger,
    ):
        batches: Batches[int, int] = Batches(ledger.core, serve)

        async def ask() -> None:
            results.append(await batches.one(7))

        outer.start_soon(ask)
        await anyio.wait_all_tasks_blocked()
        assert served == [[7]]
    assert served == [[7], [7]]
    assert results == [70]
    assert await batches.one(8) == 80  # closed: served at once, by the caller
    assert served[-1] == [8]
