"""Schema V5 (ADR 0041): a PostgreSQL ledger's cancels are notified on a random channel
kept in the ledger, so a notification that looks like a cancel takes a read of the
ledger to send. The name it had (derived from the schema) is heard no more, and the
listener's own statement never shows the name."""

from __future__ import annotations

import contextlib
import re
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence

import anyio
import psycopg
import pytest

import stopline
from stopline.errors import LedgerUnavailable, SchemaTooOld
from stopline.ledger.postgres import PostgresBackend
from stopline.ledger.schema import SCHEMA_VERSION
from tests.ledger.contract import run_spec
from tests.postgres.server import fresh_schema
from tests.postgres.test_backend import sql
from tests.support.held import Held

pytestmark = pytest.mark.timeout(30)

_RANDOM = re.compile(r"stopline_cancel_[0-9a-f]{32}")


@pytest.fixture
def other_url() -> Iterator[str]:
    yield from fresh_schema()


async def channel_of(url: str) -> str:
    """The channel a read-write open of the ledger notifies its cancels on."""
    backend = await PostgresBackend.open(url)
    try:
        assert backend.dialect.channel is not None
        return backend.dialect.channel
    finally:
        await backend.close()


@contextlib.contextmanager
def role_without_channel(pg_url: str, privileges: str, *, writer: bool = False) -> Iterator[str]:
    """A login role of its own, granted ``privileges`` on every table of the ledger's
    schema but not ``notify_channel`` (``writer``: and what a read-write open needs of
    the database and the schema); the ledger's URL as that role. Dropped after."""
    base, _, schema = pg_url.partition("?schema=")
    database = urllib.parse.urlsplit(base).path.lstrip("/")
    role = f"role_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        try:
            if writer:
                admin.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{role}"')
                admin.execute(f'GRANT CREATE ON SCHEMA "{schema}" TO "{role}"')
            admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
            admin.execute(f'GRANT {privileges} ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
            admin.execute(f'REVOKE SELECT ON "{schema}".notify_channel FROM "{role}"')
            parts = urllib.parse.urlsplit(pg_url)
            as_role = parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}")
            yield urllib.parse.urlunsplit(as_role)
        finally:
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')


async def test_each_ledger_has_a_random_channel_of_its_own(pg_url: str, other_url: str) -> None:
    first = await channel_of(pg_url)
    assert _RANDOM.fullmatch(first)
    assert await channel_of(pg_url) == first  # kept in the ledger: every open agrees
    assert await channel_of(other_url) != first


async def test_a_role_that_may_not_read_the_channel_opens_the_ledger_to_read(
    pg_url: str,
) -> None:
    """A dashboard's role, granted the ledger's tables but not ``notify_channel`` (as
    docs/deployment.md advises), opens the ledger read-only and reads it; it can
    neither learn the channel nor is asked to (a reader neither cancels nor listens)."""
    owner = await PostgresBackend.open(pg_url)  # the ledger, made by its owner
    await owner.create_run(run_spec())
    await owner.close()
    with role_without_channel(pg_url, "SELECT") as reader_url:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            sql(reader_url, "SELECT name FROM notify_channel")
        reader = await PostgresBackend.open(reader_url, read_only=True)  # the CLI's
        try:
            assert reader.dialect.channel is None
            assert (await reader.get_run("run_a")).id == "run_a"
        finally:
            await reader.close()


async def test_a_writer_that_may_not_read_the_channel_is_refused_by_name(
    pg_url: str,
) -> None:
    """A worker's role granted the ledger's tables to write but not ``notify_channel``
    cannot notify its cancels where the listeners hear them: its read-write open is
    refused with ``LedgerUnavailable`` naming the table, and writes nothing."""
    owner = await PostgresBackend.open(pg_url)
    await owner.create_run(run_spec())
    await owner.close()
    before = sql(pg_url, "SELECT count(*) FROM events")
    writes = "SELECT, INSERT, UPDATE"
    with (
        role_without_channel(pg_url, writes, writer=True) as writer_url,
        pytest.raises(LedgerUnavailable, match="notify_channel"),
    ):
        await PostgresBackend.open(writer_url)
    assert sql(pg_url, "SELECT count(*) FROM events") == before
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(SCHEMA_VERSION,)]


async def test_a_v4_ledger_gets_its_channel_when_migrated(pg_url: str) -> None:
    """A ledger from before V5 (its table gone, its version 4) is migrated on its next
    read-write open: it gets a channel, and keeps what it had."""
    backend = await PostgresBackend.open(pg_url)
    await backend.create_run(run_spec())
    await backend.close()
    sql(pg_url, "DROP TABLE notify_channel")
    sql(pg_url, "DROP INDEX runs_cancelled")  # V6's
    sql(pg_url, "DROP INDEX runs_created")  # V7's
    sql(pg_url, "UPDATE stopline_schema SET version = 4")
    assert _RANDOM.fullmatch(await channel_of(pg_url))
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(SCHEMA_VERSION,)]
    assert sql(pg_url, "SELECT id FROM runs") == [("run_a",)]


async def test_a_notification_on_the_name_the_channel_had_is_not_heard(pg_url: str) -> None:
    """Sent by any client that can connect, on the name derived from the schema, a
    notification naming a run whose call awaits its tool interrupts nothing. A real
    cancel of another run, committed after it, is heard: the listener was listening."""
    heard: list[list[str]] = []
    marker_heard = anyio.Event()
    schema = pg_url.partition("?schema=")[2]
    canceller = await PostgresBackend.open(pg_url)
    try:
        async with stopline.open(pg_url) as ledger, anyio.create_task_group() as tg:
            held = Held(ledger, "victim")

            def hear(run_ids: Sequence[str]) -> None:
                heard.append(list(run_ids))
                if "marker" in run_ids:
                    marker_heard.set()

            ledger.on_cancel(hear)
            tg.start_soon(held.workflow)
            await held.entered.wait()
            await canceller.create_run(run_spec("marker"))
            sql(pg_url, "SELECT pg_notify(%s, %s)", f"stopline_cancel_{schema}", '["victim"]')
            await canceller.cancel("marker", by="u")
            with anyio.fail_after(10):
                await marker_heard.wait()
            assert heard == [["marker"]]
            assert not held.interrupted.is_set()
            await canceller.cancel("victim", by="u")  # the real one ends the call
            with anyio.fail_after(10):
                await held.interrupted.wait()
    finally:
        await canceller.close()


async def test_the_listen_statement_does_not_show_the_channel(pg_url: str) -> None:
    """What the server shows of the listening connection (``pg_stat_activity``, and so
    ``pg_stat_statements``) is the statement's text: the name is not in it."""
    async with stopline.open(pg_url) as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        channel = backend.dialect.channel
        assert channel is not None
        pid = backend.listener.pid
        ((query,),) = sql(pg_url, "SELECT query FROM pg_stat_activity WHERE pid = %s", pid)
        assert "LISTEN" in query
        assert channel not in query


async def test_a_read_only_role_reads_a_ledger_one_release_behind(pg_url: str) -> None:
    """ADR 0047: a role that may only read (it could never migrate) reads a ledger its
    workers have not migrated yet, V7's index not built, and the page from it; one
    older than ``READABLE_FROM`` is ``SchemaTooOld`` to it, naming the way on."""
    owner = await PostgresBackend.open(pg_url)
    await owner.create_run(run_spec())
    await owner.close()
    sql(pg_url, "DROP INDEX runs_created")
    sql(pg_url, "UPDATE stopline_schema SET version = 6")
    with role_without_channel(pg_url, "SELECT") as reader_url:
        reader = await PostgresBackend.open(reader_url, read_only=True)
        try:
            [(run, ops)] = await reader.list_trees()
            assert (run.id, ops) == ("run_a", [])
        finally:
            await reader.close()
        sql(pg_url, "UPDATE stopline_schema SET version = 4")
        with pytest.raises(SchemaTooOld, match="open it once read-write"):
            await PostgresBackend.open(reader_url, read_only=True)
    assert sql(pg_url, "SELECT version FROM stopline_schema") == [(4,)]
