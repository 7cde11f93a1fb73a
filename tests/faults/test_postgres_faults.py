"""PostgreSQL under faults: a lost cancel reply, a server gone mid-block, racing doubts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio
import psycopg
import pytest

import stopline
from stopline import Principal, RunState
from stopline.domain.vocab import RunEvent
from stopline.errors import CancelInDoubt, InvalidInput, LedgerUnavailable
from stopline.ledger import postgres_txn
from stopline.ledger.postgres import PostgresBackend
from stopline.ledger.postgres_txn import Tx
from stopline.testing import FakeProvider
from tests.ledger.contract import COMMIT, op_spec, run_spec
from tests.postgres.server import Outage, server_url, terminate

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def backend(pg_url: str, request: pytest.FixtureRequest) -> AsyncIterator[PostgresBackend]:
    # a test of a ledger that stays unreachable needs a short window to end in; one
    # whose retry must succeed (``patient``) a wide one: on a loaded machine a new
    # connection took longer than 0.5 s, and the cancel was "in doubt" (no timing is
    # asserted either way)
    window = 30 if request.node.get_closest_marker("patient") else 0.5
    opened = await PostgresBackend.open(pg_url + f"&retry_for={window}")
    try:
        yield opened
    finally:
        await opened.close()


@contextlib.contextmanager
def unreachable_after_lost_commit(backend: PostgresBackend) -> Iterator[None]:
    """The next transaction commits (an explicit one, or an implicit one: a pipeline its
    ``Sync`` commits) but its reply is lost; then the server is unreachable (the pool's
    checkouts and the group commit's reconnects refused)."""
    original_tx, original_implicit = Tx.transaction, Tx.implicit
    state = {"armed": True}

    with pytest.MonkeyPatch.context() as patch:
        outage = Outage(backend, patch)

        def lost(tx: Tx) -> None:
            if state["armed"]:
                state["armed"] = False
                outage.begin()
                tx.in_doubt = True
                raise psycopg.OperationalError(
                    "simulated: server closed the connection unexpectedly"
                )

        @contextlib.asynccontextmanager
        async def transaction(self: Tx, *, snapshot: bool = False) -> AsyncIterator[None]:
            async with original_tx(self, snapshot=snapshot):
                yield
            lost(self)

        async def implicit(self: Tx, statements: Any) -> list[list[Any]]:
            results = await original_implicit(self, statements)
            lost(self)
            return results

        patch.setattr(Tx, "transaction", transaction)
        patch.setattr(Tx, "implicit", implicit)
        yield


async def test_a_cancel_whose_reply_is_lost_is_cancel_in_doubt(backend: PostgresBackend) -> None:
    await backend.create_run(run_spec())
    with unreachable_after_lost_commit(backend), pytest.raises(CancelInDoubt) as info:
        await backend.cancel("run_a", by="u")
    assert info.value.run_id == "run_a"
    assert "may have taken effect" in str(info.value)
    again = await backend.cancel("run_a", by="u")  # safe and idempotent: it had landed
    assert not again.first
    assert again.run.state is RunState.CANCELLING
    kinds = [e.kind for e in await backend.events("run_a")]
    assert kinds.count("cancel") == 1


class EndedAtBatch:
    """``Tx.batch``, ``Tx.implicit`` (a group transaction) and ``Tx.write1`` (one
    statement that commits by itself) patched: the server ends the connection of the
    first of them that ``when(statements, commit)`` picks, before it leaves, or
    (``reply_lost``) after it committed, its reply lost. ``ended``: that connection's
    server process; ``used``: each one's."""

    def __init__(
        self,
        backend: PostgresBackend,
        monkeypatch: pytest.MonkeyPatch,
        when: Callable[[Sequence[Any], bool], bool],
        *,
        reply_lost: bool = False,
    ) -> None:
        self.ended: list[int] = []
        self.used: list[int] = []
        original, implicit, write1 = Tx.batch, Tx.implicit, Tx.write1
        Run = Callable[[], Awaitable[Any]]

        async def cut(tx: Tx, statements: Any, commit: bool, run: Run) -> Any:
            pid = tx.conn.info.backend_pid
            self.used.append(pid)
            if self.ended or not when(statements, commit):
                return await run()
            self.ended.append(pid)
            if not reply_lost:
                terminate(backend.conninfo, pid)
                return await run()
            await run()
            terminate(backend.conninfo, pid)
            tx.in_doubt = True  # the reply of a sent COMMIT never came
            raise psycopg.OperationalError("simulated: server closed the connection unexpectedly")

        async def batch(tx: Tx, statements: Any, *, commit: bool = False) -> Any:
            def run() -> Awaitable[list[list[Any]]]:
                return original(tx, statements, commit=commit)

            return await cut(tx, statements, commit, run)

        async def implicit_batch(tx: Tx, statements: Any) -> Any:
            return await cut(tx, statements, True, lambda: implicit(tx, statements))

        async def one_statement(tx: Tx, sql: str, params: Any = ()) -> Any:
            return await cut(tx, [(sql, params)], True, lambda: write1(tx, sql, params))

        monkeypatch.setattr(Tx, "batch", batch)
        monkeypatch.setattr(Tx, "implicit", implicit_batch)
        monkeypatch.setattr(Tx, "write1", one_statement)


@pytest.mark.patient
async def test_a_lone_cancel_whose_connection_dies_under_its_one_round_trip_is_retried(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the connection just before a childless run's cancel sends its one
    batch (lock, fence, notification, read-back and ``COMMIT``): the commit was on its
    way, so it is in doubt; a cancel is safe to run again, and runs again on a new
    connection: the run is fenced once, and the second try says it was first."""
    await backend.create_run(run_spec())
    ended = EndedAtBatch(backend, monkeypatch, lambda statements, commit: commit)
    result = await backend.cancel("run_a", by="u")
    killed, used = ended.ended, ended.used
    assert killed and used[0] == killed[0] and used[-1] != killed[0]
    assert len(used) == 2  # one batch each try: the childless form, both times
    assert result.first and result.fenced == ("run_a",)
    assert result.run.state is RunState.CANCELLING
    assert [e.kind for e in await backend.events("run_a")].count("cancel") == 1


@pytest.mark.parametrize("transient", [True, False], ids=["connection", "client-bug"])
async def test_a_lone_cancel_whose_client_fails_before_its_fence_is_sent_fences_once(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, transient: bool
) -> None:
    """A childless run's cancel is one pipeline with no ``BEGIN``: the run's lock, its
    notification, then its fence as one statement; the pipeline's ``Sync`` commits
    what was sent. The client fails after the lock and the notification left, before
    the fence was queued: its commit is in doubt. A connection error is retried (a
    cancel is safe to run again); an error that would come again is
    ``CancelInDoubt``, and cancelling again is safe. Either way the run is fenced
    once, and the cancel that fenced it says it was first."""
    await backend.create_run(run_spec())
    spell = postgres_txn.pg_sql
    failed: list[str] = []
    failure = (psycopg.OperationalError if transient else psycopg.ProgrammingError)(
        "simulated: the client failed mid-pipeline"
    )

    def failing(sql: str) -> str:
        if not failed and "UPDATE approvals" in sql:
            failed.append(sql)
            raise failure
        return spell(sql)

    monkeypatch.setattr(postgres_txn, "pg_sql", failing)
    with anyio.fail_after(20):
        if transient:
            result = await backend.cancel("run_a", by="u")
        else:
            with pytest.raises(CancelInDoubt):
                await backend.cancel("run_a", by="u")
            assert (await backend.get_run("run_a")).state is RunState.RUNNING  # not fenced
            result = await backend.cancel("run_a", by="u")
    assert failed
    assert result.first and result.fenced == ("run_a",)
    assert result.run.state is RunState.CANCELLING
    assert [e.kind for e in await backend.events("run_a")].count("cancel") == 1


@pytest.mark.parametrize("landed", [False, True], ids=["before-it-left", "reply-lost"])
@pytest.mark.patient
async def test_a_run_created_in_one_round_trip_is_settled_after_its_connection_dies(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The server ends the connection under a run's creation, whose row, event and
    ``COMMIT`` go in one round trip: before the batch left (nothing landed: it runs
    again) or after it committed (its reply lost: the run is found there, and is the
    answer). Either way the run is created once, with one ``run_created`` event."""
    ended = EndedAtBatch(backend, monkeypatch, lambda statements, commit: commit, reply_lost=landed)
    run = await backend.create_run(run_spec("run_new"))
    assert ended.ended
    assert run == await backend.get_run("run_new")
    assert [e.kind for e in await backend.events("run_new")] == ["run_created"]


@pytest.mark.parametrize("landed", [False, True], ids=["before-it-left", "reply-lost"])
@pytest.mark.patient
async def test_a_run_moved_with_its_commit_is_settled_after_its_connection_dies(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The server ends the connection under a run's move, one statement (its lock, event
    and write) that commits by itself: before it left (it runs again) or after it
    committed (its reply lost: the run is found moved on, and is the answer). The run
    moves once, with one event."""
    await backend.create_run(run_spec("run_m"))
    ended = EndedAtBatch(backend, monkeypatch, lambda statements, commit: commit, reply_lost=landed)
    run, moved = await backend.run_event("run_m", RunEvent.COMPLETE, by="u")
    assert ended.ended and moved
    assert run.state is RunState.COMPLETED
    assert run == await backend.get_run("run_m")
    assert [e.kind for e in await backend.events("run_m")] == ["run_created", "complete"]


@pytest.mark.parametrize("landed", [False, True], ids=["before-it-left", "reply-lost"])
async def test_a_runs_end_riding_its_outcomes_group_is_settled_after_its_connection_dies(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """A run's end rides the group transaction of its last call's deferred outcome. The
    server ends that transaction's connection before it left (each runs again, alone)
    or after it committed (its reply lost: each is settled by reading back). Either
    way the outcome lands once and the run moves once, each with one event."""
    backend = await PostgresBackend.open(pg_url + "&retry_for=30&group_commit_ms=60000")
    try:
        await backend.create_run(run_spec("run_e"))
        await backend.gate(op_spec("run_e/1:send", run_id="run_e"))
        got: list[Any] = []
        backend.record_deferred("run_e/1:send", COMMIT, lambda outcome: got.append(outcome()))

        def together(statements: Sequence[Any], commit: bool) -> bool:
            sent = " ".join(sql for sql, _ in statements)
            return commit and "UPDATE runs SET state" in sent and "UPDATE operations" in sent

        ended = EndedAtBatch(backend, monkeypatch, together, reply_lost=landed)
        with anyio.fail_after(20):
            run, moved = await backend.run_event("run_e", RunEvent.COMPLETE, by="u")
        assert ended.ended and moved  # the group carrying both was the one cut
        assert run.state is RunState.COMPLETED
        assert [op.status for op in got] == [stopline.OpStatus.COMMITTED]
        kinds = [e.kind for e in await backend.events("run_e")]
        assert kinds == ["run_created", "gate_passed", "committed", "complete"]
    finally:
        await backend.close()


@pytest.mark.patient
async def test_a_tree_cancel_whose_connection_dies_between_its_batches_is_retried_whole(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the cancel's connection after the root's batch, before the rest of
    the tree's: the transaction rolls back (nothing was committing, so no doubt), the
    cancel runs again on a new connection, and every run is fenced once."""
    for run_id, parent in (("root", None), ("child", "root"), ("grandchild", "child")):
        await backend.create_run(run_spec(run_id, parent_id=parent))
    ended = EndedAtBatch(  # at a level of the tree, read
        backend,
        monkeypatch,
        lambda statements, commit: statements[-1][0].startswith("SELECT run_id, owner_run"),
    )
    result = await backend.cancel("root", by="u")
    killed, used = ended.ended, ended.used
    # after the leaf form's try and the root's batch as a tree, on their connection
    assert killed and used[:3] == [killed[0]] * 3
    assert used[-1] != killed[0]  # run again whole, on another connection
    assert result.first and result.fenced == ("root", "child", "grandchild")
    for run_id in result.fenced:
        assert (await backend.get_run(run_id)).state is RunState.CANCELLING
        assert [e.kind for e in await backend.events(run_id)].count("cancel") == 1


async def test_settling_doubts_is_single_flight(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stopline.ledger import postgres_settle

    await backend.create_run(run_spec())
    settled: list[str] = []
    original = postgres_settle.gate_committed  # type: ignore[attr-defined]

    async def slow_gate_committed(tx: Tx, op_id: str, token: str) -> Any:
        settled.append(op_id)
        await anyio.sleep(0.2)  # widen the window in which others could take it too
        return await original(tx, op_id, token)

    monkeypatch.setattr(postgres_settle, "gate_committed", slow_gate_committed)
    backend._doubts["run_a/never"] = "a token no gate wrote"  # a doubt that never landed
    async with anyio.create_task_group() as tg:
        for _ in range(4):  # every one of these transactions settles doubts first
            tg.start_soon(backend.get_run, "run_a")
    assert settled == ["run_a/never"]  # one of them did, the others left it alone
    assert backend._doubts == {}


async def test_a_typed_error_survives_the_run_block_while_the_database_is_down(
    pg_url: str,
) -> None:
    async with stopline.open(pg_url + "&retry_for=0.3") as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        await backend.create_run(run_spec("run_other"))

        async def job() -> None:
            async with ledger.run("job", owner="u", run_id="run_job"):
                with unreachable_after_lost_commit(backend):
                    await ledger.cancel("run_other", by=Principal("user:1", tenant="acme"))

        with pytest.raises(CancelInDoubt):  # not hidden behind the block's own exit error
            await job()
        # the database is back: the held end of the run lands, nothing stays "running"
        with anyio.fail_after(20):
            while (await backend.get_run("run_job")).state is RunState.RUNNING:
                await ledger.wait_for_change("run_job")
        assert (await backend.get_run("run_job")).state is RunState.FAILED


async def test_a_megabyte_id_is_refused_before_the_network(pg_url: str) -> None:
    huge = "r" * 1_000_000
    async with stopline.open(pg_url) as ledger:
        with pytest.raises(InvalidInput, match="run_id"):
            async with ledger.run("job", owner="u", run_id=huge):
                pass
        with pytest.raises(InvalidInput, match="run_id"):
            await ledger.cancel(huge, by="u")
        async with ledger.run("job", owner="u", run_id="run_ok") as run:
            with pytest.raises(InvalidInput, match="key"):
                await run.call(FakeProvider("send").tool, "x", key=huge)
        assert [r.id for r in await ledger.backend.list_runs()] == ["run_ok"]
        assert await ledger.backend.operations("run_ok") == []


@pytest.mark.parametrize("landed", [False, True], ids=["before-it-left", "reply-lost"])
@pytest.mark.patient
async def test_a_phase_entered_with_its_commit_is_logged_once_after_its_connection_dies(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The server ends the connection under a phase's one round trip (the run's lock and
    read, its change, its event and the ``COMMIT``): before it left (it runs again) or
    after it committed, its reply lost. Entering a phase is not safe to run twice (its
    event would be logged twice), so the doubt is settled by reading back whether this
    attempt's event is in the log: one ``phase`` event either way."""
    await backend.create_run(run_spec("run_p"))
    ended = EndedAtBatch(backend, monkeypatch, lambda statements, commit: commit, reply_lost=landed)
    run = await backend.set_phase("run_p", stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE)
    assert ended.ended
    assert (run.phase, run.policy) == (stopline.PhaseKind.READING, stopline.Policy.IMMEDIATE)
    assert run == await backend.get_run("run_p")
    assert [e.kind for e in await backend.events("run_p")] == ["run_created", "phase"]


@pytest.mark.parametrize("landed", [False, True], ids=["before-it-left", "reply-lost"])
@pytest.mark.patient
async def test_an_audit_is_logged_once_after_its_connection_dies(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """A denial's audit event is one statement that commits by itself; the server ends
    its connection before it left or after it committed (its reply lost). The audit
    trail says once what was denied, not twice."""
    await backend.create_run(run_spec("run_d"))
    ended = EndedAtBatch(backend, monkeypatch, lambda statements, commit: commit, reply_lost=landed)
    await backend.audit("run_d", principal="eve", action="cancel", allowed=False, detail="no")
    assert ended.ended
    assert [e.kind for e in await backend.events("run_d")] == ["run_created", "denied"]


def commit_reply_lost_once(backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The next explicit transaction commits, then the server ends its connection before
    the reply: the returned list holds that session's pid once it has."""
    original = Tx.transaction
    ended: list[int] = []

    @contextlib.asynccontextmanager
    async def transaction(self: Tx, *, snapshot: bool = False) -> AsyncIterator[None]:
        async with original(self, snapshot=snapshot):
            yield
        if not ended and not snapshot:
            ended.append(self.conn.info.backend_pid)
            terminate(backend.conninfo, ended[0])
            self.in_doubt = True  # the reply of the sent COMMIT never came
            raise psycopg.OperationalError("simulated: server closed the connection unexpectedly")

    monkeypatch.setattr(Tx, "transaction", transaction)
    return ended


async def test_an_owner_added_is_logged_once_after_its_commit_reply_is_lost(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner added (a link made or made again, and its event) commits, and the server
    ends the connection before the reply: the link is there, and one ``owner_added``
    event, not a second from the retry."""
    await backend.create_run(run_spec("run_o"))
    await backend.create_run(run_spec("run_c"))
    ended = commit_reply_lost_once(backend, monkeypatch)
    await backend.add_owner("run_c", "run_o", exclusive=True, by="u")
    assert ended
    kinds = [e.kind for e in await backend.events("run_c")]
    assert kinds == ["run_created", "owner_added"]


async def test_a_page_of_receipts_is_read_again_after_its_connection_dies_and_typed_while_down(
    pg_url: str,
) -> None:
    """``ledger.receipts`` and ``ledger.runs_with_receipts`` (the console's page): the
    server ends the pool's one connection, and each read goes again on a new one, with
    the same answer; while the server refuses connections each is a typed error within
    ``retry_for``, nothing hung; once it is back the page reads as before."""
    async with stopline.open(pg_url + "&retry_for=0.5&pool_max=1") as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        send = FakeProvider("send")
        async with ledger.run("job", owner="u", run_id="run_page") as run:
            await run.call(send.tool, 1)
        expected = await ledger.receipts(["run_page"])
        listed = await ledger.runs_with_receipts()
        assert [(run.id, receipt) for run, receipt in listed] == [
            ("run_page", expected["run_page"])
        ]
        reads: list[tuple[Callable[[], Awaitable[object]], object]] = [
            (lambda: ledger.receipts(["run_page"]), expected),
            (ledger.runs_with_receipts, listed),
        ]
        for read, answer in reads:
            async with backend.pool.connection() as conn:
                pid = conn.info.backend_pid
            terminate(backend.conninfo, pid)
            assert await read() == answer
        with pytest.MonkeyPatch.context() as patch:
            outage = Outage(backend, patch)
            outage.begin()
            for read, _ in reads:
                with anyio.fail_after(20), pytest.raises(LedgerUnavailable):
                    await read()
            outage.end()
        assert await ledger.receipts(["run_page"]) == expected
        assert await ledger.runs_with_receipts() == listed


async def test_a_row_another_session_holds_fails_its_call_typed_and_other_runs_carry_on(
    pg_url: str,
) -> None:
    """Another session holds a run's row (a stuck transaction, an operator's ``SELECT
    ... FOR UPDATE``): the run's call waited for ever at the gate, and every run of the
    process with it (their gates share the group commit). Now the call gets
    ``LedgerLocked`` and sends nothing, and another run's call goes through while the
    row is still held."""
    from stopline.errors import LedgerLocked

    sent: list[str] = []

    @stopline.tool
    async def send(ctx: stopline.CallContext, text: str) -> str:
        sent.append(ctx.key)
        return text

    schema = pg_url.split("schema=")[1].split("&")[0]
    async with (
        stopline.open(pg_url + "&retry_for=1") as ledger,
        ledger.run("a", owner="u", run_id="held") as held,
        ledger.run("b", owner="u", run_id="free") as free,
        await psycopg.AsyncConnection.connect(server_url()) as other,
    ):
        await other.execute(f'SET search_path = "{schema}"')
        await other.execute("BEGIN")
        await other.execute("SELECT id FROM runs WHERE id = 'held' FOR UPDATE")
        with anyio.fail_after(25):  # a guard against the hang, not a timing
            with pytest.raises(LedgerLocked):
                await held.call(send, "one", key="one")
            assert await free.call(send, "two", key="two") == "two"
        await other.execute("ROLLBACK")
    assert sent == ["free/two"]
