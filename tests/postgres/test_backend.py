"""What only the PostgreSQL backend does: fencing leases, commits in doubt, its schema.

The contract suites (tests/ledger) cover the semantics shared with SQLite;
these cover what a shared server adds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import psycopg
import pytest

import stopline
from stopline.domain.lifecycle import CancelResult
from stopline.domain.vocab import OpStatus, PhaseKind, Policy, RunEvent, RunState
from stopline.errors import LedgerCorrupt, LedgerUnavailable, SchemaTooNew, UnknownRun
from stopline.ledger import redact
from stopline.ledger.backend import GateVerdict
from stopline.ledger.engine import fence, reads
from stopline.ledger.postgres import GateInDoubt, LeaseExpired, PostgresBackend
from stopline.ledger.postgres_listen import CATCH_UP, OwnCancels
from stopline.ledger.postgres_txn import Tx
from stopline.ledger.schema import SCHEMA_VERSION
from tests.ledger.contract import op_spec, run_spec
from tests.postgres.server import Outage, fresh_schema, terminate

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")


@pytest.fixture
async def backend(pg_url: str) -> AsyncIterator[PostgresBackend]:
    opened = await PostgresBackend.open(pg_url + "&retry_for=0.5")
    try:
        yield opened
    finally:
        await opened.close()


def sql(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement in the test's schema, outside the backend."""
    base, _, schema = url.partition("?schema=")
    with psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}") as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


# -- leases as fencing tokens -------------------------------------------------------
async def test_expired_lease_cannot_record_an_intent(backend: PostgresBackend) -> None:
    await backend.create_run(run_spec())
    await backend.heartbeat("w1", host="h", pid=1, lease_until=time.time() - 1)
    late = dataclasses.replace(op_spec(), worker="w1")
    with pytest.raises(LeaseExpired):
        await backend.gate(late)
    with pytest.raises(stopline.UnknownOperation):
        await backend.get_operation(late.id)  # nothing recorded
    await backend.heartbeat("w1", host="h", pid=1, lease_until=time.time() + 60)
    assert (await backend.gate(late)).verdict is GateVerdict.PASSED


async def test_recovered_worker_is_fenced_until_it_renews(backend: PostgresBackend) -> None:
    """A worker declared dead (its pid gone, its lease not yet expired) stays fenced."""
    await backend.create_run(run_spec())
    await backend.heartbeat("w1", host="h", pid=1, lease_until=time.time() + 60)
    first = dataclasses.replace(op_spec("run_a/1"), worker="w1")
    assert (await backend.gate(first)).verdict is GateVerdict.PASSED
    (orphan,) = await backend.recover_orphans(["w1"], [stopline.Evidence.local("crash")])
    assert orphan.status is OpStatus.UNKNOWN
    second = dataclasses.replace(op_spec("run_a/2"), worker="w1")
    with pytest.raises(LeaseExpired):
        await backend.gate(second)  # the zombie wakes up: refused at the gate
    await backend.heartbeat("w1", host="h", pid=1, lease_until=time.time() + 60)
    assert (await backend.gate(second)).verdict is GateVerdict.PASSED


async def test_paused_worker_whose_lease_expired_cannot_dispatch(pg_url: str) -> None:
    """Two runtimes: A stalls mid-call past its lease, B recovers A; A's late intent fails."""
    entered, release = anyio.Event(), anyio.Event()

    @stopline.tool(name="pay")
    async def pay(ctx: stopline.CallContext, n: int) -> int:
        if n == 0:
            entered.set()
            await release.wait()
        return n

    async with stopline.open(pg_url, tools=[pay]) as a:
        a.lease = 3600.0  # renewal far away: the test expires the lease itself
        await a._truth.workers.register()
        outcome: dict[str, Any] = {}

        async def workflow() -> None:
            async with a.run("job", owner="user:1", run_id="run_p") as run:
                outcome["first"] = await run.call(pay, 0, key="k0")
                try:
                    await run.call(pay, 1, key="k1")
                except LeaseExpired as exc:
                    outcome["second"] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(workflow)
            await entered.wait()
            sql(pg_url, "UPDATE workers SET lease_until = %s WHERE id = %s", 1.0, a.worker_id)
            async with stopline.open(pg_url, tools=[pay]) as b:  # its recovery sees A dead
                # unknown, and with no read-back anywhere, in review at once (R5)
                recovered = await b.backend.get_operation("run_p/k0")
                assert recovered.status is OpStatus.NEEDS_REVIEW
                assert {"crash", "no_verifier"} <= {e.ref for e in recovered.evidence}
            release.set()
        assert outcome["first"] == 0
        assert isinstance(outcome["second"], LeaseExpired)
        k0 = await a.backend.get_operation("run_p/k0")
        assert k0.status is OpStatus.COMMITTED  # the late response settles it (R4, ADR 0052)
        with pytest.raises(stopline.UnknownOperation):
            await a.backend.get_operation("run_p/k1")  # never recorded, never sent


# -- commits in doubt --------------------------------------------------------------
@contextlib.contextmanager
def lose_reply_once(after_commit: bool, lost: Callable[[Tx], None] | None = None) -> Iterator[None]:
    """The next one-statement write loses its connection, after or before it commits
    (``lost(tx)``: called then, with the write's own connection)."""
    original = Tx.write1
    state = {"armed": True}

    async def write1(self: Tx, statement: str, params: Any = ()) -> Any:
        if not state["armed"]:
            return await original(self, statement, params)
        state["armed"] = False
        self.in_doubt = True
        if after_commit:
            await original(self, statement, params)
            self.in_doubt = True
        if lost is not None:
            lost(self)
        raise psycopg.OperationalError("simulated: server closed the connection unexpectedly")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tx, "write1", write1)
        yield


@pytest.mark.parametrize("after_commit", [True, False])
async def test_gate_in_doubt_is_settled_by_its_token(
    backend: PostgresBackend, after_commit: bool
) -> None:
    await backend.create_run(run_spec())
    with lose_reply_once(after_commit):
        result = await backend.gate(op_spec())
    assert result.verdict is GateVerdict.PASSED
    op = await backend.get_operation("run_a/1:send")
    assert op.status is OpStatus.REQUESTED and op.attempts == 1
    kinds = [e.kind for e in await backend.events("run_a")]
    assert kinds.count("gate_passed") == 1  # landed once, whichever way it went


async def test_gate_in_doubt_while_unreachable_becomes_unknown(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate's commit lands, then the server ends its connection (the reply lost)
    and stays down: the dead connection is noticed when the settling read uses it,
    reconnecting is refused until ``retry_for``, and the gate raises ``GateInDoubt``."""
    await backend.create_run(run_spec())
    outage = Outage(backend, monkeypatch)

    def lost(tx: Tx) -> None:
        outage.begin(tx.conn.info.backend_pid)

    with lose_reply_once(after_commit=True, lost=lost), pytest.raises(GateInDoubt) as info:
        await backend.gate(op_spec())
    outage.end()
    assert info.value.op_id == "run_a/1:send"
    assert backend.group.reserved.pid is None  # the dead connection was let go
    # the next transaction that reaches the server settles it: never "not sent" (R3)
    op = await backend.get_operation("run_a/1:send")
    assert op.status is OpStatus.UNKNOWN and op.cause is stopline.Cause.TRANSPORT


async def test_record_in_doubt_is_not_applied_twice(backend: PostgresBackend) -> None:
    from tests.ledger.contract import COMMIT

    await backend.create_run(run_spec())
    await backend.gate(op_spec())
    with lose_reply_once(after_commit=True):
        op = await backend.record("run_a/1:send", COMMIT)
    assert op.status is OpStatus.COMMITTED
    kinds = [e.kind for e in await backend.events("run_a")]
    assert kinds.count("committed") == 1


# -- the schema ---------------------------------------------------------------------
async def test_newer_schema_is_refused(pg_url: str) -> None:
    opened = await PostgresBackend.open(pg_url)
    await opened.close()
    sql(pg_url, "UPDATE stopline_schema SET version = 99")
    with pytest.raises(SchemaTooNew):
        await PostgresBackend.open(pg_url)


async def test_foreign_tables_are_not_a_ledger(pg_url: str) -> None:
    base, _, schema = pg_url.partition("?schema=")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".other (x int)')
    with pytest.raises(LedgerCorrupt, match="not a stopline ledger"):
        await PostgresBackend.open(pg_url)


async def test_workers_starting_together_migrate_once(pg_url: str) -> None:
    opened: list[PostgresBackend] = []

    async def start() -> None:
        opened.append(await PostgresBackend.open(pg_url))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(start)
    for backend in opened:
        await backend.close()
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(SCHEMA_VERSION,)]


async def test_a_v5_ledger_gets_its_cancel_times_indexed_when_migrated(pg_url: str) -> None:
    """V6 indexes the runs by the time of their cancel (a listener's catch-up reads them
    through it): a ledger from before, its index gone and its version 5, gets it on its
    next read-write open, and the catch-up finds the run cancelled before."""
    backend = await PostgresBackend.open(pg_url)
    await backend.create_run(run_spec("kept"))
    await backend.create_run(run_spec("run_a"))
    await backend.cancel("run_a", by="u")
    await backend.close()
    sql(pg_url, "DROP INDEX runs_cancelled")
    sql(pg_url, "DROP INDEX runs_created")  # V7's
    sql(pg_url, "UPDATE stopline_schema SET version = 5")
    await (await PostgresBackend.open(pg_url)).close()
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(SCHEMA_VERSION,)] == [(7,)]
    (index,) = sql(
        pg_url,
        "SELECT indexdef FROM pg_indexes"
        " WHERE indexname = 'runs_cancelled' AND schemaname = current_schema()",
    )
    assert index[0].endswith("(cancelled_at) WHERE (cancelled_at IS NOT NULL)"), index
    assert sql(pg_url, CATCH_UP, 0.0) == [("run_a", "cancelling")]


async def test_a_v6_ledger_gets_its_runs_indexed_by_start_when_migrated(pg_url: str) -> None:
    """V7 indexes the runs by the time they started (a listing of every run, newest
    first, walks it): a ledger from before, its index gone and its version 6, gets it on
    its next read-write open, and the listing still reads newest first."""
    backend = await PostgresBackend.open(pg_url)
    for run_id in ("first", "second"):
        await backend.create_run(run_spec(run_id))
    await backend.close()
    sql(pg_url, "DROP INDEX runs_created")
    sql(pg_url, "UPDATE stopline_schema SET version = 6")
    backend = await PostgresBackend.open(pg_url)
    listed = [run.id for run in await backend.list_runs(limit=10)]
    await backend.close()
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(SCHEMA_VERSION,)] == [(7,)]
    (index,) = sql(
        pg_url,
        "SELECT indexdef FROM pg_indexes"
        " WHERE indexname = 'runs_created' AND schemaname = current_schema()",
    )
    assert index[0].endswith("USING btree (created_at)"), index
    assert listed == ["second", "first"]


async def _session(url: str, *names: str, read_only: bool = False) -> list[str]:
    """The settings ``names`` as a session of the ledger at ``url`` has them."""
    backend = await PostgresBackend.open(url, read_only=read_only)
    try:
        async with backend._pool.connection() as conn:
            return [(await (await conn.execute(f"SHOW {n}")).fetchall())[0][0] for n in names]
    finally:
        await backend.close()


async def test_a_ledgers_sessions_plan_without_jit_or_parallel_workers(pg_url: str) -> None:
    """Each statement reaches a few rows through an index; JIT or parallel workers come
    only of a misestimate on tables not analyzed, and cost more than the statement (a
    receipt's read of a small tree went parallel: 7 ms instead of 0.3). Off in every
    session of a ledger, read-write and read-only, beside its search path."""
    await (await PostgresBackend.open(pg_url)).close()  # the schema
    schema = pg_url.partition("?schema=")[2]
    for read_only in (False, True):
        shown = await _session(
            pg_url, "jit", "max_parallel_workers_per_gather", "search_path", read_only=read_only
        )
        assert shown == ["off", "0", schema]


async def test_a_urls_own_session_options_are_kept_beside_the_ledgers(pg_url: str) -> None:
    """libpq's ``options`` in the URL (a statement timeout, or JIT wanted back) are
    kept after the ledger's own: they were replaced whenever a schema was given."""
    url = f"{pg_url}&options=-c%20statement_timeout%3D4321%20-c%20jit%3Don"
    shown = await _session(url, "statement_timeout", "jit", "search_path")
    assert shown == ["4321ms", "on", pg_url.partition("?schema=")[2]]


async def test_bad_urls(pg_url: str) -> None:
    with pytest.raises(LedgerUnavailable, match="plain identifier"):
        await PostgresBackend.open(pg_url.partition("?")[0] + "?schema=x;drop")
    with pytest.raises(LedgerUnavailable):
        await PostgresBackend.open("postgresql://127.0.0.1:1/none?retry_for=0.2")
    for bad in ("-1", "60001", "soon"):  # the same rule as SQLite's: 0-60000 ms
        with pytest.raises(LedgerUnavailable, match="group_commit_ms"):
            await PostgresBackend.open(f"{pg_url}&group_commit_ms={bad}")
    # 'inf' raised a bare OverflowError; a negative one tried and timed out at once
    for bad in ("-1", "inf", "nan", "86401", "soon"):
        with pytest.raises(LedgerUnavailable, match=f"retry_for='{bad}' is not 0-86400 seconds"):
            await PostgresBackend.open(f"{pg_url}&retry_for={bad}")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        # libpq's own refusal, a bare psycopg.ProgrammingError before
        (
            "postgresql://127.0.0.1:1/none?turbo=1",
            'libpq refuses the URL: invalid URI query parameter: "turbo"',
        ),
        # urllib's, a bare ValueError
        ("postgresql://[::1/none", "not a valid URL: Invalid IPv6 URL"),
        # the last value was taken, or the default: a ledger opened in another schema
        ("postgresql://127.0.0.1:1/none?schema=a&schema=b", "schema is given twice"),
        ("postgresql://127.0.0.1:1/none?schema=", "schema is given without a value"),
        ("postgresql://127.0.0.1:1/none?retry_for", "retry_for is given without a value"),
        # libpq read the name up to the NUL: the database "test" for "test\0x"
        ("postgresql://127.0.0.1:1/test\x00x", "the URL holds a NUL character"),
    ],
)
async def test_a_url_that_cannot_be_read_as_given_is_refused_before_anything_connects(
    url: str, says: str
) -> None:
    """Each is refused by name; the server is unreachable, so a refusal that tried to
    connect would say so instead."""
    with pytest.raises(LedgerUnavailable, match=re.escape(says)):
        async with stopline.open(url):
            pass


def test_an_unreadable_urls_password_is_masked_in_its_refusal() -> None:
    """``redact`` raised the URL's own ``ValueError`` for a URL it could not split, so the
    message refusing it could not be made."""
    url = "postgresql://me:s3cret@[::1/none?password=s3cret"
    assert "s3cret" not in redact(url)
    assert redact(url).startswith("postgresql://me:***@[::1/none")


async def test_pool_sizes_are_checked_before_anything_connects() -> None:
    """``pool_min``/``pool_max`` are named when wrong (psycopg's ``min_size``/``max_size``
    were, through its own text); the URL's server is unreachable, so a refusal that tried
    to connect would say so instead."""
    nowhere = "postgresql://127.0.0.1:1/none?retry_for=0.2"
    for option, bad, says in [
        ("pool_min", "-1", "pool_min='-1' is not a whole number 0 or more"),
        ("pool_min", "abc", "pool_min='abc' is not a whole number 0 or more"),
        ("pool_max", "0", "pool_max='0' is not a whole number 1 or more"),
        ("pool_max", "1.5", "pool_max='1.5' is not a whole number 1 or more"),
    ]:
        with pytest.raises(LedgerUnavailable, match=re.escape(says)):
            await PostgresBackend.open(f"{nowhere}&{option}={bad}")
    with pytest.raises(LedgerUnavailable, match="pool_max=2 is below pool_min=5"):
        await PostgresBackend.open(f"{nowhere}&pool_min=5&pool_max=2")


async def test_a_pool_of_one_connection_serves_calls(pg_url: str) -> None:
    """The smallest pool the check allows (none kept open, one at most) is a working
    ledger: runs, gated calls and a cancel, with nothing waiting on a second connection."""
    async with stopline.open(f"{pg_url}&pool_min=0&pool_max=1") as ledger:
        done = []

        @stopline.tool
        async def effect(ctx: stopline.CallContext, n: int) -> int:
            return n

        async def one(n: int) -> None:
            async with ledger.run(f"r{n}", owner="t") as run:
                done.append(await run.call(effect, n))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(8):
                    tg.start_soon(one, n)
            async with ledger.run("cancelled", owner="t") as run:
                await ledger.cancel(run.id, by="t")
            receipt = await ledger.wait_settled(run.id)
        assert sorted(done) == list(range(8))
        assert receipt.run_state is RunState.CANCELLED


@contextlib.asynccontextmanager
async def slow_to_accept(url: str, delay: float) -> AsyncIterator[str]:
    """``url`` through a TCP proxy that waits ``delay`` s before it connects each new
    connection to the server (a loaded server, slow to accept); the URL to use."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    local = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def pump(
        a: anyio.abc.ByteStream, b: anyio.abc.ByteStream, done: anyio.CancelScope
    ) -> None:
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
        ):
            async for chunk in a:
                await b.send(chunk)
        done.cancel()  # one side ended: the other pump ends too

    async def handle(client: anyio.abc.SocketStream) -> None:
        async with client:
            await anyio.sleep(delay)
            async with (
                await anyio.connect_tcp(host, port) as upstream,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(pump, client, upstream, tg.cancel_scope)
                tg.start_soon(pump, upstream, client, tg.cancel_scope)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield urllib.parse.urlunsplit(parts._replace(netloc=f"127.0.0.1:{local}"))
        tg.cancel_scope.cancel()


async def test_a_short_retry_for_opens_on_a_server_slow_to_accept(pg_url: str) -> None:
    """``retry_for=0.5`` bounds retries, not a new connection: each new connection
    (the pool's first included, which an open waits for) gets libpq's shortest
    connect timeout, 2 s. Through a proxy that accepts each connection after 0.8 s the
    open succeeds and a transaction runs (it failed "pool initialization incomplete
    after 0.5 sec" before, seen in CI as a fault test's fixture error)."""
    async with slow_to_accept(pg_url, delay=0.8) as slow:
        backend = await PostgresBackend.open(slow + "&retry_for=0.5")
        try:
            assert backend.connect_timeout == 2
            await backend.create_run(run_spec())
            assert (await backend.get_run("run_a")).state is RunState.RUNNING
        finally:
            await backend.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_is_refused_with_a_reason(pg_url: str) -> None:
    with pytest.raises(LedgerUnavailable, match="asyncio"):
        await PostgresBackend.open(pg_url)


async def test_connection_killed_by_the_server_is_retried(backend: PostgresBackend) -> None:
    """An administrator (or a failover) ends the pooled connection and the group commit's
    own: the next calls reconnect."""
    await backend.create_run(run_spec())
    await backend.gate(op_spec("run_a/0:send"))  # the group commit's connection, opened

    async def pid(tx: Tx) -> int:
        return int((await tx.one("SELECT pg_backend_pid()"))[0])

    victim = await backend._tx(pid, safe=True)
    reserved = backend.group.reserved.pid
    assert reserved is not None and reserved != victim
    for killed in (victim, reserved):
        terminate(backend.conninfo, killed)
    assert (await backend.gate(op_spec())).verdict is GateVerdict.PASSED  # settled, then passed
    assert backend.group.reserved.pid not in (None, reserved)
    assert (await backend.get_run("run_a")).state is stopline.RunState.RUNNING
    assert await backend._tx(pid, safe=True) != victim
    kinds = [e.kind for e in await backend.events("run_a")]
    assert kinds.count("gate_passed") == 2


class Heard:
    """A listener's ``on_cancel``: what it delivered, and an event set once ``until`` run
    ids have come (the first delivery, by default)."""

    def __init__(self, until: int = 1) -> None:
        self.seen: list[list[str]] = []
        self.arrived = anyio.Event()
        self._until = until

    def __call__(self, run_ids: list[str]) -> None:
        self.seen.append(run_ids)
        if sum(len(batch) for batch in self.seen) >= self._until:
            self.arrived.set()


def round_trips(trace: Path) -> int:
    """The round trips in a libpq protocol trace: each ends with the client's ``Sync``."""
    return sum(
        1 for line in trace.read_text().splitlines() if line.split("\t")[1:4:2] == ["F", "Sync"]
    )


def statements(trace: Path) -> int:
    """The statements a libpq protocol trace sent (``BEGIN`` and ``COMMIT`` among them):
    each is one ``Execute`` from the client."""
    return sum(
        1 for line in trace.read_text().splitlines() if line.split("\t")[1:4:2] == ["F", "Execute"]
    )


async def traced(
    backend: PostgresBackend, trace: Path, act: Callable[[], Awaitable[T]]
) -> tuple[T, int]:
    """``act()``'s result and its round trips on the pool's one connection, from a libpq
    protocol trace written to ``trace``."""
    with trace.open("w") as out:
        async with backend._pool.connection() as conn:  # the pool's one connection
            conn.pgconn.trace(out.fileno())
        try:
            result = await act()
        finally:
            async with backend._pool.connection() as conn:
                conn.pgconn.untrace()
    return result, round_trips(trace)


async def test_a_cancel_is_one_round_trip_and_a_trees_one_more_per_level(
    pg_url: str, tmp_path: Path
) -> None:
    """The cancel's statements go as batches (pipeline mode): a leaf's lock,
    notification and fence (its approvals, its event and its row in one statement) in
    one round trip, committed by it; a tree's root, found with
    children there, is cancelled again whole: its lock, links and fence in one, one
    per level read, one for the rest of its fence, and the commit. Counted from the
    protocol trace, not timed."""
    backend = await PostgresBackend.open(pg_url + "&pool_min=1&pool_max=1")
    try:
        for run_id, parent in (("leaf", None), ("root", None), ("child", "root")):
            await backend.create_run(run_spec(run_id, parent_id=parent))
        counts = {}
        for run_id in ("leaf", "root"):
            result, counts[run_id] = await traced(
                backend,
                tmp_path / f"{run_id}.trace",
                functools.partial(backend.cancel, run_id, by="u"),
            )
            assert result.first
        assert counts == {"leaf": 1, "root": 5}  # root: the leaf's try, then 4 as a tree
        # a leaf's: its lock, its notification and its fence (one statement), no BEGIN
        # or COMMIT (the pipeline's Sync commits them)
        assert statements(tmp_path / "leaf.trace") == 3
        assert result.fenced == ("root", "child")
        for run_id in ("leaf", "root", "child"):
            assert (await backend.get_run(run_id)).state is RunState.CANCELLING
            assert [e.kind for e in await backend.events(run_id)].count("cancel") == 1
    finally:
        await backend.close()


async def test_a_run_is_created_moved_phased_and_noted_in_one_round_trip(
    pg_url: str, tmp_path: Path
) -> None:
    """A run's creation is one statement: its row and its event (a child's also locks
    and reads its parent, and writes its link); a move sends the run's lock and read,
    its event and the move (each matching only a state the run table moves), and the
    ``COMMIT`` together; a phase entered, or a note on an operation, the lock and read,
    the change and its event and the ``COMMIT``. Counted from the protocol trace."""
    backend = await PostgresBackend.open(pg_url + "&pool_min=1&pool_max=1")
    try:
        parent, created = await traced(
            backend, tmp_path / "parent.trace", lambda: backend.create_run(run_spec("p"))
        )
        child, with_parent = await traced(
            backend,
            tmp_path / "child.trace",
            lambda: backend.create_run(run_spec("c", parent_id="p")),
        )
        assert parent == await backend.get_run("p") and child == await backend.get_run("c")
        phased, phase = await traced(
            backend,
            tmp_path / "phase.trace",
            lambda: backend.set_phase("c", PhaseKind.READING, Policy.IMMEDIATE),
        )
        assert phased == await backend.get_run("c")  # as read, with what the change wrote
        assert (await backend.gate(op_spec("c/1:send", run_id="c"))).verdict is GateVerdict.PASSED
        noted, note = await traced(
            backend,
            tmp_path / "note.trace",
            lambda: backend.note("c/1:send", "cancel_asked", {}, cancel_state="asked"),
        )
        assert noted == await backend.get_operation("c/1:send")
        (moved, _), move = await traced(
            backend,
            tmp_path / "move.trace",
            lambda: backend.run_event("c", RunEvent.COMPLETE, by="u"),
        )
        assert (created, with_parent, phase, note, move) == (1, 1, 1, 1, 1)
        # a run (with its parent locked and read, its link), or a move: one statement
        # that commits by itself
        names = ("parent", "child", "move")
        sent = {name: statements(tmp_path / f"{name}.trace") for name in names}
        assert sent == {"parent": 1, "child": 1, "move": 1}
        assert moved == await backend.get_run("c")  # as read, with what the move wrote
        assert moved.state is not RunState.RUNNING
        kinds = [e.kind for e in await backend.events("c")]
        assert kinds == ["run_created", "phase", "gate_passed", "cancel_asked", "complete"]
    finally:
        await backend.close()


async def notified(
    pg_url: str,
    heard: Heard,
    act: Callable[[PostgresBackend, PostgresBackend], Awaitable[T]],
) -> T:
    """``act(listener, canceller)`` on two backends of one schema while the first
    listens for cancels; its result once ``heard`` has heard what it waits for."""
    listener = await PostgresBackend.open(pg_url)
    canceller = await PostgresBackend.open(pg_url)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(listener.watch_cancels, heard)
            result = await act(listener, canceller)
            with anyio.fail_after(10):
                await heard.arrived.wait()
            tg.cancel_scope.cancel()
    finally:
        await listener.close()
        await canceller.close()
    return result


async def test_a_child_created_while_its_parents_fence_is_uncommitted_is_born_fenced(
    backend: PostgresBackend, pg_url: str
) -> None:
    """A child's creation is one statement that locks its parent ``FOR SHARE``. Another
    transaction holds the parent, fenced and not yet committed (a cancel's lock and
    fence): the creation waits for it, then reads the parent as the fence left it (the
    lock returns the row's newest version, not the statement's snapshot) and the child
    is born fenced. Without the lock it would be born running beside a fenced parent."""
    await backend.create_run(run_spec("p"))
    base, _, schema = pg_url.partition("?schema=")
    initiate = int(stopline.Grant.INITIATE)
    async with await psycopg.AsyncConnection.connect(
        base, options=f"-c search_path={schema}"
    ) as holder:  # not autocommit: the fence stays uncommitted until it commits
        await holder.execute(
            "UPDATE runs SET state = 'cancelling', fence = fence + 1,"
            " grants = grants & ~%s::int WHERE id = 'p'",
            (initiate,),
        )
        holding = holder.info.backend_pid
        born: list[stopline.RunRecord] = []
        async with anyio.create_task_group() as tg:

            async def create() -> None:
                born.append(await backend.create_run(run_spec("c", parent_id="p")))

            tg.start_soon(create)
            blocked = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
            async with await psycopg.AsyncConnection.connect(base, autocommit=True) as watcher:
                while not born:  # until the creation waits on the holder's lock
                    row = await (await watcher.execute(blocked, (holding,))).fetchone()
                    if row is not None and row[0]:
                        break
            await holder.commit()
    (child,) = born
    assert child.state is RunState.CANCELLING
    assert not child.grants & stopline.Grant.INITIATE
    assert child == await backend.get_run("c")
    gate = await backend.gate(op_spec("c/1:send", run_id="c"))
    assert gate.verdict is GateVerdict.PREVENTED


async def test_cancels_are_notified_and_junk_is_ignored(pg_url: str) -> None:
    """The LISTEN side in one process: a cancel from another backend arrives as run ids."""
    heard = Heard()

    async def act(listener: PostgresBackend, canceller: PostgresBackend) -> None:
        sql(pg_url, "SELECT pg_notify(%s, 'not json')", listener.dialect.channel)
        await canceller.create_run(run_spec("root"))
        await canceller.create_run(run_spec("child", parent_id="root"))
        await canceller.cancel("root", by="u")

    await notified(pg_url, heard, act)
    assert heard.seen == [["root", "child"]]


async def resumed_and_left(ledger: stopline.Ledger) -> PostgresBackend:
    """Two runs of ``ledger`` cancelled and settled: ``resumed`` since resumed, ``left``
    still fenced; the ledger's backend."""
    for run_id in ("resumed", "left"):
        async with ledger.run("job", owner="u", run_id=run_id):
            await ledger.cancel(run_id, by="u")  # the block ends here, fenced
        await ledger.wait_settled(run_id, timeout=10)
    await ledger.resume("resumed", by="u")
    backend = ledger.backend
    assert isinstance(backend, PostgresBackend)
    return backend


async def test_a_notification_read_after_its_run_was_resumed_is_not_delivered(
    pg_url: str,
) -> None:
    """A cancel's notification handled late (the loop busy, the listener behind): its
    run was resumed meanwhile and must not be cancelled again in this process. The run
    still fenced is delivered; the resumed one is dropped."""
    seen: list[list[str]] = []
    async with stopline.open(pg_url) as ledger:
        backend = await resumed_and_left(ledger)
        await backend.listener.deliver('["resumed", "left"]', seen.append)
        await backend.listener.deliver('["resumed"]', seen.append)  # nothing fenced: no call
    assert seen == [["left"]]


async def test_a_notification_whose_check_cannot_be_read_is_delivered(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The check of which runs are still fenced fails (here the pool is gone): the
    notification is delivered whole, as before the check, and the failure logged; a
    cancel only speeds up, and interrupting is the safe side."""
    seen: list[list[str]] = []
    backend = await PostgresBackend.open(pg_url)
    await backend.close()
    await backend.listener.deliver('["run_x"]', seen.append)
    assert seen == [["run_x"]]
    assert any("could not check" in r.getMessage() for r in caplog.records)


async def test_a_closed_backend_refuses_at_once_instead_of_retrying(pg_url: str) -> None:
    """A pool the backend's close closed never opens again, but its ``PoolClosed`` was
    taken for a lost connection and retried for the whole retry window (10 s: the
    listener's check above waited it out after a close); here the window is ten minutes,
    so a retry is a hang. Now refused at once, typed, naming the closed pool."""
    backend = await PostgresBackend.open(pg_url)
    await backend.close()
    backend.retry_for = 600.0
    with anyio.fail_after(60):  # a guard against the hang, not a timing
        with pytest.raises(LedgerUnavailable, match="closed"):
            await backend.get_run("run_x")
        with pytest.raises(LedgerUnavailable, match="closed"):
            await backend.fenced_among(["run_x"])


async def test_the_fenced_check_goes_over_the_listen_connection(pg_url: str) -> None:
    """The listener checks which runs are still fenced over its own connection, not
    through the pool (no checkout, no queue behind the process's own calls): with the
    pool gone, a notification for a run resumed since its cancel is still dropped."""
    async with stopline.open(pg_url) as ledger:
        await resumed_and_left(ledger)
    heard = Heard()

    async def act(listener: PostgresBackend, canceller: PostgresBackend) -> None:
        await listener.pool.close()  # a check through the pool would fail now
        sql(pg_url, "SELECT pg_notify(%s, %s)", listener.dialect.channel, '["resumed", "left"]')

    await notified(pg_url, heard, act)
    assert heard.seen == [["left"]]


async def test_a_cancel_too_large_for_one_notification_is_notified_in_several(
    pg_url: str,
) -> None:
    """Ids may be 1,024 characters and a notification's payload must stay under 8,000
    bytes: a tree of such runs is notified in payloads cut by size, all of them sent
    with the cancel's commit (before, 100 ids per payload: the server refused the
    NOTIFY, and with it the cancel)."""
    ids = [f"{i}" + "r" * 1000 for i in range(9)]
    heard = Heard(until=len(ids))

    async def act(listener: PostgresBackend, canceller: PostgresBackend) -> CancelResult:
        await canceller.create_run(run_spec(ids[0]))
        for child in ids[1:]:
            await canceller.create_run(run_spec(child, parent_id=ids[0]))
        return await canceller.cancel(ids[0], by="u")

    result = await notified(pg_url, heard, act)
    assert result.first and set(result.fenced) == set(ids)
    assert len(heard.seen) == 2 and sorted(r for batch in heard.seen for r in batch) == sorted(ids)


async def test_one_value_or_many_the_same_runs_and_a_batch_tells_rows_from_none(
    backend: PostgresBackend,
) -> None:
    """``in_list`` of one value is ``column = ?`` (no array to build; most cancels name
    one run), of many ``= ANY(?)``: each selects what ``IN`` would. ``Tx.batch`` gives
    a statement that returns no rows (an ``UPDATE``) ``[]``, one that returns rows (a
    ``SELECT`` finding none too) its rows."""
    for run_id in ("run_a", "run_b", "run_c"):
        await backend.create_run(run_spec(run_id))
    dialect = backend.dialect
    one, one_params = dialect.in_list("id", ["run_b"])
    many, many_params = dialect.in_list("id", ["run_c", "run_a", "nobody"])
    assert (one, one_params) == ("id = ?", ["run_b"])
    assert many == "id = ANY(?)"
    async with backend._pool.connection() as conn:
        tx = Tx(conn, backend.location, dialect)
        async with tx.transaction():
            found = await tx.batch(
                [
                    (f"SELECT id FROM runs WHERE {one}", one_params),
                    (f"SELECT id FROM runs WHERE {many} ORDER BY id", many_params),
                    ("UPDATE runs SET updated_at = updated_at WHERE id = ?", ["run_a"]),
                    ("SELECT id FROM runs WHERE id = ?", ["nobody"]),
                ],
                commit=True,
            )
    assert found == [[("run_b",)], [("run_a",), ("run_c",)], [], []]


async def test_a_run_and_its_operations_are_read_from_one_snapshot_in_one_round_trip(
    pg_url: str, tmp_path: Path
) -> None:
    """At READ COMMITTED each statement of a transaction sees its own snapshot: a write
    committed between a run's read and its operations' would be in the second only (a
    receipt, a settling step, from two moments). A snapshot read is REPEATABLE READ,
    READ ONLY: such a write is in neither read. ``run_and_operations`` is one: its
    ``BEGIN``, both reads and ``COMMIT`` in one round trip (counted from the trace)."""
    backend = await PostgresBackend.open(pg_url + "&pool_min=1&pool_max=1")
    try:
        await backend.create_run(run_spec())
        assert (await backend.gate(op_spec())).verdict is GateVerdict.PASSED
        status = "SELECT status FROM operations WHERE id = 'run_a/1:send'"
        async with backend._pool.connection() as conn:
            tx = Tx(conn, backend.location, backend.dialect)
            async with tx.transaction(snapshot=True):
                before = await tx.all(status)
                sql(pg_url, "UPDATE operations SET status = 'committed'")  # another's write
                after = await tx.all(status)
        assert before == after == [("requested",)]
        trace = tmp_path / "read.trace"
        (run, ops), trips = await traced(
            backend, trace, functools.partial(backend.run_and_operations, "run_a")
        )
        assert trips == 1
        assert "REPEATABLE READ, READ ONLY" in trace.read_text()
        assert run.id == "run_a"
        assert [op.status for op in ops] == [OpStatus.COMMITTED]  # the write landed
        (first, nobody), trips = await traced(
            backend,
            tmp_path / "many.trace",
            functools.partial(backend.runs_and_operations, ["run_a", "nobody"]),
        )
        assert trips == 1
        assert isinstance(nobody, UnknownRun)
        assert not isinstance(first, UnknownRun)
        assert [op.status for op in first[1]] == [OpStatus.COMMITTED]
    finally:
        await backend.close()


async def test_a_listed_page_and_its_trees_are_read_from_one_snapshot(
    pg_url: str, tmp_path: Path
) -> None:
    """``list_trees`` (the console's page): the listing and each run's tree and
    operations in one REPEATABLE READ snapshot. Another session's write committed
    after the listing and before the trees are read is in neither (read apart, the
    page showed the run's row before it and its receipt after it); the next page has
    it. Two round trips: the listing, then the trees with the commit."""
    backend = await PostgresBackend.open(pg_url + "&pool_min=1&pool_max=1")
    try:
        await backend.create_run(run_spec())
        assert (await backend.gate(op_spec())).verdict is GateVerdict.PASSED
        real = reads._trees_of

        async def after_another_write(db: Any, run_ids: Sequence[str], known: Any) -> Any:
            sql(pg_url, "UPDATE operations SET status = 'committed'")  # another session's
            sql(pg_url, "UPDATE runs SET state = 'completed'")
            return await real(db, run_ids, known)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reads, "_trees_of", after_another_write)
            [(run, ops)], trips = await traced(backend, tmp_path / "page.trace", backend.list_trees)
        assert (run.id, run.state) == ("run_a", RunState.RUNNING)
        assert [op.status for op in ops] == [OpStatus.REQUESTED]
        assert trips == 2
        assert "REPEATABLE READ, READ ONLY" in (tmp_path / "page.trace").read_text()
        [(run, ops)] = await backend.list_trees()
        assert (run.state, [op.status for op in ops]) == (RunState.COMPLETED, [OpStatus.COMMITTED])
    finally:
        await backend.close()


async def test_a_backends_own_cancel_is_not_handed_back_by_its_listener(pg_url: str) -> None:
    """A cancel's notification comes back to the backend that committed it; its caller
    has the fenced runs already (the runtime delivers them itself), so the listener
    neither reads nor hands them on. A cancel by another backend, notified after it
    (in commit order), is delivered as always; and once taken, a later notification
    of the same run from the same server process is delivered too."""
    heard = Heard()

    async def act(listener: PostgresBackend, canceller: PostgresBackend) -> None:
        for run_id, parent in (("mine", None), ("tree", None), ("leaf", "tree"), ("theirs", None)):
            await listener.create_run(run_spec(run_id, parent_id=parent))
        checks: list[Sequence[str]] = []
        real = reads.fenced_among

        async def counted(db: Any, run_ids: Sequence[str]) -> list[str]:
            checks.append(list(run_ids))
            return await real(db, run_ids)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reads, "fenced_among", counted)
            assert (await listener.cancel("mine", by="u")).fenced == ("mine",)
            assert (await listener.cancel("tree", by="u")).fenced == ("tree", "leaf")
            await canceller.cancel("theirs", by="u")  # notified after the two above
            with anyio.fail_after(10):
                await heard.arrived.wait()
        assert checks == [["theirs"]]  # the own ones were not even read

    await notified(pg_url, heard, act)
    assert heard.seen == [["theirs"]]


def test_own_cancels_are_taken_once_per_server_process_and_expire() -> None:
    own = OwnCancels(hold=60)
    own.add(["a", "b"], pid=7)
    assert own.others(["a", "b", "c"], pid=8) == ["a", "b", "c"]  # another process's
    assert own.others(["a", "c"], pid=7) == ["c"]
    assert own.others(["a", "b"], pid=7) == ["a"]  # a taken: a later cancel of it counts
    expired = OwnCancels(hold=0)
    expired.add(["a"], pid=7)
    assert expired.others(["a"], pid=7) == ["a"]
    many = OwnCancels(hold=60)
    many.add([f"r{i}" for i in range(OwnCancels.LIMIT + 10)], pid=1)
    assert many.others(["r0", f"r{OwnCancels.LIMIT + 9}"], pid=1) == ["r0"]  # oldest gone


async def test_an_own_cancel_whose_reply_was_lost_is_handed_back_by_the_listener(
    pg_url: str,
) -> None:
    """The cancel committed but its reply was lost: the retry finds the run fenced and
    returns nothing fenced, so the runtime delivers nothing itself. Nothing was kept as
    this backend's own, and the notification is handed on: it is how the cancel
    reaches this process's calls."""
    heard = Heard()

    async def act(listener: PostgresBackend, canceller: PostgresBackend) -> None:
        await listener.create_run(run_spec("lost"))
        real = fence.cancel
        lost = {"armed": True}

        async def reply_lost(tx: Tx, run_id: str, by: str, reason: str) -> CancelResult:
            result = await real(tx, run_id, by, reason)  # committed
            if lost.pop("armed", False):
                tx.in_doubt = True
                raise psycopg.OperationalError("simulated: server closed the connection")
            return result

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fence, "cancel", reply_lost)
            retried = await listener.cancel("lost", by="u")
        assert retried.fenced == ()  # the retry found it fenced: the first cancel won

    await notified(pg_url, heard, act)
    assert heard.seen == [["lost"]]


def _log_event(conn: psycopg.Connection[Any], run_id: str) -> None:
    conn.execute(
        "INSERT INTO events (at, run_id, kind, data) VALUES (%s, %s, 'test', '{}')",
        (time.time(), run_id),
    )


async def test_the_change_mark_sees_a_late_commit_and_no_other_databases(pg_url: str) -> None:
    """``change_mark`` (what ``wait_settled`` compares before reading a receipt again):
    a transaction that took a lower log number and commits after a higher one was read
    moves it; another database's commit, and another ledger's in the same database,
    do not (the server's WAL position, the mark before, moved with both)."""
    base, _, schema = pg_url.partition("?schema=")
    opened = await PostgresBackend.open(pg_url)
    try:
        await opened.create_run(run_spec())
        path = f"-c search_path={schema}"
        with (
            psycopg.connect(base, options=path) as early,
            psycopg.connect(base, options=path) as later,
        ):
            _log_event(early, "run_a")  # takes its number, not committed yet
            _log_event(later, "run_a")  # a higher number
            later.commit()
            read = await opened.change_mark()
            early.commit()  # the lower number lands after the higher was read
        assert await opened.change_mark() != read

        quiet = await opened.change_mark()
        with psycopg.connect(base.rsplit("/", 1)[0] + "/postgres", autocommit=True) as other:
            other.execute("CREATE TEMP TABLE elsewhere (x int)")
            other.execute("INSERT INTO elsewhere VALUES (1)")
        for other_ledger in fresh_schema():
            neighbour = await PostgresBackend.open(other_ledger)
            try:
                await neighbour.create_run(run_spec())
            finally:
                await neighbour.close()
        assert await opened.change_mark() == quiet
    finally:
        await opened.close()
