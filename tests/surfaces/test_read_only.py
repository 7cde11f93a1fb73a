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


def _behind(path: Path, version: int) -> None:
    """The ledger at ``path`` as the stopline of schema ``version`` left it: on SQLite
    V5 and V6 are PostgreSQL's alone, so a V7 file without V7's index is a V4..V6 one."""
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute("DROP INDEX runs_created")
        db.execute(f"PRAGMA user_version = {version}")
    sqlite3.connect(path).close()


def _version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def test_migrations_a_read_only_open_reads_across_add_indexes_only() -> None:
    """``READABLE_FROM``'s rule: every migration after it only adds an index, on both
    engines, so a read of a ledger not yet migrated gives the answer it gives after."""
    from stopline.ledger.postgres_schema import translate
    from stopline.ledger.schema import MIGRATIONS, READABLE_FROM, SCHEMA_VERSION, PostgresOnly

    assert 1 <= READABLE_FROM <= SCHEMA_VERSION
    for step in MIGRATIONS[READABLE_FROM:]:
        on_sqlite = [] if isinstance(step, PostgresOnly) else step.split(";")
        for statement in (*on_sqlite, *translate(step)):
            if statement.strip():
                assert statement.strip().startswith("CREATE INDEX "), statement


def test_a_ledger_behind_by_indexes_only_is_read_unchanged(tmp_path: Path) -> None:
    """A newer CLI reads a ledger its workers have not migrated yet (a read-only file
    too), and leaves it as it was; a writing command migrates it."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    run_id = anyio.run(_one_run, url)
    _behind(path, 6)
    before = digest(path)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP)
    try:
        for args in (*READS, ("show", run_id)):
            done = stopline_cli(*args, ledger=url)
            assert done.returncode == EXIT_OK, (args, done.stderr)
        assert run_id in stopline_cli("runs", ledger=url).stdout
    finally:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert digest(path) == before
    assert stopline_cli("cancel", run_id, ledger=url).returncode == EXIT_OK
    assert _version(path) == 7


def test_a_ledger_older_than_the_reads_is_refused_to_read_and_migrated_by_a_write(
    tmp_path: Path,
) -> None:
    """Below ``READABLE_FROM`` a read is refused with ``SchemaTooOld``, naming the way
    on, and the file is left as it was; a writing command is not refused (its check
    before the write used to refuse it, so the message's way on did not work) and
    migrates it, and the reads work from then on."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    run_id = anyio.run(_one_run, url)
    _behind(path, 4)
    before = digest(path)
    for args in READS:
        done = stopline_cli(*args, ledger=url)
        assert done.returncode == EXIT_ERROR
        assert "schema version 4 predates what this stopline reads (5 to 7)" in done.stderr
        assert "Traceback" not in done.stderr
    assert digest(path) == before

    async def read_only() -> None:
        from stopline.ledger import open_backend

        with pytest.raises(stopline.SchemaTooOld) as refused:
            await open_backend(url, read_only=True)
        assert isinstance(refused.value, stopline.LedgerUnavailable)
        assert (refused.value.found, refused.value.readable_from) == (4, 5)

    anyio.run(read_only)
    done = stopline_cli("cancel", run_id, ledger=url)
    assert done.returncode == EXIT_OK, done.stderr
    assert _version(path) == 7
    assert run_id in stopline_cli("runs", ledger=url).stdout


def test_a_postgres_ledger_behind_is_read_or_refused_and_migrated_by_a_write(
    pg_schema: tuple[str, str],
) -> None:
    """On PostgreSQL too: one version behind (V7's index gone) is read; V4 (V5's
    channel and V6's and V7's indexes gone) is refused to a read and migrated by a
    write, its channel made."""
    import psycopg

    url, schema = pg_schema
    ledger_url = with_schema(url, schema)
    run_id = anyio.run(_one_run, ledger_url)

    def behind(version: int, *drops: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            for drop in drops:
                conn.execute(f'DROP {drop.split()[0]} "{schema}".{drop.split()[1]}')
            conn.execute(f'UPDATE "{schema}".stopline_schema SET version = {version}')

    def version() -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            found = conn.execute(f'SELECT version FROM "{schema}".stopline_schema').fetchone()
            return int(found[0]) if found else 0

    behind(6, "INDEX runs_created")
    assert run_id in stopline_cli("runs", ledger=ledger_url).stdout
    assert version() == 6
    behind(4, "INDEX runs_cancelled", "TABLE notify_channel")
    done = stopline_cli("runs", ledger=ledger_url)
    assert done.returncode == EXIT_ERROR
    assert "schema version 4 predates what this stopline reads (5 to 7)" in done.stderr
    assert version() == 4
    assert stopline_cli("cancel", run_id, ledger=ledger_url).returncode == EXIT_OK
    assert version() == 7
    assert run_id in stopline_cli("runs", ledger=ledger_url).stdout
