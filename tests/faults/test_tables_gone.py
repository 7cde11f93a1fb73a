"""A ledger's tables dropped under a running process: each call that meets it gets
``LedgerCorrupt`` naming the table, nothing is dispatched, and no background step
retries it for as long as the process lives (before, each retried "relation does not
exist" as a ``LedgerError`` every few seconds, and the PostgreSQL listener re-listened
every second, for ever). Found by dropping the PostgreSQL soak's schema under it."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import psycopg
import pytest

import stopline
from stopline.errors import LedgerCorrupt
from stopline.ledger.postgres import PostgresBackend
from stopline.runtime.boundary import Health
from stopline.testing import FakeProvider
from tests.postgres.server import server_url, terminate

pytestmark = pytest.mark.timeout(60)


async def drop_between_calls(
    ledger: stopline.Ledger, provider: FakeProvider, drop: Callable[[], None]
) -> None:
    """Run ``run_a``: one call, then ``drop()`` (the tables go), then a second call."""
    async with ledger.run("job", owner="u", run_id="run_a") as run:
        await run.call(provider.tool, "1", key="1")
        drop()
        await run.call(provider.tool, "2", key="2")


def not_retried(health: Health) -> None:
    """At least one background step met the error, and none was retried for it; the
    worker shows as degraded for good (it did while the steps retried)."""
    steps = health.to_json()["steps"]
    assert health.failures >= 1, steps
    assert health.degraded and "a table of the ledger is gone" in health.broken
    assert all(s["retries"] == 0 and s["failing"] == 0 for s in steps.values()), steps
    assert all("gone" in s["last_error"] for s in steps.values()), steps


async def test_a_dropped_postgresql_schema_fails_each_call_and_stops_the_steps(
    pg_url: str,
) -> None:
    provider = FakeProvider("p")
    schema = pg_url.partition("?schema=")[2]
    async with stopline.open(pg_url) as ledger:
        backend = ledger.backend
        assert isinstance(backend, PostgresBackend)
        listener = backend.listener

        def drop() -> None:
            with psycopg.connect(server_url(), autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA "{schema}" CASCADE')

        with pytest.raises(LedgerCorrupt, match=r'"(runs|operations)" does not exist') as info:
            await drop_between_calls(ledger, provider, drop)
        assert "a table of the ledger is gone" in str(info.value)
        assert listener.pid is not None
        terminate(backend.conninfo, listener.pid)  # its re-LISTEN meets the same
        with anyio.fail_after(30):
            await listener.ended.wait()
            while not ledger.health.failures:  # the run's end, handed to the background
                await ledger.health.changed()
        assert isinstance(listener.stopped, LedgerCorrupt)
        health = ledger.health
    assert provider.requests == ["run_a/1"]  # the second call was never dispatched
    not_retried(health)


async def test_a_dropped_sqlite_table_fails_the_call_and_stops_the_steps(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    provider = FakeProvider("p")
    async with stopline.open(f"sqlite:///{path}") as ledger:

        def drop() -> None:
            with sqlite3.connect(path, isolation_level=None) as other:
                other.execute("DROP TABLE operations")  # another process, by hand

        with pytest.raises(LedgerCorrupt, match="no such table: operations") as info:
            await drop_between_calls(ledger, provider, drop)
        assert "a table of the ledger is gone" in str(info.value)
        with anyio.fail_after(30):
            while not ledger.health.failures:  # the run's end, handed to the background
                await ledger.health.changed()
        health = ledger.health
    assert provider.requests == ["run_a/1"]
    not_retried(health)
