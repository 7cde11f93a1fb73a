"""Truth figures: a runtime's start on a big ledger, and a receipt in it.

The big ledger is built with bulk SQL (recursive CTEs, no fsync) in the same
schema the runtime writes: runs of 100 resolved operations each, plus 1,000
operations left ``requested`` by a worker whose process is gone. Baselines
are bare indexed SELECTs on the same file, measured in the same run.
"""

from __future__ import annotations

import socket
import sqlite3
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio

import stopline
from stopline.bench.figures import Figure
from stopline.domain.vocab import Cancellable, OpStatus, Policy, RunState
from stopline.ledger.engine.guards import sql_values
from stopline.ledger.engine.reads import in_flight_where
from stopline.ledger.sqlite import SQLiteBackend

__all__ = ["measure"]

# the seeded rows' vocabulary, spelled from the domain's enums
_COMPLETED, _RUNNING = sql_values([RunState.COMPLETED]), sql_values([RunState.RUNNING])
_COMMITTED, _REQUESTED = sql_values([OpStatus.COMMITTED]), sql_values([OpStatus.REQUESTED])
_NEVER, _VERIFY = sql_values([Cancellable.NEVER]), sql_values([Policy.VERIFY])

PER_RUN = 100
UNRESOLVED = 1_000
PAGE = 200  # the console's runs page


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _build(path: Path, resolved: int) -> str:
    """The ledger: ``resolved`` committed operations, then the open ones. Returns a run id."""
    runs = resolved // PER_RUN
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("BEGIN")
        now = time.time() - 3600
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            " INSERT INTO runs (id, name, owner, tenant, state, fence, grants, policy,"
            f" created_at, updated_at) SELECT 'run_' || i, 'bench', 'bench', 't', {_COMPLETED},"
            f" 0, 15, {_VERIFY}, ? + i, ? + i FROM n",
            (runs - 1, now, now),
        )
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            " INSERT INTO operations (id, run_id, tool, description, args_digest, status,"
            " cancellable, can_verify, can_compensate, evidence, created_at, updated_at)"
            " SELECT 'run_' || (i / ?) || '/' || (i % ?), 'run_' || (i / ?), 'pay', 'pay',"
            f" 'd', {_COMMITTED}, {_NEVER}, 1, 0,"
            ' \'[{"kind":"local","ref":"gate"},{"kind":"response_digest","ref":"sha256:0"}]\','
            " ? + i / 1000.0, ? + i / 1000.0 FROM n",
            (resolved - 1, PER_RUN, PER_RUN, PER_RUN, now, now),
        )
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            " INSERT INTO operations (id, run_id, tool, description, args_digest, status,"
            " cancellable, can_verify, can_compensate, evidence, created_at, updated_at, worker)"
            f" SELECT 'run_' || ? || '/open' || i, 'run_' || ?, 'pay', 'pay', 'd', {_REQUESTED},"
            f" {_NEVER}, 1, 0,"
            '  \'[{"kind":"local","ref":"gate"}]\', ?, ?, \'w_dead\' FROM n',
            (UNRESOLVED - 1, runs, runs, now, now),
        )
        conn.execute(
            "INSERT INTO runs (id, name, owner, tenant, state, fence, grants, policy,"
            f" created_at, updated_at) VALUES (?, 'bench', 'bench', 't', {_RUNNING}, 0, 15,"
            f" {_VERIFY}, ?, ?)",
            (f"run_{runs}", now, now),
        )
        conn.execute(
            "INSERT INTO workers VALUES ('w_dead', ?, ?, ?, ?, ?)",
            (socket.gethostname(), _dead_pid(), now, now, now + 1e9),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("ANALYZE")
    finally:
        conn.close()
    return f"run_{runs // 2}"


def _bare(path: Path, sql: str, params: tuple[Any, ...], n: int) -> list[float]:
    conn = sqlite3.connect(path)
    try:
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            conn.execute(sql, params).fetchall()
            samples.append(time.perf_counter() - start)
        return samples
    finally:
        conn.close()


async def _never(ctx: stopline.CallContext) -> stopline.ReadBack:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def measure(*, quick: bool, workdir: Path, postgres: str | None = None) -> list[Figure]:
    del postgres
    resolved = 100_000 if quick else 1_000_000
    path = workdir / "truth.db"
    backend = await SQLiteBackend.open(path)  # the schema, migrated as the runtime does
    await backend.close()
    receipt_run = _build(path, resolved)
    open_sql = f"SELECT * FROM operations INDEXED BY ops_open WHERE {in_flight_where()}"
    bare_open = statistics.median(_bare(path, open_sql, (), 5))

    tool: stopline.Tool[Any] = stopline.Tool(_never, name="pay")
    tool.verify_fn = _never
    ledger = stopline.open(f"sqlite:///{path}", tools=[tool])
    start = time.perf_counter()
    await ledger.__aenter__()  # register, find the dead worker's 1,000, mark, queue
    started = time.perf_counter() - start
    try:
        queued = ledger.core.settler.verifying
        samples = []
        for _ in range(30 if quick else 100):
            t0 = time.perf_counter()
            receipt = await ledger.receipt(receipt_run)
            samples.append(time.perf_counter() - t0)
        assert len(receipt.lines) == PER_RUN
        page = []  # the console's runs page: the newest runs and their receipts at once
        for _ in range(5 if quick else 10):
            t0 = time.perf_counter()
            rows = await ledger.runs_with_receipts(limit=PAGE)
            page.append(time.perf_counter() - t0)
        assert len(rows) == PAGE
    finally:
        await ledger.__aexit__(None, None, None)
    run_sql = "SELECT * FROM operations WHERE run_id = ? ORDER BY rowid"
    bare_run = _bare(path, run_sql, (receipt_run,), len(samples))
    page_sql = (
        "SELECT * FROM operations WHERE run_id IN (SELECT id FROM runs"
        f" ORDER BY created_at DESC LIMIT {PAGE}) ORDER BY created_at, id"
    )
    bare_page = _bare(path, page_sql, (), len(page))
    size = f"{resolved:,} resolved + {UNRESOLVED:,} open operations"
    return [
        Figure(
            "recovery_1m_s",
            started,
            "s",
            bare_open,
            "< 1 s",
            f"start on {size}{' (quick: 100k)' if quick else ''}; {queued} queued for "
            "reconciliation; baseline: bare indexed SELECT of the open rows",
        ),
        Figure(
            "receipt_1m_ms",
            statistics.median(samples) * 1e3,
            "ms",
            statistics.median(bare_run) * 1e3,
            "< 5 ms",
            f"p50 receipt of a {PER_RUN}-operation run in {size}; "
            "baseline: bare SELECT of the run's rows",
        ),
        Figure(
            "runs_page_1m_ms",
            statistics.median(page) * 1e3,
            "ms",
            statistics.median(bare_page) * 1e3,
            "",
            f"p50 console page: the newest {PAGE} runs and their receipts ({PAGE * PER_RUN:,}"
            f" operations) in {size}; baseline: bare SELECT of their operations",
        ),
    ]
