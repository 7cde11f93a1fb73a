"""Bad files and shared files: a typed error naming the path, and nothing lost."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import stopline
from stopline.errors import (
    IdempotencyConflict,
    LedgerCorrupt,
    LedgerLocked,
    LedgerUnavailable,
    SchemaTooNew,
    UnknownOperation,
    UnknownRun,
)
from stopline.ledger.sqlite import SQLiteBackend
from stopline.testing import FakeProvider


async def make_ledger(path: Path) -> None:
    async with (
        stopline.open(f"sqlite:///{path}") as ledger,
        ledger.run("job", owner="u", run_id="run_1") as run,
    ):
        await run.call(FakeProvider("send").tool, "hi")


async def test_corrupt_file_is_named_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 100)
    before = path.read_bytes()
    with pytest.raises(LedgerCorrupt) as info:
        async with stopline.open(f"sqlite:///{path}"):
            pass
    assert str(path) in str(info.value)
    assert path.read_bytes() == before


async def test_truncated_ledger_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await make_ledger(path)
    data = path.read_bytes()
    path.write_bytes(data[:100] + b"\x00garbage" * 64 + data[700:])
    with pytest.raises(LedgerCorrupt) as info:
        async with stopline.open(f"sqlite:///{path}") as ledger:
            await ledger.receipt("run_1")
    assert str(path) in str(info.value)


async def test_newer_schema_is_refused_before_any_write(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await make_ledger(path)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    events_before = _count(path, "events")
    with pytest.raises(SchemaTooNew) as info:
        async with stopline.open(f"sqlite:///{path}"):
            pass
    assert info.value.found == 99
    assert "newer stopline" in str(info.value) and str(path) in str(info.value)
    assert _count(path, "events") == events_before


async def test_foreign_database_is_not_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(LedgerCorrupt, match="not a stopline ledger"):
        async with stopline.open(f"sqlite:///{path}"):
            pass
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
    assert tables == ["customers"]


async def test_missing_directory_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "ledger.db"
    with pytest.raises(LedgerUnavailable, match="does not exist"):
        async with stopline.open(f"sqlite:///{path}"):
            pass


async def test_unknown_url_and_option(tmp_path: Path) -> None:
    with pytest.raises(LedgerUnavailable, match="unsupported ledger URL"):
        async with stopline.open("mysql://x"):
            pass
    with pytest.raises(LedgerUnavailable, match="unknown option"):
        async with stopline.open(f"sqlite:///{tmp_path}/l.db?turbo=1"):
            pass


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("cache_mib=1&cache_mib=512", "cache_mib is given twice"),
        ("busy_timeout", "busy_timeout is given without a value"),
        ("group_commit_ms=", "group_commit_ms is given without a value"),
        ("turbo", "unknown option(s) ['turbo']"),
        ("synchronous=off", "synchronous='OFF' is not FULL, EXTRA or NORMAL"),
    ],
)
async def test_an_option_given_twice_blank_or_unsafe_is_refused_before_the_file_is_made(
    tmp_path: Path, query: str, says: str
) -> None:
    """An option given twice opened with its last value, one given blank (or without
    ``=``) with its default: silently, either way."""
    path = tmp_path / "l.db"
    with pytest.raises(LedgerUnavailable, match=re.escape(says)):
        async with stopline.open(f"sqlite:///{path}?{query}"):
            pass
    assert not path.exists()


async def test_a_url_holding_a_nul_is_refused_by_name(tmp_path: Path) -> None:
    """It failed with a bare ``ValueError`` ("embedded null byte") from the driver."""
    with pytest.raises(LedgerUnavailable, match="holds a NUL character") as info:
        async with stopline.open(f"sqlite:///{tmp_path}/l.db\x00x"):
            pass
    assert "\x00" not in str(info.value)
    assert not (tmp_path / "l.db").exists()


@pytest.mark.parametrize("value", ["abc", "-5", "nan", "inf", "86401"])
async def test_a_bad_busy_timeout_is_refused_before_the_file_is_made(
    tmp_path: Path, value: str
) -> None:
    """It failed with a bare ``ValueError`` or ``OverflowError``, or opened (a negative
    or endless wait)."""
    path = tmp_path / "l.db"
    with pytest.raises(LedgerUnavailable, match=f"busy_timeout='{value}' is not 0-86400 seconds"):
        async with stopline.open(f"sqlite:///{path}?busy_timeout={value}"):
            pass
    with pytest.raises(LedgerUnavailable, match=r"busy_timeout=.* is not 0-86400 seconds"):
        SQLiteBackend(path, busy_timeout=float(value) if value != "abc" else -1.0)
    assert not path.exists()


async def test_file_locked_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await make_ledger(path)
    holder_code = textwrap.dedent(f"""
        import sqlite3, sys
        conn = sqlite3.connect({str(path)!r}, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        print("locked", flush=True)
        sys.stdin.readline()
    """)
    async with await anyio.open_process([sys.executable, "-c", holder_code]) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert (await holder.stdout.receive()).strip() == b"locked"
        with pytest.raises(LedgerLocked) as info:
            async with stopline.open(f"sqlite:///{path}?busy_timeout=0.2") as ledger:
                await ledger.cancel("run_1", by="u")
        assert str(path) in str(info.value) and "another process" in str(info.value)
        await holder.stdin.send(b"\n")
    async with stopline.open(f"sqlite:///{path}") as ledger:  # nothing was lost
        receipt = await ledger.receipt("run_1")
    assert receipt.headline is stopline.Headline.COMPLETED


def test_two_processes_on_one_file(tmp_path: Path) -> None:
    """Two worker processes dispatch at once on one file; every intent and outcome lands."""
    path = tmp_path / "ledger.db"
    worker = textwrap.dedent(f"""
        import sys, anyio, stopline
        from stopline.testing import FakeProvider
        async def main(name):
            provider = FakeProvider("send")
            async with stopline.open("sqlite:///{path}") as ledger:
                async with anyio.create_task_group() as tg:
                    for r in range(10):
                        async def one(r=r):
                            rid = f"{{name}}-{{r}}"
                            async with ledger.run("job", owner=name, run_id=rid) as run:
                                for i in range(10):
                                    await run.call(provider.tool, i)
                        tg.start_soon(one)
            print(len(provider.effects))
        anyio.run(main, sys.argv[1])
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", worker, name], stdout=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == ["100", "100"]
    with sqlite3.connect(path) as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM operations GROUP BY status"))
        states = dict(conn.execute("SELECT state, count(*) FROM runs GROUP BY state"))
    assert statuses == {"committed": 200}
    assert states == {"completed": 20}
    # per run: created, completed; per operation: gate passed, accepted, committed
    assert _count(path, "events") == 20 * 2 + 200 * 3


async def test_unknown_ids_through_the_runtime(ledger: stopline.Ledger) -> None:
    with pytest.raises(UnknownRun, match="nope"):
        await ledger.cancel("nope", by="u")
    with pytest.raises(UnknownRun):
        await ledger.receipt("nope")
    with pytest.raises(UnknownOperation):
        await ledger.late_response("nope/1", stopline.Verdict.COMMITTED)
    with pytest.raises(UnknownOperation):
        await ledger.verify("nope/1")


async def test_id_reuse_with_other_arguments(ledger: stopline.Ledger) -> None:
    send = FakeProvider("send")
    async with ledger.run("job", owner="u") as run:
        await run.call(send.tool, "one", key="greeting")
        events = await ledger.backend.events(run.id)
        with pytest.raises(IdempotencyConflict, match="greeting"):
            await run.call(send.tool, "two", key="greeting")
        assert await ledger.backend.events(run.id) == events
        again = await run.call(send.tool, "one", key="greeting")  # same args: the recorded result
    assert again == {"id": f"{run.id}/greeting", "value": "one"}
    assert len(send.effects) == 1


def _count(path: Path, table: str) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


async def test_ledger_not_open_is_a_clear_error(tmp_path: Path) -> None:
    ledger = stopline.open(f"sqlite:///{tmp_path}/l.db")
    with pytest.raises(RuntimeError, match="not open"):
        await ledger.receipt("x")


async def test_v1_ledger_is_migrated_in_order_and_keeps_its_history(tmp_path: Path) -> None:
    from stopline.ledger.schema import MIGRATIONS, SCHEMA_VERSION

    path = tmp_path / "old.db"
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.executescript(MIGRATIONS[0])
        conn.execute("PRAGMA user_version = 1")
        conn.execute(
            "INSERT INTO runs (id, name, owner, tenant, state, grants, policy, created_at,"
            " updated_at) VALUES ('run_old', 'job', 'u', 't', 'completed', 15, 'verify', 1, 1)"
        )
        conn.execute(
            "INSERT INTO operations (id, run_id, tool, description, args_digest, status,"
            " cancellable, can_verify, can_compensate, created_at, updated_at, evidence)"
            " VALUES ('run_old/1', 'run_old', 'send', 'send', 'd', 'committed', 'never', 0, 0,"
            " 1, 1, '[]')"
        )
    async with stopline.open(f"sqlite:///{path}") as ledger:
        receipt = await ledger.receipt("run_old")
        op = await ledger.backend.get_operation("run_old/1")
    assert receipt.headline is stopline.Headline.COMPLETED
    assert op.status is stopline.OpStatus.COMMITTED and op.compensates is None
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"run_owners", "approvals", "checkpoints", "workers"} <= tables


async def test_v2_log_is_migrated_whole_and_its_sequence_goes_on(tmp_path: Path) -> None:
    """V3 rebuilds the log without AUTOINCREMENT (ADR 0035): every event kept with its
    seq, and the next events numbered after the largest, as before."""
    from stopline.ledger.schema import MIGRATIONS

    path = tmp_path / "v2.db"
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.executescript(MIGRATIONS[0] + ";" + MIGRATIONS[1])
        conn.execute("PRAGMA user_version = 2")
        conn.execute(
            "INSERT INTO runs (id, name, owner, tenant, state, grants, policy, created_at,"
            " updated_at) VALUES ('run_old', 'job', 'u', 't', 'completed', 15, 'verify', 1, 1)"
        )
        conn.executemany(
            "INSERT INTO events (seq, at, run_id, kind, data) VALUES (?, ?, 'run_old', ?, '{}')",
            [(7, 1.0, "created"), (41, 2.0, "completed")],
        )
        old = conn.execute("SELECT * FROM events ORDER BY seq").fetchall()
    async with (
        stopline.open(f"sqlite:///{path}") as ledger,
        ledger.run("new", owner="u", run_id="run_new"),
    ):
        pass
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT * FROM events WHERE seq <= 41 ORDER BY seq").fetchall() == old
        new = [s for (s,) in conn.execute("SELECT seq FROM events WHERE run_id = 'run_new'")]
        ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()[0]
        index = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events_run'").fetchone()
    assert new and min(new) == 42 and new == sorted(new)
    assert "AUTOINCREMENT" not in ddl and index is not None


async def test_v3_ledger_is_migrated_with_its_cancel_events_indexed_alone(
    tmp_path: Path,
) -> None:
    """V4 indexes the cancel events alone (the cross-process watch reads them through
    that index): a v3 ledger's cancels logged before the migration are in it."""
    from stopline.ledger.schema import MIGRATIONS, SCHEMA_VERSION

    path = tmp_path / "v3.db"
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.executescript(";".join(MIGRATIONS[:3]))
        conn.execute("PRAGMA user_version = 3")
        conn.execute(
            "INSERT INTO runs (id, name, owner, tenant, state, grants, policy, created_at,"
            " updated_at) VALUES ('run_old', 'job', 'u', 't', 'cancelled', 15, 'verify', 1, 1)"
        )
        conn.executemany(
            "INSERT INTO events (seq, at, run_id, kind, data) VALUES (?, ?, 'run_old', ?, '{}')",
            [(1, 1.0, "created"), (2, 2.0, "cancel"), (3, 3.0, "settled")],
        )
    async with stopline.open(f"sqlite:///{path}"):
        pass
    with sqlite3.connect(path) as conn:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events_cancels'")
        indexed = conn.execute(
            "SELECT seq FROM events INDEXED BY events_cancels WHERE kind = 'cancel' AND seq > 0"
        ).fetchall()
        (index,) = ddl.fetchone()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert version == SCHEMA_VERSION == 7  # V5 and V6 are PostgreSQL's: recorded, not run
    assert "notify_channel" not in tables
    assert index.endswith("WHERE kind = 'cancel'")  # partial: no other event is in it
    assert indexed == [(2,)]


async def test_a_v6_ledger_gets_its_runs_indexed_by_start_when_migrated(tmp_path: Path) -> None:
    """V7 indexes the runs by the time they started (a listing of every run, newest
    first, walks it): a ledger from before, its index gone and its version 6, gets it
    on its next read-write open, and the listing reads through it."""
    from stopline.ledger.schema import SCHEMA_VERSION

    path = tmp_path / "v6.db"
    async with stopline.open(f"sqlite:///{path}") as ledger:
        for name in ("first", "second"):
            async with ledger.run(name, owner="u", run_id=name):
                pass
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("DROP INDEX runs_created")
        conn.execute("PRAGMA user_version = 6")
    async with stopline.open(f"sqlite:///{path}") as ledger:
        listed = [run.id for run in await ledger.reads.runs(limit=10)]
    with sqlite3.connect(path) as conn:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM runs ORDER BY created_at DESC LIMIT 10"
        ).fetchall()
    assert version == SCHEMA_VERSION == 7
    assert listed == ["second", "first"]
    assert [step for *_, step in plan] == ["SCAN runs USING INDEX runs_created"]
