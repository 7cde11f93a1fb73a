"""DBOS launched on SQLite or the machine's PostgreSQL, bound to a stopline ledger."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest
import sqlalchemy as sa
from dbos import DBOS, SetWorkflowID

import stopline
from stopline import UnknownRun
from tests.conftest import FAST_VERIFY
from tests.engines import dbos_app, subprocess_worker
from tests.engines.provider import FileProvider

# the marks of a DBOS test module: both engines, and (as test_dbos.py says) a psycopg
# connection of the pool's collected unclosed, tolerated by name
MARKS = [
    pytest.mark.parametrize("backend", ["sqlite", "postgres"]),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function BaseConnection.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]


async def status(workflow_id: str) -> str:
    """DBOS's status of the workflow (it must exist)."""
    found = await DBOS.get_workflow_status_async(workflow_id)
    assert found is not None
    return str(found.status)


async def until_status(workflow_id: str, wanted: str) -> None:
    """Until DBOS has the workflow in the ``wanted`` status."""
    with anyio.fail_after(30):
        # DBOS offers nothing to await for a status: look until it changes
        while await status(workflow_id) != wanted:  # noqa: ASYNC110
            await anyio.sleep(0.05)


@dataclasses.dataclass(frozen=True)
class Databases:
    """DBOS's system database (and schema) and the ledger: on PostgreSQL one database
    holds both, DBOS's system tables and the ledger each in a fresh schema."""

    system_url: str
    schema: str
    ledger_url: str
    # SQLite: how long DBOS's connections wait for a lock (DBOS's own engine: 30 s);
    # None: DBOS's engine
    busy_ms: int | None = None


@dataclasses.dataclass
class Harness:
    ledger: stopline.Ledger
    provider: FileProvider
    dbs: Databases


@contextlib.contextmanager
def databases(backend: str, tmp_path: Path) -> Iterator[Databases]:
    if backend == "sqlite":
        yield Databases(
            f"sqlite:///{tmp_path / 'dbos.sqlite'}", "", f"sqlite:///{tmp_path / 'ledger.db'}"
        )
        return
    from tests.postgres.server import drop_schema, fresh_schema, require_server

    server = require_server()
    schema = f"dbos_{uuid.uuid4().hex[:12]}"
    try:
        for ledger_url in fresh_schema():
            yield Databases(server, schema, ledger_url)
    finally:
        drop_schema(schema)


def launch(dbs: Databases, version: str = "stopline-tests") -> sa.Engine | None:
    """DBOS launched on ``dbs``; another ``version`` recovers none of the tests' workflows
    (a process that only cancels). The engine DBOS was given, if any: the caller
    disposes of it after ``DBOS.destroy()``."""
    config: dict[str, object] = {
        "name": "stopline-tests",
        "system_database_url": dbs.system_url,
        # DBOS recovers only the workflows of its own version, by default a digest of the
        # workflows registered in the process: a test process that imported others
        # (the bench's) would never recover the crashed worker's workflow
        "application_version": version,
    }
    if dbs.schema:
        config["dbos_system_schema"] = dbs.schema
    engine = None
    if dbs.busy_ms is not None:
        engine = config["system_database_engine"] = sqlite_engine(dbs.system_url, dbs.busy_ms)
    DBOS(config=config)  # type: ignore[arg-type]
    DBOS.launch()
    return engine


def sqlite_engine(url: str, busy_ms: int) -> sa.Engine:
    """DBOS's SQLite system database engine as DBOS makes it (immediate transactions,
    foreign keys), but waiting ``busy_ms`` for a lock instead of DBOS's 30 s: a user's
    ``system_database_engine``, DBOS's own setting for a shorter lock wait (its engine
    sets the wait on each connection, over any ``db_engine_kwargs``). The caller
    disposes of it (DBOS does not dispose of an engine it was given)."""
    engine = sa.create_engine(url)

    @sa.event.listens_for(engine, "connect")
    def as_dbos_does(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = "IMMEDIATE"
        dbapi_conn.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
        dbapi_conn.execute("PRAGMA foreign_keys=ON")

    return engine


@contextlib.asynccontextmanager
async def running(dbs: Databases, provider: FileProvider) -> AsyncIterator[Harness]:
    """DBOS launched (recovering what a dead process left) with the gate bound."""
    dbos_app.use(provider)
    async with stopline.open(dbs.ledger_url, verify=FAST_VERIFY) as ledger:
        with dbos_app.gate.bound(ledger):
            engine = launch(dbs)
            try:
                yield Harness(ledger, provider, dbs)
            finally:
                DBOS.destroy()
                if engine is not None:  # DBOS does not dispose of an engine it was given
                    engine.dispose()
    # what the test left for the garbage collector goes now, inside the test (see
    # test_dbos.py's warning filter), not in whichever test runs next
    gc.collect()


@contextlib.asynccontextmanager
async def harness(backend: str, tmp_path: Path) -> AsyncIterator[Harness]:
    with databases(backend, tmp_path) as dbs:
        async with running(dbs, FileProvider(tmp_path / "effects.jsonl")) as h:
            yield h


async def cancelled_in_flight(h: Harness, steps: list[str]) -> str:
    """A ``pipeline`` of ``steps`` cancelled by stopline while its first step is at the
    provider: DBOS has it cancelled, the step let go, the run settled. Its id."""
    hold = h.provider.barriers.hold("received")
    workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
    with SetWorkflowID(workflow_id):
        handle = await DBOS.start_workflow_async(dbos_app.pipeline, steps)
    await hold.reached.wait()
    await h.ledger.cancel(workflow_id, by="user:42", reason="pressed stop")
    await until_status(workflow_id, "CANCELLED")
    hold.release()
    with pytest.raises(BaseException, match="cancelled"):  # DBOS: awaited, cancelled
        await handle.get_result()
    await h.ledger.wait_settled(workflow_id, timeout=15)
    return workflow_id


async def worker_process(
    dbs: Databases, provider: FileProvider, workflow_id: str, *point: str
) -> subprocess_worker.Child:
    """A DBOS process with the gate bound (``dbos_worker``) that starts ``workflow_id``;
    ``point`` as that module says."""
    args = (dbs.system_url, dbs.schema, dbs.ledger_url, str(provider.path), workflow_id)
    return await subprocess_worker.start("tests.engines.dbos_worker", *args, *point)


# -- an outage of DBOS's system database alone, for real (probes 11, 12) -----------------


class Outage(Protocol):
    def begin(self) -> None: ...
    def end(self) -> None: ...


class LockedFile:
    """Another connection holds an exclusive lock on DBOS's SQLite file: DBOS can neither
    read nor write it until the lock goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None

    def begin(self) -> None:
        # begun and ended from worker threads, not always the same one (anyio's)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
        conn.execute("BEGIN EXCLUSIVE")  # waits out DBOS's own writes first
        self.conn = conn

    def end(self) -> None:
        if self.conn is not None:
            self.conn.execute("ROLLBACK")
            self.conn.close()
            self.conn = None


class RoleLockedOut:
    """DBOS connects to PostgreSQL as a role of its own: the server ends that role's
    sessions and refuses its logins (the ledger's, as another role, go on)."""

    def __init__(self, server: str, role: str) -> None:
        self.server, self.role = server, role

    def admin(self, *statements: str) -> None:
        import psycopg

        with psycopg.connect(self.server, autocommit=True) as admin:
            for statement in statements:
                admin.execute(statement)

    def begin(self) -> None:
        self.admin(
            f'ALTER ROLE "{self.role}" NOLOGIN',
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{self.role}'",
        )

    def end(self) -> None:
        self.admin(f'ALTER ROLE "{self.role}" LOGIN')


@contextlib.contextmanager
def outage_ready(
    backend: str, tmp_path: Path, busy_ms: int | None = None
) -> Iterator[tuple[Databases, Outage]]:
    """DBOS's system database, and an outage of it alone (the ledger stays reachable).
    ``busy_ms``: SQLite, how long DBOS waits for a lock (``sqlite_engine``; DBOS's own
    engine waits 30 s): the lock is the outage either way, and a read fails sooner."""
    if backend == "sqlite":
        dbos_file = tmp_path / "dbos.sqlite"
        ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
        dbs = Databases(f"sqlite:///{dbos_file}", "", ledger_url, busy_ms=busy_ms)
        locked = LockedFile(dbos_file)
        try:
            yield dbs, locked
        finally:
            locked.end()
        return
    from sqlalchemy.engine import make_url

    from tests.postgres.server import drop_schema, fresh_schema, require_server

    server = require_server()
    role, secret = f"dbos_probe11_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    schema = f"dbos_{uuid.uuid4().hex[:12]}"
    url = make_url(server)
    locked_out = RoleLockedOut(server, role)
    locked_out.admin(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{secret}'")
    as_role = url.set(username=role, password=secret).render_as_string(hide_password=False)
    try:
        locked_out.admin(f'GRANT CREATE ON DATABASE "{url.database}" TO "{role}"')
        for ledger_url in fresh_schema():
            yield Databases(as_role, schema, ledger_url), locked_out
    finally:
        drop_schema(schema)
        locked_out.admin(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
            f'DROP OWNED BY "{role}"',
            f'DROP ROLE "{role}"',
        )


async def until_opened(h: Harness, run_id: str) -> None:
    """Until the workflow's run is in the ledger."""
    with anyio.fail_after(30):
        while True:
            try:
                await h.ledger.backend.get_run(run_id)
                return
            except UnknownRun:
                await h.ledger.wait_for_change(run_id)


async def until_watch_failing(h: Harness, failing: bool) -> None:
    """Until ``ledger.health`` says the watcher's reads fail (or no longer do)."""
    health = h.ledger.health

    def failing_now() -> bool:
        watch = health.steps.get("watch_dbos_cancels")
        return watch is not None and watch.failing > 0

    with anyio.fail_after(30):
        while failing_now() != failing:
            await health.changed()
