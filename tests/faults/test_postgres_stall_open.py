"""A PostgreSQL server that stops answering while a ledger opens, or under its LISTEN
connection (ADR 0064; ADR 0061 for a transaction's).

Opening waited for ever on a session whose statement was never answered (the server
frozen or its packets dropped after the TCP connect): ``connect_timeout`` bounded the
connection, not the migration. Now, each ``answer_wait`` without an answer, a new
session asks the server whether the open's session is at work (running its statement,
or waiting for a session at work); if not, it is ended (its transaction rolled back:
nothing half-migrated) and the open fails typed. A migration at work, or one waiting
for a peer at work, is still waited for.

A LISTEN connection that stopped answering delivered no cross-process cancel again:
no TCP keepalive notices a socket whose peer's kernel still answers, so it was never
dropped and no catch-up ran. Now a silent one is asked to answer; unanswered, it is
dropped, the next one catches up, and the session left behind is ended.

The relay (``tests.postgres.proxy``) holds a connection's bytes without closing it, as
such a server or network does.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import psycopg
import psycopg.errors
import pytest

import stopline
from stopline.errors import LedgerLocked, LedgerUnavailable
from stopline.ledger import postgres
from stopline.ledger.postgres import PostgresBackend
from stopline.ledger.postgres_listen import Listener
from stopline.ledger.schema import MIGRATIONS, SCHEMA_VERSION
from tests.postgres.proxy import Hold, Relay, relayed
from tests.postgres.server import server_url
from tests.support.held import Held

pytestmark = pytest.mark.timeout(60)  # a guard against the hang itself, not a timing

ANSWER_WAIT = 1.0  # seconds (the default: 5 at least); ``retry_for=1`` in the URLs
GUARD = 30  # seconds: a hang guard, not a timing


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``answer_wait`` of the backends opened in the test: ``ANSWER_WAIT``."""
    monkeypatch.setattr(postgres, "ANSWER_FLOOR", ANSWER_WAIT)


@pytest.fixture
async def relay_url(pg_url: str) -> AsyncIterator[tuple[Relay, str]]:
    async with relayed(pg_url + "&retry_for=1") as pair:
        yield pair


class AtWork(logging.Handler):
    """Set once an open's watch found its session at work (and waited another round):
    ``pid``, that session."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = anyio.Event()
        self.pid = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "at work" in record.getMessage():
            assert isinstance(record.args, tuple) and isinstance(record.args[1], int)
            self.pid = record.args[1]
            self.seen.set()


@pytest.fixture
def at_work() -> Iterator[AtWork]:
    handler = AtWork()
    logger = logging.getLogger("stopline.ledger.postgres")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)


def schema_of(url: str) -> str:
    return url.split("schema=")[1].split("&")[0]


async def direct(url: str, *, autocommit: bool = True) -> psycopg.AsyncConnection[Any]:
    """A session on the server, around the relay, in ``url``'s schema."""
    conn = await psycopg.AsyncConnection.connect(server_url(), autocommit=autocommit)
    await conn.execute(f'SET search_path = "{schema_of(url)}"')
    return conn


async def one(url: str, sql: str) -> Any:
    async with await direct(url) as conn:
        row = await (await conn.execute(sql.encode())).fetchone()
        return None if row is None else row[0]


async def sleeping(conn: psycopg.AsyncConnection[Any], done: anyio.Event) -> None:
    """``conn`` at work (a statement running) until ``pg_cancel_backend`` stops it."""
    try:
        await conn.execute("SELECT pg_sleep(600)")
    except psycopg.errors.QueryCanceled:
        pass
    finally:
        done.set()


@pytest.mark.parametrize("hold", ["connect", "ready"])
async def test_an_open_whose_server_stops_answering_fails_typed_and_creates_nothing(
    pg_url: str, relay_url: tuple[Relay, str], short_waits: None, hold: Hold
) -> None:
    """The server stops answering every new session, at its start (``connect``) or once
    it is ready for its first statement (``ready``): opening a new ledger raises
    ``LedgerUnavailable`` instead of waiting for ever, and once the held bytes reach the
    server nothing of the ledger is there."""
    relay, url = relay_url
    relay.hold_new = hold
    with anyio.fail_after(GUARD), pytest.raises(LedgerUnavailable) as raised:
        async with stopline.open(url):
            pass
    message = str(raised.value)
    assert "timeout expired" in message or "no answer" in message
    # a connect psycopg timed out keeps its socket open while its error lives: closed
    del raised
    gc.collect()
    relay.hold_new = None
    relay.thaw()  # what was held reaches the server now
    with anyio.fail_after(GUARD):
        await relay.drained()
    schema = schema_of(pg_url)
    assert await one(pg_url, f"SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}'") == 0


async def test_an_open_whose_session_stops_answering_mid_migration_is_ended_and_rolled_back(
    pg_url: str, relay_url: tuple[Relay, str], short_waits: None, at_work: AtWork
) -> None:
    """A ledger one version behind. Its migration has built its index and waits to
    record the new version (a row a session at work holds: waited for, the server
    vouching for it) when its connection stops answering; the row is released, the
    server answers, and the answer is held. The open fails ``LedgerUnavailable``; its
    session was ended, so the migration rolled back whole: the ledger is at its old
    version, and the next open (nothing left holding its locks) migrates it."""
    relay, url = relay_url
    async with stopline.open(pg_url):
        pass
    assert MIGRATIONS[-1] == "CREATE INDEX runs_created ON runs(created_at)"  # undone here
    async with await direct(pg_url) as conn:
        await conn.execute("DROP INDEX runs_created")
        await conn.execute("UPDATE stopline_schema SET version = %s", (SCHEMA_VERSION - 1,))
    holder = await direct(pg_url, autocommit=False)
    released = anyio.Event()
    failed: list[BaseException] = []

    async def open_ledger() -> None:
        try:
            async with stopline.open(url):
                pass
        except LedgerUnavailable as exc:
            failed.append(exc)

    try:
        await holder.execute("LOCK TABLE stopline_schema IN EXCLUSIVE MODE")
        with anyio.fail_after(GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sleeping, holder, released)
                tg.start_soon(open_ledger)
                await at_work.seen.wait()  # the migration waits for the row, vouched for
                relay.freeze(pid=at_work.pid)
                async with await direct(pg_url) as conn:
                    await conn.execute("SELECT pg_cancel_backend(%s)", (holder.info.backend_pid,))
                await released.wait()
                await holder.rollback()  # the row released: the answer is held
    finally:
        await holder.close()
    (error,) = failed
    assert "no answer" in str(error) and "idle in transaction; ended" in str(error)
    assert await one(pg_url, "SELECT version FROM stopline_schema") == SCHEMA_VERSION - 1
    assert await one(pg_url, "SELECT to_regclass('runs_created') IS NULL") is True
    with anyio.fail_after(GUARD):
        async with stopline.open(pg_url + "&retry_for=1"):
            pass
    assert await one(pg_url, "SELECT version FROM stopline_schema") == SCHEMA_VERSION


async def test_an_open_waiting_for_a_peer_that_stopped_mid_migration_fails_locked(
    pg_url: str, short_waits: None
) -> None:
    """A peer holds the ledger's migration lock and does nothing (its client gone, its
    session idle): the open fails ``LedgerLocked`` naming that session, instead of
    waiting for ever, and leaves nothing waiting behind it."""
    holder = await direct(pg_url)
    try:
        key = f"stopline:{schema_of(pg_url)}"
        await holder.execute("SELECT pg_advisory_lock(hashtext(%s))", (key,))
        with anyio.fail_after(GUARD), pytest.raises(LedgerLocked) as raised:
            async with stopline.open(pg_url + "&retry_for=1"):
                pass
        assert f"session {holder.info.backend_pid} (idle)" in str(raised.value)
        behind = f"SELECT count(*) FROM pg_stat_activity WHERE {holder.info.backend_pid}"
        assert await one(pg_url, behind + " = ANY(pg_blocking_pids(pid))") == 0
    finally:
        await holder.close()
    with anyio.fail_after(GUARD):
        async with stopline.open(pg_url + "&retry_for=1"):
            pass


async def test_an_open_waiting_for_a_peer_at_work_waits(
    pg_url: str, short_waits: None, at_work: AtWork
) -> None:
    """A peer migrating (its session at work, holding the migration lock) for longer
    than ``answer_wait``: the open waits for it, the server vouching for both, and
    opens once the peer is done."""
    holder = await direct(pg_url, autocommit=False)
    released = anyio.Event()
    opened: list[bool] = []

    async def open_ledger() -> None:
        async with stopline.open(pg_url + "&retry_for=1"):
            opened.append(True)

    try:
        key = f"stopline:{schema_of(pg_url)}"
        await holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
        with anyio.fail_after(GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sleeping, holder, released)
                tg.start_soon(open_ledger)
                await at_work.seen.wait()  # a whole answer_wait waited, and going on
                async with await direct(pg_url) as conn:
                    await conn.execute("SELECT pg_cancel_backend(%s)", (holder.info.backend_pid,))
                await released.wait()
                await holder.rollback()  # the peer done
    finally:
        await holder.close()
    assert opened == [True]
    assert await one(pg_url, "SELECT version FROM stopline_schema") == SCHEMA_VERSION


async def test_a_listener_whose_server_stops_answering_at_its_start_fails_typed(
    relay_url: tuple[Relay, str], short_waits: None
) -> None:
    """The LISTEN statement is never answered: the listener's start raises
    ``LedgerUnavailable`` (an open fails with it) instead of waiting for ever."""
    relay, url = relay_url
    backend = await PostgresBackend.open(url)
    try:
        relay.hold_new = "ready"
        with anyio.fail_after(GUARD), pytest.raises(LedgerUnavailable, match="no answer"):
            await Listener(backend).run(lambda run_ids: None)
    finally:
        relay.hold_new = None
        relay.thaw()
        await backend.close()


async def test_a_cancel_from_another_process_reaches_a_worker_whose_listen_connection_froze(
    pg_url: str, relay_url: tuple[Relay, str], short_waits: None
) -> None:
    """The worker's LISTEN connection stops answering (both sockets open), then another
    process cancels the worker's run, whose call waits in its tool: the silent
    connection is asked to answer, dropped, and the next one catches the cancel up; the
    call is interrupted. The session left behind is ended."""
    relay, url = relay_url
    canceller = await PostgresBackend.open(pg_url)
    try:
        async with stopline.open(url) as ledger, anyio.create_task_group() as tg:
            backend = ledger.backend
            assert isinstance(backend, PostgresBackend)
            listener = backend.listener
            frozen = listener.pid
            assert frozen is not None and listener.connections == 1
            held = Held(ledger, "victim")
            tg.start_soon(held.workflow)
            await held.entered.wait()
            relay.freeze(pid=frozen)
            await canceller.cancel("victim", by="u")
            with anyio.fail_after(GUARD):
                await held.interrupted.wait()
            assert listener.connections == 2 and listener.pid != frozen
            there = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {frozen}"
            with anyio.fail_after(GUARD):  # ended: its process exits a moment after
                while await one(pg_url, there):  # noqa: ASYNC110 (the server's, no event)
                    await anyio.sleep(0.05)
            receipt = await ledger.wait_settled("victim", timeout=GUARD)
        assert receipt.settled
        (line,) = receipt.lines
        assert "user_cancel" in [e.ref for e in line.evidence]
    finally:
        await canceller.close()


async def test_a_pool_whose_new_sessions_stalled_recovers_once_they_are_answered(
    relay_url: tuple[Relay, str], short_waits: None
) -> None:
    """The server answers none of the sessions open and starts no new one (each held at
    its start, both sockets open): reads fail typed. Once new sessions are answered
    again (those held stay held, as a network that lost them), reads go through: the
    pool's connects held meanwhile gave up at ``connect_timeout``. They waited for ever,
    and the pool, counting them among its connections, never made another."""
    relay, url = relay_url
    async with stopline.open(url + "&pool_min=1&pool_max=2") as ledger:
        async with ledger.run("a", owner="u", run_id="a"):
            pass
        relay.hold_new = "connect"
        relay.freeze()
        for _ in range(3):  # the pool's connections dropped, and more asked for
            with anyio.fail_after(GUARD), pytest.raises(LedgerUnavailable):
                await ledger.receipt("a")
        relay.hold_new = None
        with anyio.fail_after(GUARD):
            while True:
                try:
                    receipt = await ledger.receipt("a")
                    break
                except LedgerUnavailable:  # a connection held before, until it gives up
                    await anyio.lowlevel.checkpoint()  # the guard's way in (reads are shielded)
        assert receipt.run_id == "a"
