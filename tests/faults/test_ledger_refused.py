"""A write the ledger's database refuses for good is a typed error, ``LedgerRefused``
(ADR 0079), never retried.

Before, the engines reported a constraint, a value the database cannot store or an
operator's trigger as a plain ``LedgerError``: "may clear by itself" to the error
boundary, so a background step that met one was retried for as long as the process
lived, and the outbox took six tries (about 1.5 s of backoff) to tell a refusal from
a storage fault. The errors here are the real engines' own, raised by a real SQLite
file and the real PostgreSQL.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import stopline
from stopline.errors import LedgerError, LedgerRefused
from stopline.ledger.postgres_errors import map_error
from stopline.ledger.sqlite_errors import sqlite_error
from stopline.runtime.boundary import retryable
from stopline.runtime.outbox import refused
from tests.faults.recovery_outside_agent import Plan, effects, make_tool
from tests.faults.recovery_outside_harness import ledger_urls, outside_sql

__all__ = ["ledger_urls"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)


def _sqlite_raises(tmp_path: Path, *statements: str) -> sqlite3.Error:
    conn = sqlite3.connect(tmp_path / "refusing.db")
    try:
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL CHECK (v != 'x'))")
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        for statement in statements:
            conn.execute(statement)
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError(f"SQLite took {statements}")


@pytest.mark.parametrize(
    ("statement", "what"),
    [
        ("INSERT INTO t VALUES (2, 'x')", "CHECK constraint failed"),
        ("INSERT INTO t VALUES (2, NULL)", "NOT NULL constraint failed"),
        ("INSERT INTO t VALUES ('not a rowid', 'a')", "datatype mismatch"),
        ("SELECT RAISE(ABORT, 'refused by a trigger')", "refused by a trigger"),
    ],
    ids=["check", "not-null", "mismatch", "trigger"],
)
def test_sqlite_reports_a_refused_write_as_ledger_refused(
    tmp_path: Path, statement: str, what: str
) -> None:
    if statement.startswith("SELECT RAISE"):  # RAISE runs only in a trigger
        statement = "UPDATE t SET v = 'b'"
        setup = (
            "CREATE TRIGGER no BEFORE UPDATE ON t BEGIN"
            " SELECT RAISE(ABORT, 'refused by a trigger'); END"
        )
        exc = _sqlite_raises(tmp_path, setup, statement)
    else:
        exc = _sqlite_raises(tmp_path, statement)
    err = sqlite_error("sqlite:///refusing.db", exc)
    assert type(err) is LedgerRefused and what in str(err)
    assert not retryable(err) and refused(err, 1)


def test_sqlite_a_unique_key_taken_is_refused_too(tmp_path: Path) -> None:
    # one writer at a time: a key taken is no race another try could win
    err = sqlite_error("l", _sqlite_raises(tmp_path, "INSERT INTO t VALUES (1, 'b')"))
    assert type(err) is LedgerRefused and "UNIQUE constraint failed" in str(err)


@pytest.fixture
def pg() -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(
            "CREATE TEMPORARY TABLE t (id int PRIMARY KEY, v text NOT NULL CHECK (v <> 'x'))"
        )
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute(
            "CREATE FUNCTION pg_temp.no() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER no BEFORE UPDATE ON t FOR EACH ROW EXECUTE FUNCTION pg_temp.no()"
        )
        yield conn


def _pg_raises(pg: psycopg.Connection[tuple[object, ...]], statement: str) -> psycopg.Error:
    try:
        pg.execute(statement)
    except psycopg.Error as exc:
        return exc
    raise AssertionError(f"PostgreSQL took {statement}")


@pytest.mark.parametrize(
    ("statement", "what"),
    [
        ("INSERT INTO t VALUES (2, 'x')", "violates check constraint"),
        ("INSERT INTO t VALUES (2, NULL)", "violates not-null constraint"),
        ("INSERT INTO t VALUES (2, chr(0))", "null character not permitted"),
        ("INSERT INTO t VALUES (2147483648, 'a')", "out of range"),
        ("UPDATE t SET v = 'b'", "refused by a trigger"),
    ],
    ids=["check", "not-null", "nul", "out-of-range", "trigger"],
)
def test_postgres_reports_a_refused_write_as_ledger_refused(
    pg: psycopg.Connection[tuple[object, ...]], statement: str, what: str
) -> None:
    err = map_error("postgresql://127.0.0.1/test", _pg_raises(pg, statement), retried_for=0)
    assert type(err) is LedgerRefused and what in str(err)
    assert isinstance(err.__cause__, psycopg.Error)
    assert not retryable(err) and refused(err, 1)


def test_postgres_a_unique_key_taken_stays_unclassified(
    pg: psycopg.Connection[tuple[object, ...]],
) -> None:
    # two sessions inserting one row at once meet this too, and a retry reads the row:
    # a plain LedgerError, retried; the outbox takes it as refused after its tries
    err = map_error("l", _pg_raises(pg, "INSERT INTO t VALUES (1, 'b')"), retried_for=0)
    assert type(err) is LedgerError and "duplicate key" in str(err)
    assert retryable(err) and not refused(err, 1)


async def test_a_gate_the_ledger_refuses_raises_ledger_refused_and_sends_nothing(
    tmp_path: Path, ledger_urls: str
) -> None:
    destination = str(tmp_path / "destination.db")
    tool = make_tool(Plan(ledger_urls, destination, "run_g", ("k",)))
    async with stopline.open(ledger_urls, tools=[tool]) as ledger:
        outside_sql(  # an operator's rule: no intent of key k, ever
            ledger_urls,
            *(
                [
                    "CREATE TRIGGER refuse_k BEFORE INSERT ON operations"
                    " WHEN NEW.id = 'run_g/k' BEGIN SELECT RAISE(ABORT, 'no k'); END"
                ]
                if ledger_urls.startswith("sqlite:")
                else [
                    "CREATE OR REPLACE FUNCTION refuse_k() RETURNS trigger LANGUAGE plpgsql"
                    " AS $$ BEGIN RAISE EXCEPTION 'no k'; END $$",
                    "CREATE TRIGGER refuse_k BEFORE INSERT ON operations FOR EACH ROW"
                    " WHEN (NEW.id = 'run_g/k') EXECUTE FUNCTION refuse_k()",
                ]
            ),
        )
        async with ledger.run("agent", owner="user:1", run_id="run_g") as run:
            with pytest.raises(LedgerRefused, match="no k"):
                await run.call(tool, 1, key="k")
            other = await run.call(tool, 2, key="other")  # the run goes on
        ops = {op.id for op in await ledger.backend.operations("run_g")}
        health = ledger.health.to_json()
    assert other == {"charged": 2, "key": "run_g/other"}
    assert ops == {"run_g/other"}  # nothing of the refused write landed
    assert effects(destination) == ["run_g/other"]  # and nothing was sent for it
    assert not health["degraded"]
