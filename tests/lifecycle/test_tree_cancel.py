"""Cancelling a tree: one transaction fences it, one records every interrupted call (R3)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

import stopline
from stopline import OpStatus, PhaseKind, Policy, RunState
from stopline.domain.lifecycle import CancelResult
from stopline.domain.model import OperationRecord, RunRecord
from stopline.domain.vocab import OpEvent
from stopline.errors import IllegalTransition, UnknownRun
from stopline.ledger.backend import Backend, OutcomeUpdate, RunSpec
from stopline.ledger.engine.dialect import LONG_LIST
from stopline.ledger.forwarding import ForwardingBackend
from stopline.ledger.sqlite import SQLiteBackend

CHILDREN = 20


async def cancel_a_tree(
    ledger: stopline.Ledger,
    hold: stopline.Tool[None],
    all_in: anyio.Event,
    *,
    children: int = CHILDREN,
) -> str:
    """A root run with ``children`` children, each calling ``hold`` under ``immediate``;
    once ``all_in`` says every call is in flight, the root is cancelled. Its id."""
    root_id: list[str] = []

    async def child(run: stopline.Run, n: int) -> None:
        async with (
            run.child(f"c{n}") as c,
            c.phase(PhaseKind.READING, Policy.IMMEDIATE),
        ):
            await c.call(hold)

    async def root() -> None:
        async with ledger.run("root", owner="u") as run:
            root_id.append(run.id)
            async with anyio.create_task_group() as tg:
                for n in range(children):
                    tg.start_soon(child, run, n)

    async with anyio.create_task_group() as tg:
        tg.start_soon(root)
        await all_in.wait()
        await ledger.cancel(root_id[0], by="u")
    return root_id[0]


def holding_tool() -> tuple[stopline.Tool[None], anyio.Event]:
    """A tool whose calls stay in flight until cancelled (its provider never saw them,
    its read-back says), and the event set once ``CHILDREN`` calls are in flight. Its
    provider cannot be asked to cancel (it has no canceller)."""
    entered = 0
    all_in = anyio.Event()

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        nonlocal entered
        entered += 1
        if entered == CHILDREN:
            all_in.set()
        await anyio.sleep_forever()

    @hold.verifier
    async def _(ctx: stopline.CallContext) -> stopline.Verdict:
        return stopline.Verdict.NOT_COMMITTED

    return hold, all_in


async def test_a_tree_cancel_records_its_interrupted_calls_in_one_transaction(
    tmp_path: Path,
) -> None:
    """One transaction, and in it one statement per kind of write, whatever the tree's
    size: a per-call statement makes a tree of 10,000 cost 40,000 of them."""
    hold, all_in = holding_tool()

    # per transaction, how many statements made operations unknown
    lost_per_txn: list[int] = []

    def trace(statement: str) -> None:
        text = statement.strip()
        if text.startswith("BEGIN"):
            lost_per_txn.append(0)
        elif text.startswith("UPDATE operations SET status =") and "THEN 'unknown'" in text:
            lost_per_txn[-1] += 1

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", tools=[hold]) as ledger:
        assert isinstance(ledger.backend, SQLiteBackend)
        await ledger.backend.transact(lambda conn: conn.set_trace_callback(trace))
        root_id = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root_id, timeout=30)
        await ledger.backend.transact(lambda conn: conn.set_trace_callback(None))
    assert [n for n in lost_per_txn if n] == [1]  # the whole tree: one transaction, one update
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED] * CHILDREN
    with sqlite3.connect(tmp_path / "l.db") as conn:
        lost = [at for (at,) in conn.execute("SELECT at FROM events WHERE kind = 'lost'")]
        causes = {c for (c,) in conn.execute("SELECT cause FROM operations")}
    assert len(lost) == CHILDREN  # each call recorded once: its own unwinding added nothing
    assert len(set(lost)) == 1  # one bulk record by the cancel, not one per unwinding call
    assert causes == {"user_cancel"}


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_every_call_of_a_tree_sees_its_cancel_before_any_run_unwinds(
    tmp_path: Path,
) -> None:
    """The cancel reaches every in-flight call of the tree before any of them unwinds
    (records, leaves its phase and its run block): the last call is interrupted right
    after the delivery, not after the unwinding of all the others (load-independent:
    counted in the order the loop runs them, not timed)."""
    entered: list[str] = []
    all_in = anyio.Event()
    open_when_interrupted: list[int] = []
    ledger_box: list[stopline.Ledger] = []

    @stopline.tool
    async def hold(ctx: stopline.CallContext) -> None:
        entered.append(ctx.run_id)
        if len(entered) == CHILDREN:
            all_in.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            still_open = [r for r in entered if ledger_box[0].local_run(r) is not None]
            open_when_interrupted.append(len(still_open))
            raise

    @hold.verifier
    async def _(ctx: stopline.CallContext) -> stopline.Verdict:
        return stopline.Verdict.NOT_COMMITTED

    async with stopline.open(f"sqlite:///{tmp_path / 'l.db'}", tools=[hold]) as ledger:
        ledger_box.append(ledger)
        root_id = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root_id, timeout=30)
    assert open_when_interrupted == [CHILDREN] * CHILDREN  # no child's block had ended yet
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED] * CHILDREN


async def _fence_statements(path: Path, children: int) -> list[str]:
    """The statements of the transaction that fences a root with ``children`` children."""
    backend = await SQLiteBackend.open(path, cancel_poll=0)
    try:
        await backend.create_run(RunSpec("root", "root", "u", "t"))
        for n in range(children):
            await backend.create_run(RunSpec(f"c{n}", f"c{n}", "u", "t", parent_id="root"))
        statements: list[str] = []
        await backend.transact(lambda conn: conn.set_trace_callback(statements.append))
        result = await backend.cancel("root", by="u")
        await backend.transact(lambda conn: conn.set_trace_callback(None))
    finally:
        await backend.close()
    assert len(result.fenced) == children + 1
    begin = statements.index("BEGIN IMMEDIATE")  # the fence's transaction, traced whole
    end = statements.index("COMMIT", begin)
    return statements[begin + 1 : end]


async def test_the_fence_of_a_tree_is_set_based_whatever_its_size(tmp_path: Path) -> None:
    """The subtree fence writes its events and fences its runs set-wise: as many
    statements for 40 children as for 2 (each level of the closure is one read)."""
    small = await _fence_statements(tmp_path / "small.db", 2)
    large = await _fence_statements(tmp_path / "large.db", 40)
    assert len(small) == len(large)


@pytest.mark.parametrize("children", [40, 100])  # the ids as parameters, as a JSON array
async def test_the_fence_of_a_tree_finds_its_runs_by_id_not_by_state(
    tmp_path: Path, children: int
) -> None:
    """Each statement reaches the tree's runs through their key: the plan that walked
    ``runs_state`` read every live run of the ledger to fence 41 of them. A tree of
    more than ``LONG_LIST`` runs passes their ids as one JSON array (ADR 0044)."""
    path = tmp_path / "l.db"
    statements = await _fence_statements(path, children)
    assert any("json_each" in sql for sql in statements) is (children > LONG_LIST)
    with sqlite3.connect(path) as conn:
        plans = {
            sql: [step[-1] for step in conn.execute(f"EXPLAIN QUERY PLAN {sql}")]
            for sql in statements
            if " runs" in sql and not sql.startswith("SELECT id, name")  # the root's own
        }
    assert plans
    assert not [sql for sql, plan in plans.items() if any("runs_state" in s for s in plan)]
    assert all(
        any("sqlite_autoindex_runs_1" in step for step in plan)
        for sql, plan in plans.items()
        if "state IN" in sql
    ), plans
    # the approvals through their runs' ids, a run's state read only for a live one
    withdraws = [plan for sql, plan in plans.items() if sql.startswith("UPDATE approvals")]
    assert len(withdraws) == 3  # a lone run's (the first try), the root's, the rest's
    for plan in withdraws:
        assert plan[0] == "SEARCH approvals USING INDEX approvals_run (run_id=?)", plan
        assert any(step.startswith("CORRELATED SCALAR SUBQUERY") for step in plan), plan


class ReadOrder(ForwardingBackend):
    """The backend's cancels and the reads a receipt is made of, in the order asked."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.asked: list[str] = []

    async def cancel(self, run_id: str, *, by: str, reason: str = "") -> CancelResult:
        self.asked.append("cancel")
        return await self.inner.cancel(run_id, by=by, reason=reason)

    async def get_run(self, run_id: str) -> RunRecord:
        self.asked.append("get_run")
        return await self.inner.get_run(run_id)

    async def operations(self, run_id: str, *, descendants: bool = False) -> list[OperationRecord]:
        self.asked.append("operations" + (" of the tree" if descendants else ""))
        return await self.inner.operations(run_id, descendants=descendants)

    async def run_and_operations(
        self, run_id: str, *, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        self.asked.append("run_and_operations" + (" of the tree" if descendants else ""))
        return await self.inner.run_and_operations(run_id, descendants=descendants)


async def test_a_tree_cancel_reads_its_receipt_in_one_read_asked_right_after_the_fence(
    tmp_path: Path,
) -> None:
    """``cancel()``'s receipt is one read (one snapshot), asked for before anything the
    interrupted calls queue while they unwind: a second read would wait on the one
    writer behind the whole tree's settling (for 1,000 children, ~600 ms against
    ~50 ms for the fence and every interruption; counted here, not timed)."""
    hold, all_in = holding_tool()

    observed: list[ReadOrder] = []

    def observe(backend: Backend) -> Backend:
        observed.append(ReadOrder(backend))
        return observed[-1]

    url = f"sqlite:///{tmp_path / 'l.db'}"
    async with stopline.open(url, tools=[hold], observers=[observe]) as ledger:
        root_id = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root_id, timeout=30)
    (order,) = observed
    after_fence = order.asked[order.asked.index("cancel") + 1 :]
    assert after_fence[0] == "run_and_operations of the tree"
    assert "operations of the tree" not in after_fence  # never a second read
    assert len(receipt.lines) == CHILDREN


class StepReads(ForwardingBackend):
    """When the settler's steps read runs, against the record of the interrupted calls
    (``record_many`` of ``lost`` outcomes; a verdict's record is not one)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.recording = False  # the record of interrupted calls is under way
        self.recorded = 0  # calls it has recorded
        self.reads: list[tuple[str, int]] = []  # (run id, calls recorded when asked)
        self.early: list[str] = []  # runs read while their calls' record was under way

    async def record_many(
        self, items: Sequence[tuple[str, OutcomeUpdate]]
    ) -> list[OperationRecord | IllegalTransition]:
        interrupted = all(update.event is OpEvent.LOST for _, update in items)
        self.recording = interrupted  # not a verdict's record
        try:
            return await self.inner.record_many(items)
        finally:
            self.recording = False
            self.recorded += len(items) if interrupted else 0

    async def runs_and_operations(
        self, run_ids: Sequence[str], *, settling: bool = False
    ) -> list[tuple[RunRecord, list[OperationRecord]] | UnknownRun]:
        self.reads.extend((run_id, self.recorded) for run_id in run_ids)
        if self.recording:
            self.early.extend(run_ids)
        return await self.inner.runs_and_operations(run_ids, settling=settling)


async def test_no_step_reads_an_interrupted_run_before_its_calls_are_recorded(
    tmp_path: Path,
) -> None:
    """A cancel holds the runs whose calls it interrupted until it has recorded them:
    their blocks end meanwhile and ask for a step, which would read calls still in
    flight and move nothing (one wasted read of every run of a cancelled tree). The
    record asks for the step itself. Counted, not timed."""
    hold, all_in = holding_tool()
    observed: list[StepReads] = []

    def observe(backend: Backend) -> Backend:
        observed.append(StepReads(backend))
        return observed[-1]

    url = f"sqlite:///{tmp_path / 'l.db'}"
    async with stopline.open(url, tools=[hold], observers=[observe]) as ledger:
        root_id = await cancel_a_tree(ledger, hold, all_in)
        receipt = await ledger.wait_settled(root_id, timeout=30)
        children = {r.id for r in await ledger.backend.list_runs(limit=100) if r.id != root_id}
    (steps,) = observed
    assert len(children) == CHILDREN
    child_reads = [(run_id, recorded) for run_id, recorded in steps.reads if run_id in children]
    assert child_reads  # the steps that settled them did read them
    assert not [run_id for run_id in steps.early if run_id in children]
    # every read of a child came once the cancel had recorded the tree's calls
    assert all(recorded >= CHILDREN for _, recorded in child_reads), child_reads
    assert receipt.run_state is RunState.CANCELLED
    assert [line.status for line in receipt.lines] == [OpStatus.NOT_COMMITTED] * CHILDREN
