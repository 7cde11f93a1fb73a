"""ADR 0034: PostgreSQL's group commit. Concurrent calls share a transaction; an outcome
rides the next one; a read sees it; a connection lost under a group transaction costs
each caller its own answer, never a lost or doubled record.

Transactions are told apart by the rows' ``xmin`` (the id of the transaction that
wrote them), which does not depend on load.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import psycopg
import pytest

import stopline
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import OpStatus, RunEvent, RunState
from stopline.errors import StoplineError
from stopline.ledger import postgres_batch, postgres_txn
from stopline.ledger.backend import GateVerdict
from stopline.ledger.postgres import PostgresBackend
from stopline.ledger.postgres_batch import Job, _stretches
from stopline.ledger.postgres_dialect import Forms
from stopline.ledger.postgres_txn import Tx
from stopline.testing import FakeProvider
from tests.ledger.contract import COMMIT, op_spec, run_spec
from tests.postgres.server import Outage, terminate
from tests.postgres.test_backend import round_trips, sql

pytestmark = pytest.mark.timeout(60)
NEVER = "&group_commit_ms=60000"  # the longest allowed: only a write ends it in a test


@pytest.fixture
async def backend(pg_url: str) -> AsyncIterator[PostgresBackend]:
    opened = await PostgresBackend.open(pg_url + NEVER + "&retry_for=0.5")
    try:
        yield opened
    finally:
        await opened.close()


def _collect(into: list[Any]) -> Callable[[Callable[[], OperationRecord]], None]:
    def then(outcome: Callable[[], OperationRecord]) -> None:
        try:
            into.append(outcome())
        except StoplineError as exc:
            into.append(exc)

    return then


async def test_each_outcome_rides_the_next_calls_intent(pg_url: str) -> None:
    """A sequential workflow: the outcome of call i commits in the transaction of the
    intent of call i+1 (one commit per call), and the records keep their order."""
    provider = FakeProvider("send")
    async with (
        stopline.open(pg_url + NEVER) as ledger,
        ledger.run("r", owner="u", run_id="r1") as run,
    ):
        for i in range(5):
            await run.call(provider.tool, i)
    rows = sql(
        pg_url,
        "SELECT op_id, kind, xmin::text FROM events WHERE op_id IS NOT NULL ORDER BY seq",
    )
    assert [kind for _, kind, _ in rows] == ["gate_passed", "accepted", "committed"] * 5
    txn = {(op, kind): x for op, kind, x in rows}
    ops = list(dict.fromkeys(op for op, _, _ in rows))
    for earlier, later in itertools.pairwise(ops):
        assert txn[(earlier, "committed")] == txn[(later, "gate_passed")]
    assert sql(pg_url, "SELECT DISTINCT status FROM operations") == [("committed",)]


async def test_a_runs_end_rides_its_last_outcomes_transaction(pg_url: str) -> None:
    """A run's block ends after its last call: the call's deferred outcome and the run's
    move commit in one transaction (they were two, the move waiting for the outcome's),
    in that order, each once."""
    provider = FakeProvider("send")
    async with stopline.open(pg_url + NEVER) as ledger:
        for n in range(3):
            async with ledger.run("r", owner="u", run_id=f"r{n}") as run:
                await run.call(provider.tool, n)
    rows = sql(pg_url, "SELECT run_id, kind, xmin::text FROM events ORDER BY seq")
    for n in range(3):
        mine = [(kind, x) for run_id, kind, x in rows if run_id == f"r{n}"]
        kinds = [kind for kind, _ in mine]
        assert kinds == ["run_created", "gate_passed", "accepted", "committed", "complete"]
        txn = dict(mine)
        assert txn["committed"] == txn["complete"]
    assert sql(pg_url, "SELECT DISTINCT state FROM runs") == [("completed",)]


async def test_a_runs_move_never_joins_a_group_holding_a_gate(
    backend: PostgresBackend,
) -> None:
    """A run's move may wait for its run's lock; a group holding another run's (a gate's)
    must never wait for one (a tree cancel takes runs in its own order): the move then
    goes in the next group. After outcomes alone it goes last, and ends the group."""
    group = backend.group

    def taken(*jobs: Job) -> list[str]:
        group._queue.extend(jobs)
        try:
            return [job.op_id for job in group._take()]
        finally:
            group._queue.clear()

    move = Job("move", _job("m", _GATE, None).alone, batch=([], lambda found: None))
    assert taken(_job("o1", _OUTCOME, "a"), move, _job("o2", _OUTCOME, "b")) == ["o1", "move"]
    assert taken(_job("g1", _GATE, "a"), _job("o1", _OUTCOME, "b"), move) == ["g1", "o1"]
    assert taken(move, _job("g1", _GATE, "a")) == ["move"]


async def test_concurrent_gates_share_one_transaction(backend: PostgresBackend) -> None:
    await backend.create_run(run_spec())
    results = {}

    async def one(i: int) -> None:
        results[i] = await backend.gate(op_spec(f"run_a/{i}:send"))

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert {r.verdict for r in results.values()} == {GateVerdict.PASSED}
    # the first caller finds nothing queued and goes alone; the 19 behind it, together
    assert backend.group.transactions == 1
    events = await backend.events("run_a")
    assert sorted(e.op_id or "" for e in events if e.kind == "gate_passed") == sorted(
        f"run_a/{i}:send" for i in range(20)
    )


async def test_a_caller_cancelled_while_its_gate_waits_in_the_queue_still_learns_it(
    backend: PostgresBackend,
) -> None:
    """A gate queued behind a group transaction in progress, its caller's scope cancelled
    while it waits: the gate is written once and its caller learns that it passed (a
    started write finishes, as SQLite's writer does); the cancel reaches the caller at
    its next checkpoint."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))
    backend.record_deferred("run_a/0:send", COMMIT, _collect([]))
    held, go = anyio.Event(), anyio.Event()

    async def hold(pid: int) -> None:
        held.set()
        await go.wait()

    backend.group.before_batch = hold
    got: dict[str, Any] = {}
    scope = anyio.CancelScope()

    async def queued() -> None:
        with scope:
            got["gate"] = await backend.gate(op_spec("run_a/2:send"))
            await anyio.lowlevel.checkpoint()
            got["went on"] = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.gate, op_spec("run_a/1:send"))  # leads, with the outcome
        await held.wait()
        backend.group.before_batch = None
        tg.start_soon(queued)
        while not any(job.op_id == "run_a/2:send" for job in backend.group._queue):
            await anyio.lowlevel.checkpoint()
        scope.cancel()
        await anyio.lowlevel.checkpoint()
        go.set()
    assert got["gate"].verdict is GateVerdict.PASSED and "went on" not in got
    assert scope.cancelled_caught
    passed = [e.op_id for e in await backend.events("run_a") if e.kind == "gate_passed"]
    assert passed == ["run_a/0:send", "run_a/1:send", "run_a/2:send"]


async def test_a_read_waits_for_the_deferred_outcomes(backend: PostgresBackend) -> None:
    """Nothing the process does after deferring an outcome misses it (the bound here is
    far longer than the test: the read itself has it committed first)."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec())
    got: list[Any] = []
    backend.record_deferred("run_a/1:send", COMMIT, _collect(got))
    with anyio.fail_after(10):
        op = await backend.get_operation("run_a/1:send")
    assert op.status is OpStatus.COMMITTED
    assert [o.status for o in got] == [OpStatus.COMMITTED]


async def test_close_commits_the_deferred_outcomes(pg_url: str) -> None:
    backend = await PostgresBackend.open(pg_url + NEVER)
    await backend.create_run(run_spec())
    await backend.gate(op_spec())
    got: list[Any] = []
    backend.record_deferred("run_a/1:send", COMMIT, _collect(got))
    with anyio.fail_after(10):
        await backend.close()
    assert [o.status for o in got] == [OpStatus.COMMITTED]
    assert sql(pg_url, "SELECT status FROM operations") == [("committed",)]


async def test_an_illegal_outcome_in_a_group_fails_alone(backend: PostgresBackend) -> None:
    """One outcome the table refuses (its operation unknown) is that caller's error; the
    others in the same transaction commit."""
    await backend.create_run(run_spec())
    for i in range(3):
        await backend.gate(op_spec(f"run_a/{i}:send"))
    got: list[Any] = []
    for op_id in ("run_a/0:send", "run_a/nope", "run_a/2:send"):
        backend.record_deferred(op_id, COMMIT, _collect(got))
    await backend.gate(op_spec("run_a/3:send"))  # the four in one transaction
    assert backend.group.transactions == 1
    assert [getattr(o, "status", None) for o in got] == [
        OpStatus.COMMITTED,
        None,
        OpStatus.COMMITTED,
    ]
    assert isinstance(got[1], stopline.UnknownOperation)


CLIENT_FAILURES = pytest.mark.parametrize(
    "failure",
    [psycopg.ProgrammingError("simulated: a parameter it cannot send"), RuntimeError("a bug")],
    ids=["psycopg", "other"],
)


_THE_GATE, _THE_MOVE = "INSERT INTO operations", "UPDATE runs SET state"  # in their SQL


async def _outcome_then_failing(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, failure: Exception, at: str
) -> tuple[list[Any], list[bool]]:
    """An outcome deferred; the client then fails once, queuing the first statement that
    contains ``at`` (the next job of the group, after the outcome). The outcomes, and
    whether the failure is still to come."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))
    got: list[Any] = []
    backend.record_deferred("run_a/0:send", COMMIT, _collect(got))
    spell = postgres_txn.pg_sql
    armed = [True]

    def failing(sql: str) -> str:
        if armed[0] and at in sql:
            armed[0] = False
            raise failure
        return spell(sql)

    monkeypatch.setattr(postgres_txn, "pg_sql", failing)
    return got, armed


@CLIENT_FAILURES
async def test_a_client_failing_mid_group_is_a_commit_in_doubt(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """A group transaction is one pipeline with no ``BEGIN``: its ``Sync`` commits what
    was sent even when the client fails before queuing the rest. So that failure is a
    commit in doubt: each job runs alone after reading back whether it landed. The
    outcome sent before the failure is found committed, not recorded again; the gate
    never sent passes once."""
    got, armed = await _outcome_then_failing(backend, monkeypatch, failure, at=_THE_GATE)
    with anyio.fail_after(20):
        result = await backend.gate(op_spec("run_a/1:send"))
    assert not armed[0]  # the group failed between its two statements
    assert result.verdict is GateVerdict.PASSED
    assert [o.status for o in got] == [OpStatus.COMMITTED]
    kinds = [(e.op_id, e.kind) for e in await backend.events("run_a")]
    assert kinds.count(("run_a/0:send", "committed")) == 1
    assert kinds.count(("run_a/1:send", "gate_passed")) == 1
    assert [e.kind for e in await backend.events("run_a") if e.kind.startswith("evidence")] == []


@CLIENT_FAILURES
async def test_a_client_failing_before_a_runs_move_in_a_group_moves_it_once(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """A run's end rides its outcome's group as one statement (its lock, event and
    write, ``PostgresDialect.move_sql``), so it lands whole or not at all. The client
    failing after the outcome was sent, before the move: the outcome is found
    committed, and the run moves once, with one event."""
    got, armed = await _outcome_then_failing(backend, monkeypatch, failure, at=_THE_MOVE)
    with anyio.fail_after(20):
        run, moved = await backend.run_event("run_a", RunEvent.COMPLETE, by="u")
    assert not armed[0]
    assert moved and run.state is RunState.COMPLETED
    assert [o.status for o in got] == [OpStatus.COMMITTED]
    kinds = [e.kind for e in await backend.events("run_a")]
    assert kinds == ["run_created", "gate_passed", "committed", "complete"]


async def test_a_group_transactions_connection_killed_loses_nothing(
    backend: PostgresBackend,
) -> None:
    """The server ends the connection under a group transaction (an administrator, a
    failover): each job runs again alone, settling its doubt first; every gate passes
    once, the outcome lands once, nothing else is touched."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))
    killed: list[int] = []

    async def kill(pid: int) -> None:
        if not killed:
            killed.append(pid)
            terminate(backend.conninfo, pid)

    backend.group.before_batch = kill
    got: list[Any] = []
    backend.record_deferred("run_a/0:send", COMMIT, _collect(got))
    results = {}

    async def one(i: int) -> None:
        results[i] = await backend.gate(op_spec(f"run_a/{i}:send"))

    with anyio.fail_after(20):  # nothing hangs
        async with anyio.create_task_group() as tg:
            for i in range(1, 6):
                tg.start_soon(one, i)
        await backend.group.barrier()
    assert killed
    assert {r.verdict for r in results.values()} == {GateVerdict.PASSED}
    assert [o.status for o in got] == [OpStatus.COMMITTED]
    kinds = [(e.op_id, e.kind) for e in await backend.events("run_a")]
    for i in range(6):
        assert kinds.count((f"run_a/{i}:send", "gate_passed")) == 1
    assert kinds.count(("run_a/0:send", "committed")) == 1
    assert (await backend.get_run("run_a")).state is stopline.RunState.RUNNING


async def test_a_group_transaction_left_unreachable_gives_each_caller_its_error(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection dies under a group transaction and the server stays unreachable.
    If the client learnt of it only after sending ``COMMIT``, the group's gate raises
    ``GateInDoubt`` and its deferred outcome ``CommitInDoubt``; if before (the dead
    socket noticed at ``BEGIN``), both ``LedgerUnavailable``; the gates queued behind
    it, never sent, raise ``LedgerUnavailable``; all within one ``retry_for`` per
    group. Once the server is back the doubt settles (it had not landed) and nothing
    was recorded twice."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))
    outage = Outage(backend, monkeypatch)

    async def kill(pid: int) -> None:
        backend.group.before_batch = None
        outage.begin(pid)

    backend.group.before_batch = kill
    got: list[Any] = []
    backend.record_deferred("run_a/0:send", COMMIT, _collect(got))
    errors: dict[int, str] = {}

    async def one(i: int) -> None:
        try:
            await backend.gate(op_spec(f"run_a/{i}:send"))
        except StoplineError as exc:
            errors[i] = type(exc).__name__

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(1, 4):
                tg.start_soon(one, i)
    # gate 1 rode with the outcome (the killed transaction); 2 and 3 queued behind it
    assert (errors[1], *(type(o).__name__ for o in got)) in {
        ("GateInDoubt", "CommitInDoubt"),
        ("LedgerUnavailable", "LedgerUnavailable"),
    }
    assert (errors[2], errors[3]) == ("LedgerUnavailable", "LedgerUnavailable")
    outage.end()
    statuses = {op.id: op.status for op in await backend.operations("run_a")}
    assert statuses == {"run_a/0:send": OpStatus.REQUESTED}  # the rest never sent
    assert backend.doubts == {}


async def test_a_group_that_breaks_unexpectedly_answers_every_caller(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug reading a group's results (here injected) is every caller's error and the
    deferred outcome's; nobody waits forever, and the next group works."""
    import stopline.ledger.postgres_batch as batch

    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))

    def broken(job: Any, row: Any) -> Any:
        raise RuntimeError("injected: results unreadable")

    monkeypatch.setattr(batch, "_recorded", broken)
    got: list[Any] = []

    def then(outcome: Callable[[], OperationRecord]) -> None:
        try:
            got.append(outcome())
        except RuntimeError as exc:
            got.append(exc)

    backend.record_deferred("run_a/0:send", COMMIT, then)
    errors: list[str] = []

    async def one(i: int) -> None:
        try:
            await backend.gate(op_spec(f"run_a/{i}:send"))
        except RuntimeError as exc:
            errors.append(str(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(1, 3):
                tg.start_soon(one, i)
    assert [type(o).__name__ for o in got] == ["RuntimeError"]
    assert errors  # the gate(s) in that group heard of it too
    monkeypatch.undo()
    assert (await backend.gate(op_spec("run_a/9:send"))).verdict is GateVerdict.PASSED


async def test_gates_and_outcomes_take_no_connection_from_the_pool(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone or together, gates and outcomes run on the group commit's own connection:
    one connect, then no checkout from the pool (counted, not timed)."""
    await backend.create_run(run_spec())
    checkout = backend.pool.connection
    checkouts: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        checkouts.append(1)
        return checkout(*args, **kwargs)

    monkeypatch.setattr(backend.pool, "connection", counted)
    got: list[Any] = []
    for i in range(5):  # a sequential workflow: each outcome rides the next gate
        await backend.gate(op_spec(f"run_a/{i}:send"))
        backend.record_deferred(f"run_a/{i}:send", COMMIT, _collect(got))
    await backend.group.barrier()
    async with anyio.create_task_group() as tg:  # and concurrent gates, grouped
        for i in range(5, 15):
            tg.start_soon(backend.gate, op_spec(f"run_a/{i}:send"))
    assert [o.status for o in got] == [OpStatus.COMMITTED] * 5
    assert checkouts == []
    assert backend.group.reserved.connections == 1


async def test_one_group_transaction_at_a_time(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leadership passes from a leader to the next waiting caller, never to a second
    leader beside it. A's lone gate is held while B queues; when it returns, B is
    handed the lead, but A's next gate comes first and B's transaction is A's; then
    C arrives while that transaction is held open. C must queue behind it: the group
    commit's one connection is never asked for twice at a time (it would refuse: an
    ``AssertionError`` for C)."""
    await backend.create_run(run_spec())
    a_in, release_a = anyio.Event(), anyio.Event()
    batch_in, release_batch = anyio.Event(), anyio.Event()
    write1 = Tx.write1

    async def held_write1(self: Tx, statement: str, params: Any = ()) -> Any:
        if not a_in.is_set():
            a_in.set()
            await release_a.wait()
        return await write1(self, statement, params)

    async def held_batch(pid: int) -> None:
        backend.group.before_batch = None
        batch_in.set()
        await release_batch.wait()

    monkeypatch.setattr(Tx, "write1", held_write1)
    backend.group.before_batch = held_batch
    got: list[Any] = []
    results: dict[str, GateVerdict] = {}

    async def gate(op_id: str) -> None:
        results[op_id] = (await backend.gate(op_spec(op_id))).verdict

    async def a() -> None:
        await gate("run_a/0:send")  # alone, held until B has queued
        backend.record_deferred("run_a/0:send", COMMIT, _collect(got))
        await gate("run_a/2:send")  # before B has woken to lead

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a)
            await a_in.wait()
            tg.start_soon(gate, "run_a/1:send")
            await anyio.wait_all_tasks_blocked()  # B queued
            release_a.set()
            await batch_in.wait()  # a group transaction holds the connection
            await anyio.wait_all_tasks_blocked()  # B woken, handed the lead
            tg.start_soon(gate, "run_a/3:send")
            await anyio.wait_all_tasks_blocked()  # C: queued (or, wrongly, leading)
            release_batch.set()
    assert results == {f"run_a/{i}:send": GateVerdict.PASSED for i in range(4)}
    assert [o.status for o in got] == [OpStatus.COMMITTED]


async def test_a_group_transaction_is_one_round_trip(
    backend: PostgresBackend, tmp_path: Path
) -> None:
    """``BEGIN``, an outcome, a gate and ``COMMIT`` go in one pipeline with one ``Sync``
    (there was a second, empty one at the pipeline's exit: a wasted round trip).
    Counted from the protocol trace, not timed."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))  # the group commit's connection, opened
    got: list[Any] = []
    backend.record_deferred("run_a/0:send", COMMIT, _collect(got))
    trace = tmp_path / "group.trace"
    with trace.open("w") as out:
        async with backend.group.reserved.lease() as conn:
            conn.pgconn.trace(out.fileno())
        try:
            await backend.gate(op_spec("run_a/1:send"))  # rides with the outcome
        finally:
            async with backend.group.reserved.lease() as conn:
                conn.pgconn.untrace()
    assert backend.group.transactions == 1
    assert [o.status for o in got] == [OpStatus.COMMITTED]
    assert round_trips(trace) == 1


# -- stretches: many runs' records in few statements, each run's in its order ----------
def _job(op_id: str, forms: Forms, run: str | None) -> Job:
    async def alone(doubt: bool, deadline: float, connection: Any) -> None:
        raise AssertionError("not run here")

    return Job(op_id, alone, forms=forms, params=dict, run=run)


_GATE = Forms("gate one", "gate many", True)
_OUTCOME = Forms("outcome one", "outcome many", False)


def _shape(stretches: list[list[Job]]) -> list[list[str]]:
    return [[job.op_id for job in stretch] for stretch in stretches]


def test_interleaved_gates_and_outcomes_of_many_runs_go_in_one_stretch_per_kind() -> None:
    work = [
        _job("a2", _GATE, "a"),
        _job("b1", _OUTCOME, "b"),
        _job("c2", _GATE, "c"),
        _job("d1", _OUTCOME, "d"),
    ]
    assert _shape(_stretches(work)) == [["a2", "c2"], ["b1", "d1"]]


def test_a_runs_records_keep_their_order_across_stretches() -> None:
    """A call's outcome, then the next call's intent, then that run's next outcome:
    never written before what the run queued ahead of them."""
    work = [
        _job("r1", _OUTCOME, "r"),
        _job("r2", _GATE, "r"),
        _job("s1", _OUTCOME, "s"),
        _job("r0", _OUTCOME, "r"),
        _job("s2", _GATE, "s"),
    ]
    assert _shape(_stretches(work)) == [["r1", "s1"], ["r2", "s2"], ["r0"]]


def test_a_record_of_no_known_run_keeps_its_place_among_all() -> None:
    work = [
        _job("a1", _GATE, "a"),
        _job("x", _OUTCOME, None),
        _job("b1", _GATE, "b"),
        _job("c1", _OUTCOME, "c"),
    ]
    assert _shape(_stretches(work)) == [["a1"], ["x", "c1"], ["b1"]]


async def test_many_runs_share_a_group_in_few_statements_each_in_its_order(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent runs: their gates and outcomes interleave in the queue, yet a group
    transaction writes them in one statement per kind, and each run's log keeps its
    calls' order (an outcome before the next call's intent)."""
    groups: list[tuple[int, int]] = []  # (jobs, statements) per group transaction
    chop = postgres_batch._stretches

    def counted(work: list[Job]) -> list[list[Job]]:
        stretches = chop(work)
        groups.append((len(work), len(stretches)))
        return stretches

    monkeypatch.setattr(postgres_batch, "_stretches", counted)
    provider = FakeProvider("send")
    runs, calls = 12, 4
    async with stopline.open(pg_url + NEVER) as ledger:

        async def one(n: int) -> None:
            async with ledger.run("r", owner="u", run_id=f"r{n}") as run:
                for i in range(calls):
                    await run.call(provider.tool, i)

        async with anyio.create_task_group() as tg:
            for n in range(runs):
                tg.start_soon(one, n)
    big = [(jobs, statements) for jobs, statements in groups if jobs >= runs]
    assert big, groups  # the runs did share group transactions
    assert all(statements <= 4 for _, statements in big), big  # gate, 2 outcomes, gate
    rows = sql(
        pg_url, "SELECT run_id, op_id, kind FROM events WHERE op_id IS NOT NULL ORDER BY seq"
    )
    for n in range(runs):
        mine = [(op, kind) for run_id, op, kind in rows if run_id == f"r{n}"]
        ops = list(dict.fromkeys(op for op, _ in mine))
        assert len(ops) == calls
        expected = [(op, kind) for op in ops for kind in ("gate_passed", "accepted", "committed")]
        assert mine == expected
