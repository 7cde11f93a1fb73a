"""Read commands open the ledger read-only: they never change a file or a database.

A file or database that is not a stopline ledger gets a typed error and stays
byte-identical, whatever the command (writing commands check it read-only first).
"""

from __future__ import annotations

import hashlib
import sqlite3
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.cli import EXIT_ERROR, EXIT_OK
from tests.postgres.server import drop_schema, require_server, with_schema
from tests.surfaces.test_cli import stopline_cli

READS = (("runs",), ("stats",), ("review", "list"))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def _one_run(url: str) -> str:
    async with stopline.open(url) as ledger, ledger.run("x", owner="user:ada") as run:
        pass
    return run.id


def test_a_read_only_ledger_file_is_read_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    run_id = anyio.run(_one_run, url)
    before = digest(path)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP)
    try:
        for args in (*READS, ("show", run_id), ("review", "show", "nope/1:x")):
            done = stopline_cli(*args, ledger=url)
            expected = EXIT_ERROR if args[-1] == "nope/1:x" else EXIT_OK
            assert done.returncode == expected, (args, done.stderr)
            assert "Traceback" not in done.stderr
        assert run_id in stopline_cli("runs", ledger=url).stdout
    finally:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert digest(path) == before


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, owner TEXT)")
        db.execute("INSERT INTO accounts (owner) VALUES ('someone else')")
    sqlite3.connect(path).close()


def _empty_database(path: Path) -> None:
    with sqlite3.connect(path) as db:  # a valid SQLite header, no tables
        db.execute("CREATE TABLE t (x)")
        db.execute("DROP TABLE t")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_foreign, "not a stopline ledger (foreign tables found)"),
        (lambda p: p.write_bytes(b""), "not a stopline ledger (an empty database)"),
        (_empty_database, "not a stopline ledger (an empty database)"),
        (lambda p: p.write_bytes(b"just some notes\n" * 300), "file is not a database"),
    ],
    ids=["foreign-schema", "empty-file", "empty-database", "not-sqlite"],
)
def test_what_is_not_a_ledger_is_refused_and_left_byte_identical(
    tmp_path: Path, make: object, says: str
) -> None:
    path = tmp_path / "other.db"
    make(path)  # type: ignore[operator]
    before = digest(path)
    for args in (*READS, ("show", "run_x"), ("cancel", "run_x"), ("resume", "run_x")):
        done = stopline_cli(*args, ledger=f"sqlite:///{path}")
        assert done.returncode == EXIT_ERROR, (args, done.stdout, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]  # no -wal, no -journal


@pytest.fixture
def pg_schema() -> Iterator[tuple[str, str]]:
    url = require_server()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    try:
        yield url, schema
    finally:
        drop_schema(schema)


def _tables(url: str, schema: str) -> list[str]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchall()
        namespaces = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)
        ).fetchone()
    assert namespaces is not None
    return [r[0] for r in rows] if namespaces[0] else ["<no schema>"]


def test_an_unknown_postgres_schema_is_refused_and_not_created(
    pg_schema: tuple[str, str],
) -> None:
    url, schema = pg_schema
    done = stopline_cli("runs", ledger=with_schema(url, schema))
    assert done.returncode == EXIT_ERROR
    assert f"no schema {schema!r}: not a stopline ledger" in done.stderr
    assert _tables(url, schema) == ["<no schema>"]


def test_an_empty_or_foreign_postgres_schema_is_refused_and_unchanged(
    pg_schema: tuple[str, str],
) -> None:
    import psycopg

    url, schema = pg_schema
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    for args in (("runs",), ("cancel", "run_x")):
        done = stopline_cli(*args, ledger=with_schema(url, schema))
        assert done.returncode == EXIT_ERROR
        assert "not a stopline ledger (an empty database)" in done.stderr
    assert _tables(url, schema) == []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".accounts (id int)')
    done = stopline_cli("show", "run_x", ledger=with_schema(url, schema))
    assert "not a stopline ledger (foreign tables found)" in done.stderr
    assert _tables(url, schema) == ["accounts"]


def test_a_postgres_ledger_is_read_in_read_only_transactions(pg_schema: tuple[str, str]) -> None:
    url, schema = pg_schema
    ledger_url = with_schema(url, schema)
    run_id = anyio.run(_one_run, ledger_url)

    async def try_to_write() -> None:
        from stopline.ledger import open_backend

        backend = await open_backend(ledger_url, read_only=True)
        try:
            assert (await backend.get_run(run_id)).id == run_id
            with pytest.raises(stopline.LedgerError, match="read-only transaction"):
                await backend.cancel(run_id, by="x", reason="")
        finally:
            await backend.close()

    anyio.run(try_to_write)
    assert run_id in stopline_cli("runs", ledger=ledger_url).stdout
